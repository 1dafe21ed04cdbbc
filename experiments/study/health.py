"""State health: numbers for the report's health figure and table.

On log steps a run's ``metrics.jsonl`` carries the stored states' drift from an FP32 shadow
kept on a sample of blocks (``shadow_update_cosine``, ``shadow_rel_err_m``,
``shadow_rel_err_v``, ``shadow_bias_m``, ``shadow_bias_v``) next to the stall fractions and
state counts (``underflow_m``, ``saturated_m``, ...). Runs recorded before the shadow existed
have none of them and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SHADOW_KEY = "shadow_update_cosine"
# the table's columns at a run's last shadow step, in order: metrics.jsonl key → (header,
# number format)
HEALTH_COLUMNS = {
    "shadow_update_cosine": ("update cosine", ".3f"),
    "shadow_rel_err_m": ("rel_err m", ".3f"),
    "shadow_rel_err_v": ("rel_err v", ".3f"),
    "shadow_bias_v": ("bias v", "+.3f"),
    "stall_m": ("stall m", ".3f"),
    "stall_v": ("stall v", ".3f"),
    "underflow_m": ("underflow m", ".4f"),
    "saturated_m": ("saturated m", ".4f"),
}
RANGE_KEY = "shadow_bias_v"  # whose lowest and highest value over the run the table shows


def shadow_records(run: Any) -> list[dict[str, Any]]:
    """The run's log-step records that hold the shadow's comparisons."""
    return [r for r in run.records if r.get(SHADOW_KEY) is not None]


def uses_nearest(run: Any) -> bool:
    """Whether either state of the run is rounded to nearest."""
    optim = run.config.get("optim", {})
    return "nearest" in (optim.get("m_rounding"), optim.get("v_rounding"))


def health_grid(grids: Mapping[str, Any]) -> Any | None:
    """The grid named ``health`` if it has runs with shadow records, else the first grid
    that has any."""
    ordered = sorted(grids.values(), key=lambda g: g.name != "health")
    return next((g for g in ordered if any(shadow_records(r) for r in g.runs.values())), None)


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class HealthRow:
    """One run's state health at its last shadow step, and the range of ``bias_v``."""

    name: str
    step: int
    values: dict[str, float | None]
    low: float | None
    high: float | None


def health_rows(grid: Any) -> list[HealthRow]:
    """Per run of ``grid`` with shadow records (in the grid's order): the values of
    :data:`HEALTH_COLUMNS` at its last shadow step, and the lowest and highest ``bias_v``
    over all its shadow steps."""
    rows = []
    for run in grid.runs.values():
        records = shadow_records(run)
        if not records:
            continue
        last = max(records, key=lambda r: r["step"])
        spread = [v for v in (_finite(r.get(RANGE_KEY)) for r in records) if v is not None]
        rows.append(
            HealthRow(
                name=run.name,
                step=last["step"],
                values={key: _finite(last.get(key)) for key in HEALTH_COLUMNS},
                low=min(spread, default=None),
                high=max(spread, default=None),
            )
        )
    return rows
