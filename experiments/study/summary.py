"""What one study run measured, next to what the stall theory predicts for it.

A run directory holds ``config.yaml`` and ``metrics.jsonl`` (written by the trainer) and
``events.json`` (validation losses, reset steps and per-group stall fractions, taken from its
TensorBoard events by :func:`write_events`). :func:`summarize` turns their contents into one
JSON-ready dict: steps reached, final validation loss, final train loss (mean of the last 100
steps), and for each state the measured steady-state stall fraction (mean over the last 20%
of logged steps) of all weights and of the dense attention and MLP weights alone (the
embedding rows of tokens missing from a batch get zero gradients, which the theory does not
model), with the theory's steady-state prediction and its prediction at the state's age:
``predicted_steady`` and ``predicted_at_age`` from the block model
(:mod:`srtrain.theory.blocks`: block-scaled grids, NR ``v``'s biased drift), and
``predicted_plain_steady`` and ``predicted_plain_at_age`` from the plain model
(:mod:`srtrain.theory`). :func:`recompute_predictions` rewrites the predictions of a
recorded study's ``summary.json`` from its runs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from srtrain.metrics import GROUPS, parse_records  # null values as NaN, torn lines dropped
from srtrain.numerics.formats import get_format
from srtrain.optim.resets import ResetSchedule
from srtrain.rundir import CONFIG_FILE, METRICS_FILE, TB_DIR
from srtrain.theory import (
    DEFAULT_BLOCK_SIZE,
    block_stall_at_age,
    block_stall_probability,
    p_stall_at_age,
    stall_probability,
)

EVENTS_FILE = "events.json"
LOG_FILE = "train.log"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, LOG_FILE, EVENTS_FILE)
STATES = ("m", "v")
STEADY_FRACTION = 0.2  # the last fifth of the logged steps counts as steady state
TRAIN_TAIL = 100  # steps averaged for the final train loss
TAG_VAL_LOSS = "loss/val"
DENSE_GROUPS = ("attention", "mlp")  # dense gradients every step, as the theory assumes


def read_events(run_dir: Path) -> dict[str, Any]:
    """Validation losses, reset steps and per-group stall fractions from a run's TensorBoard
    events (``stall_by_group[state][group]`` is a list of [step, fraction])."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / TB_DIR), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags().get("scalars", []))

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in accumulator.Scalars(tag)] if tag in tags else []

    return {
        "val_loss": {str(step): value for step, value in scalars(TAG_VAL_LOSS)},
        "resets": {
            s: sorted({step for step, value in scalars(f"reset/{s}") if value > 0.5})
            for s in STATES
        },
        "stall_by_group": {
            s: {
                g: [list(p) for p in scalars(f"stall/{s}/{g}")]
                for g in GROUPS
                if f"stall/{s}/{g}" in tags
            }
            for s in STATES
        },
    }


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file whole or not at all (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_events(run_dir: Path) -> None:
    """Store the run's TensorBoard validation losses and resets as ``events.json``."""
    if (run_dir / TB_DIR).is_dir():
        events = read_events(run_dir)
        write_atomic(run_dir / EVENTS_FILE, json.dumps(events, indent=1).encode())


def scheduled_resets(config: Mapping[str, Any], last_step: int) -> dict[str, list[int]] | None:
    """Reset steps of a periodic or theory schedule up to ``last_step`` (None: adaptive)."""
    r, o = config["resets"], config["optim"]
    if r["mode"] == "adaptive":
        return None
    schedule = ResetSchedule(
        r["mode"],
        m_period=r["m_period"],
        v_period=r["v_period"],
        formats={"m": o["m_format"], "v": o["v_format"]},
        roundings={"m": o["m_rounding"], "v": o["v_rounding"]},
        betas={"m": o["beta1"], "v": o["beta2"]},
        tolerance=r["tolerance"],
        states=r["states"],
    )
    return {
        s: [
            step
            for step in range(1, last_step + 1)
            if schedule.periods[s] and step % schedule.periods[s] == 0
        ]
        for s in STATES
    }


@cache
def _p_at_age(
    fmt: str, beta: float, age: int, rounding: str, moment: str, block_size: int | None
) -> float:
    """Prediction at ``age``: block model of ``block_size``, or the plain model (None)."""
    if block_size is None:
        return p_stall_at_age(get_format(fmt).eps, beta, age, rounding, moment)
    return block_stall_at_age(fmt, beta, age, rounding, moment, block_size)


def block_size_of(config: Mapping[str, Any]) -> int:
    """The run's block size (configs written before it was a key: the default)."""
    return int(config["optim"].get("block_size", DEFAULT_BLOCK_SIZE))


def state_ages(steps: Sequence[int], resets: Sequence[int]) -> list[int]:
    """Age of the state that the update of each step is applied to (updates since a reset).

    A reset after step r zeroes the state, so step t > r updates a state of age t - 1 - r.
    """
    ordered = sorted(resets)
    ages = []
    for step in steps:
        last = max((r for r in ordered if r < step), default=0)
        ages.append(step - 1 - last)
    return ages


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def predicted_by_record(
    config: Mapping[str, Any],
    logged: Sequence[Mapping[str, Any]],
    resets: Sequence[int],
    state: str,
    plain: bool = False,
) -> list[float]:
    """Theory's stall fraction for each logged record: the mean over the steps it covers of
    the prediction at the state's age (block model; ``plain``: the plain model)."""
    o = config["optim"]
    beta = o["beta1"] if state == "m" else o["beta2"]
    fmt, rounding = o[f"{state}_format"], o[f"{state}_rounding"]
    block_size = None if plain else block_size_of(config)
    out, previous = [], 0
    for record in logged:
        ages = state_ages(range(previous + 1, record["step"] + 1), resets)
        out.append(_mean([_p_at_age(fmt, beta, a, rounding, state, block_size) for a in ages]))
        previous = record["step"]
    return out


@cache
def group_sizes(preset: str, seq_len: int) -> dict[str, int]:
    """Elements per parameter group of a preset (built on the meta device; the vocabulary
    size, which only sizes the embeddings and the head, is left small)."""
    from srtrain.models import build_model
    from srtrain.param_groups import param_group_of

    sizes: dict[str, int] = {}
    for name, p in build_model(preset, 8, seq_len).named_parameters():
        group = param_group_of(name)
        sizes[group] = sizes.get(group, 0) + p.numel()
    return sizes


def dense_stalls(
    config: Mapping[str, Any], by_group: Mapping[str, Any] | None, state: str
) -> dict[int, float]:
    """Stalled fraction of the attention and MLP weights together at each logged step."""
    series = [
        dict(map(tuple, ((by_group or {}).get(state) or {}).get(g, []))) for g in DENSE_GROUPS
    ]
    if not all(series):
        return {}
    sizes = group_sizes(config["model"]["preset"], config["model"]["seq_len"])
    total = sum(sizes[g] for g in DENSE_GROUPS)
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return {
        step: sum(sizes[g] * s[step] for g, s in zip(DENSE_GROUPS, series, strict=True)) / total
        for step in steps
    }


def stall_comparison(
    config: Mapping[str, Any],
    logged: Sequence[Mapping[str, Any]],
    resets: Mapping[str, Sequence[int]] | None,
    by_group: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per state: measured steady stall (last 20% of logged steps; all weights, and the dense
    attention and MLP weights alone) and the theory's values (block and plain models)."""
    o = config["optim"]
    block_size = block_size_of(config)
    k = max(1, math.ceil(STEADY_FRACTION * len(logged)))
    window = list(logged[-k:]) if logged else []
    first_step = logged[-k - 1]["step"] + 1 if len(logged) > k else 1  # first step covered
    out = {}
    for s, beta in (("m", o["beta1"]), ("v", o["beta2"])):
        fmt, rounding = o[f"{s}_format"], o[f"{s}_rounding"]
        at_age = plain_at_age = None
        if window and resets is not None:
            at_age = _mean(predicted_by_record(config, logged, resets[s], s)[-k:])
            plain_at_age = _mean(predicted_by_record(config, logged, resets[s], s, True)[-k:])
        dense = dense_stalls(config, by_group, s)
        out[s] = {
            "format": fmt,
            "rounding": rounding,
            "beta": beta,
            "measured": _mean([r[f"stall_{s}"] for r in window]),
            "measured_dense": _mean([dense[r["step"]] for r in window if r["step"] in dense]),
            "block_size": block_size,
            "predicted_steady": block_stall_probability(fmt, beta, rounding, s, block_size),
            "predicted_at_age": at_age,
            "predicted_plain_steady": stall_probability(fmt, beta, rounding, s),
            "predicted_plain_at_age": plain_at_age,
            "window_steps": [first_step, window[-1]["step"]] if window else None,
        }
    return out


def summarize(
    config: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    events: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One run's numbers from its config, metrics records and events (None: not extracted)."""
    records = sorted(records, key=lambda r: r["step"])
    steps = records[-1]["step"] if records else 0
    logged = [r for r in records if "stall_m" in r]
    resets = dict(events["resets"]) if events else scheduled_resets(config, steps)
    val = {int(k): v for k, v in (events or {}).get("val_loss", {}).items()}
    last_val = max(val) if val else None
    tail = [r["loss"] for r in records[-TRAIN_TAIL:]]
    return {
        "steps_reached": steps,
        "steps_total": config["train"]["steps"],
        "final_val_loss": val[last_val] if val else None,
        "final_val_step": last_val,
        "val_loss": {str(k): val[k] for k in sorted(val)},
        "final_train_loss": _mean(tail),
        "resets": resets,
        "reset_mode": config["resets"]["mode"],
        "stall": stall_comparison(
            config, logged, resets, events.get("stall_by_group") if events else None
        ),
    }


def summarize_dir(run_dir: Path) -> dict[str, Any]:
    """:func:`summarize` of the files in a run directory (missing files count as empty)."""
    config = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    metrics = run_dir / METRICS_FILE
    records = parse_records(metrics.read_text()) if metrics.exists() else []
    events_path = run_dir / EVENTS_FILE
    events = json.loads(events_path.read_text()) if events_path.exists() else None
    return summarize(config, records, events)
