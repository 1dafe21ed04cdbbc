"""What a reset does to the update and the loss: numbers for the report's reset-burst figure
and table.

A run's ``metrics.jsonl`` carries ``update_rms`` (the RMS of the applied AdamW update over
the learning rate) at log steps and at every step for the first steps after a reset. A reset
after step ``r`` zeroes the states, so step ``r + k`` is the ``k``-th update from the fresh
state ("``k`` steps since the reset"; ``k = 0`` is the last update from the old one). A reset
run is compared with its *twin*: the run of the same grid without resets (its name with the
``-resets…`` part removed, a ``-seedN`` suffix kept), which sees the same batches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from experiments.study.summary import scheduled_resets

RMS_KEY = "update_rms"
RMS_AFTER = (1, 10, 50)  # steps since a reset reported in the table
WATCH_STEPS = 50  # steps after a reset that record update_rms every step
GAP_BEFORE = 20  # steps before a reset in the loss-gap window
GAP_PEAK = (11, 30)  # steps since a reset averaged as the loss gap's peak
LATE_FRACTION = 0.2  # the last fifth of a period counts as its late part

_TWIN = re.compile(r"^(?P<base>.*?)-resets.*?(?P<seed>-seed\d+)?$")


def twin_name(name: str) -> str | None:
    """The no-reset twin of a reset run's name (``fp4-sr-resets-rewarm-seed1`` →
    ``fp4-sr-seed1``); None for a name without ``-resets``."""
    match = _TWIN.match(name)
    if match is None:
        return None
    return match["base"] + (match["seed"] or "")


def v_resets(run: Any) -> list[int]:
    """Steps after which the run's ``v`` was reset: as recorded in its summary entry, else
    from its schedule up to the step it reached."""
    recorded = (run.entry.get("resets") or {}).get("v")
    if recorded is not None:
        return sorted(recorded)
    scheduled = scheduled_resets(run.config, run.entry.get("steps_reached", 0))
    return scheduled["v"] if scheduled else []


def period_of(resets: Sequence[int]) -> int | None:
    """The gap between resets when they are periodic (the first reset's step), else None."""
    gaps = {b - a for a, b in zip([0, *resets], resets, strict=False)}
    return resets[0] if len(gaps) == 1 else None


def _by_step(run: Any, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in run.records if key in r and r[key] is not None}


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _aligned(
    series: Mapping[int, float], resets: Sequence[int], offsets: range
) -> dict[int, float]:
    """Mean over resets of ``series[r + k]`` for each offset ``k`` that some reset has."""
    out = {}
    for k in offsets:
        mean = _mean([series[r + k] for r in resets if r + k in series])
        if mean is not None:
            out[k] = mean
    return out


def rms_after_reset(run: Any, offsets: range = range(WATCH_STEPS + 1)) -> dict[int, float]:
    """Update RMS at ``k`` steps since a reset of ``v`` for each of ``offsets`` (``0..50``:
    every step), averaged over the resets that recorded it (past ``k = 50``: those whose
    ``r + k`` is a log step)."""
    return _aligned(_by_step(run, RMS_KEY), v_resets(run), offsets)


def steady_rms(twin: Any, first: int, last: int) -> float | None:
    """The twin's mean update RMS at its log steps in ``(first, last]``."""
    return _mean(
        [
            r[RMS_KEY]
            for r in twin.logged
            if first < r["step"] <= last and r.get(RMS_KEY) is not None
        ]
    )


def loss_gap(run: Any, twin: Any) -> dict[int, float]:
    """Train loss of the run minus its twin's at ``k = -20..period`` steps since a reset of
    ``v``, averaged over the resets (steps both runs reached)."""
    resets = v_resets(run)
    if not resets:
        return {}
    ours, theirs = _by_step(run, "loss"), _by_step(twin, "loss")
    gap = {step: ours[step] - theirs[step] for step in ours.keys() & theirs.keys()}
    period = period_of(resets) or max(b - a for a, b in zip([0, *resets], resets, strict=False))
    return _aligned(gap, resets, range(-GAP_BEFORE, period + 1))


@dataclass
class ResetBurst:
    """One reset run's burst: its resets, update RMS and loss gap to its twin."""

    name: str
    twin: str | None
    resets: list[int]
    period: int | None
    rms: dict[int, float]
    twin_rms: float | None
    gap: dict[int, float]

    def rms_at(self, k: int) -> float | None:
        """Update RMS ``k`` steps after a reset (None: not recorded)."""
        return self.rms.get(k)

    def gap_mean(self, low: int, high: int) -> float | None:
        """Mean loss gap over ``k`` in ``[low, high]``."""
        return _mean([v for k, v in self.gap.items() if low <= k <= high])

    @property
    def gap_before(self) -> float | None:
        """Mean loss gap over the 20 steps before a reset (``k = -20..0``)."""
        return self.gap_mean(-GAP_BEFORE, 0)

    @property
    def gap_peak(self) -> float | None:
        """Mean loss gap 11 to 30 steps after a reset."""
        return self.gap_mean(*GAP_PEAK)

    @property
    def gap_late(self) -> float | None:
        """Mean loss gap over the last fifth of the period."""
        if not self.period:
            return None
        return self.gap_mean(math.ceil((1 - LATE_FRACTION) * self.period), self.period)


def is_reset_run(run: Any) -> bool:
    """Whether the run resets ``v`` and recorded update sizes."""
    return bool(v_resets(run)) and any(RMS_KEY in r for r in run.records)


def reset_bursts(grid: Any) -> list[ResetBurst]:
    """The burst of every reset run of ``grid`` (in the grid's order)."""
    out = []
    for run in grid.runs.values():
        if not is_reset_run(run):
            continue
        resets = v_resets(run)
        name = twin_name(run.name)
        twin = grid.runs.get(name) if name else None
        last = run.entry.get("steps_reached") or run.records[-1]["step"]
        out.append(
            ResetBurst(
                name=run.name,
                twin=twin.name if twin else None,
                resets=resets,
                period=period_of(resets),
                rms=rms_after_reset(run),
                twin_rms=steady_rms(twin, resets[0], last) if twin else None,
                gap=loss_gap(run, twin) if twin else {},
            )
        )
    return out


def burst_grid(grids: Mapping[str, Any]) -> Any | None:
    """The grid named ``resets`` if it has reset runs, else the first grid that has any."""
    ordered = sorted(grids.values(), key=lambda g: g.name != "resets")
    return next((g for g in ordered if any(is_reset_run(r) for r in g.runs.values())), None)
