"""The study report: ``results.md`` tables and PNG figures from runner and frozen outputs.

Inputs are directories holding any of: ``summary.json`` and ``results.tar.gz`` (from
``python -m experiments.study run``), unpacked run directories (``<name>/config.yaml``,
``metrics.jsonl``, ...), and ``frozen.json`` (from ``python -m experiments.study frozen``).
Runs of the same grid from several directories are merged; where a run appears twice, the
one that got further wins.
"""

from __future__ import annotations

import json
import math
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from experiments.study.bursts import (
    GAP_BEFORE,
    GAP_PEAK,
    LATE_FRACTION,
    RMS_AFTER,
    burst_grid,
    reset_bursts,
)
from experiments.study.frozen import FROZEN_FILE
from experiments.study.grid import GridError
from experiments.study.health import HEALTH_COLUMNS, health_grid, health_rows
from experiments.study.runner import RESULTS_FILE, SUMMARY_FILE
from experiments.study.summary import (
    CONFIG_FILE,
    EVENTS_FILE,
    METRICS_FILE,
    STEADY_FRACTION,
    TRAIN_TAIL,
    parse_records,
    stall_comparison,
    summarize,
    write_atomic,
)

RESULTS_MD = "results.md"
FIGURES = (
    "stall_bf16_nr_vs_sr.png",
    "stall_formats.png",
    "frozen_weights.png",
    "reset_burst.png",
    "health.png",
)


def loss_figure(grid_name: str) -> str:
    """The file name of a grid's loss figure."""
    return f"loss_{grid_name}.png"


REFERENCE_RUN = "fp32"
_SEEDED = re.compile(r"^(?P<base>.*?)(?P<seed>-seed\d+)?$")
STATUS_RANK = {"complete": 3, "incomplete": 2, "failed": 1}


@dataclass
class RunData:
    """One run: its summary entry, resolved config, per-step records and TensorBoard extract."""

    entry: dict[str, Any]
    config: dict[str, Any]
    records: list[dict[str, Any]]
    events: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The run's name in its grid."""
        return self.entry["name"]

    @property
    def logged(self) -> list[dict[str, Any]]:
        """Records of log steps (those with stall fractions)."""
        return [r for r in self.records if "stall_m" in r]


@dataclass
class GridData:
    """The runs of one grid, in the order they were first seen."""

    name: str
    runs: dict[str, RunData] = field(default_factory=dict)

    def add(self, run: RunData) -> None:
        """Keep ``run`` unless a run of that name already got further."""
        old = self.runs.get(run.name)
        if old is None or _progress(run) > _progress(old):
            self.runs[run.name] = run


@dataclass
class StudyData:
    """Everything the report is made of."""

    grids: dict[str, GridData] = field(default_factory=dict)
    frozen: dict[str, Any] | None = None
    sources: list[str] = field(default_factory=list)


def _progress(run: RunData) -> tuple[int, int]:
    return STATUS_RANK.get(run.entry.get("status", ""), 0), run.entry.get("steps_reached", 0)


class _Files:
    """Run files of a directory, from its subdirectories or else from its results tarball."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.members: dict[str, bytes] = {}
        tarball = directory / RESULTS_FILE
        if tarball.is_file():
            try:
                with tarfile.open(tarball) as tar:
                    for member in tar.getmembers():
                        if member.isfile():
                            self.members[member.name] = tar.extractfile(member).read()
            except (tarfile.TarError, OSError, EOFError) as err:
                raise GridError(f"{tarball} cannot be read: {err}") from None

    def read(self, name: str) -> bytes | None:
        """A file by its path relative to the directory, or None."""
        path = self.directory / name
        if path.is_file():
            return path.read_bytes()
        return self.members.get(name)


def _run_from(files: _Files, entry: dict[str, Any]) -> RunData | None:
    name = entry["name"]
    config_text = files.read(f"{name}/{CONFIG_FILE}")
    if config_text is None:
        return None
    config = yaml.safe_load(config_text)
    metrics = files.read(f"{name}/{METRICS_FILE}")
    records = parse_records(metrics.decode()) if metrics else []
    events = files.read(f"{name}/{EVENTS_FILE}")
    return RunData(
        entry,
        config,
        sorted(records, key=lambda r: r["step"]),
        json.loads(events) if events else {},
    )


def _entries_without_summary(directory: Path, files: _Files) -> list[dict[str, Any]]:
    """Summary entries computed from unpacked run directories."""
    entries = []
    for sub in sorted(p for p in directory.iterdir() if (p / CONFIG_FILE).is_file()):
        config = yaml.safe_load((sub / CONFIG_FILE).read_text())
        metrics = files.read(f"{sub.name}/{METRICS_FILE}")
        events = files.read(f"{sub.name}/{EVENTS_FILE}")
        entry = summarize(
            config,
            parse_records(metrics.decode()) if metrics else [],
            json.loads(events) if events else None,
        )
        done = entry["steps_reached"] >= entry["steps_total"]
        entries.append({"name": sub.name, "status": "complete" if done else "incomplete", **entry})
    return entries


def load_study(directories: Sequence[Path]) -> StudyData:
    """Read and merge the study outputs found in ``directories``."""
    data = StudyData()
    for directory in directories:
        if not directory.is_dir():
            raise GridError(f"report input {directory} is not a directory")
        files = _Files(directory)
        summary_text = files.read(SUMMARY_FILE)
        if summary_text is not None:
            summary = json.loads(summary_text)
            grid_name, entries = summary["grid"], summary["runs"]
        else:
            grid_name, entries = directory.name, _entries_without_summary(directory, files)
        frozen = files.read(FROZEN_FILE)
        if frozen is not None:
            data.frozen = json.loads(frozen)
        if not entries and frozen is None:
            raise GridError(
                f"report input {directory} holds no {SUMMARY_FILE}, "
                f"{RESULTS_FILE}, run directories or {FROZEN_FILE}"
            )
        grid = data.grids.setdefault(grid_name, GridData(grid_name))
        for entry in entries:
            run = _run_from(files, entry)
            if run is not None:
                grid.add(run)
        data.sources.append(str(directory))
    data.grids = {name: grid for name, grid in data.grids.items() if grid.runs}
    return data


PREDICTION_KEYS = (
    "block_size",
    "predicted_steady",
    "predicted_at_age",
    "predicted_plain_steady",
    "predicted_plain_at_age",
)


def recompute_predictions(directory: Path) -> int:
    """Rewrite the theory's predictions in ``directory/summary.json`` from its recorded runs
    (``results.tar.gz`` or unpacked run directories); measured values stay as recorded.
    Returns the number of runs updated."""
    files = _Files(directory)
    summary_text = files.read(SUMMARY_FILE)
    if summary_text is None:
        raise GridError(f"{directory} holds no {SUMMARY_FILE}")
    summary = json.loads(summary_text)
    updated = 0
    for entry in summary["runs"]:
        run = _run_from(files, entry)
        if run is None or "stall" not in entry:
            continue
        events = run.events or None
        resets = entry.get("resets")
        fresh = stall_comparison(
            run.config, run.logged, resets, events.get("stall_by_group") if events else None
        )
        for state, values in fresh.items():
            entry["stall"][state].update({k: values[k] for k in PREDICTION_KEYS})
        updated += 1
    write_atomic(directory / SUMMARY_FILE, json.dumps(summary, indent=1).encode())
    return updated


# ----------------------------------------------------------------------------- tables


def _num(value: float | None, spec: str = ".4f") -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def _delta(value: float | None, reference: float | None) -> str:
    if value is None or reference is None:
        return "–"
    return format(value - reference, "+.4f")


def _states_text(config: dict[str, Any]) -> str:
    o = config["optim"]
    rounding = {"nearest": "NR", "stochastic": "SR"}
    if o["m_format"] == "fp32" and o["v_format"] == "fp32":
        return "fp32"
    return (
        f"{o['m_format']}/{o['v_format']} {rounding[o['m_rounding']]}/{rounding[o['v_rounding']]}"
    )


def _period(steps: list[int]) -> int | None:
    """P where ``steps`` are P, 2P, 3P, ...; else None."""
    gaps = {b - a for a, b in zip([0, *steps], steps, strict=False)}
    return steps[0] if steps and len(gaps) == 1 else None


def resets_text(entry: dict[str, Any]) -> str:
    """How often each state was reset, e.g. ``v every 409 (7×)``; ``m every 898 and with v
    (27×)`` where a state also resets with another's resets; ``irregular`` for other
    patterns (adaptive resets); ``none`` without resets."""
    resets = {state: steps for state, steps in (entry.get("resets") or {}).items() if steps}
    parts = []
    for state, steps in resets.items():
        period = _period(steps)
        if period is not None:
            every = f"every {period}"
        else:
            others = [o for o, other in resets.items() if o != state and set(other) < set(steps)]
            own = _period(sorted(set(steps) - {s for o in others for s in resets[o]}))
            every = (
                f"every {own}" + "".join(f" and with {o}" for o in others)
                if others and own is not None
                else "irregular"
            )
        parts.append(f"{state} {every} ({len(steps)}×)")
    return ", ".join(parts) or "none"


def seed_suffix(name: str) -> str:
    """A run name's ``-seedN`` suffix ('' for the default seed)."""
    return _SEEDED.match(name)["seed"] or ""


def reference_of(grid: GridData, name: str) -> RunData | None:
    """The run a run is compared with: ``fp32`` of the same seed (``fp32-seed1`` for
    ``fp8-sr-seed1``); None where the grid has no such run."""
    return grid.runs.get(REFERENCE_RUN + seed_suffix(name))


def _train_delta(run: RunData, reference: RunData) -> float | None:
    """The run's final train loss (mean over its last ``TRAIN_TAIL`` steps) minus the
    reference's mean over the same steps; None where the reference lacks one of them."""
    tail = sorted(run.records, key=lambda r: r["step"])[-TRAIN_TAIL:]
    ref = {r["step"]: r["loss"] for r in reference.records}
    if not tail or any(r["step"] not in ref for r in tail):
        return None
    return sum(r["loss"] - ref[r["step"]] for r in tail) / len(tail)


def loss_table(grid: GridData) -> list[str]:
    """Markdown: final validation and train losses per run, each with the difference to the
    fp32 run of its seed at the same steps."""
    lines = [
        "| run | states | resets | status | steps | val loss | Δ val vs fp32 | "
        f"train loss (last {TRAIN_TAIL}) | Δ train vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in grid.runs.values():
        e = run.entry
        reference = reference_of(grid, run.name)
        ref_val = _val_losses(reference).get(e.get("final_val_step")) if reference else None
        train_delta = _train_delta(run, reference) if reference else None
        lines.append(
            f"| {run.name} | {_states_text(run.config)} | {resets_text(e)} | {e['status']} | "
            f"{e.get('steps_reached', 0)}/{e.get('steps_total', '?')} | "
            f"{_num(e.get('final_val_loss'))} | {_delta(e.get('final_val_loss'), ref_val)} | "
            f"{_num(e.get('final_train_loss'))} | {_num(train_delta, '+.4f')} |"
        )
    return lines


def stall_table(grid: GridData) -> list[str]:
    """Markdown: measured steady-state stall of m and v against the block and plain models,
    per run."""
    lines = [
        "| run | states | resets | steps | m measured (all / dense) | m block (steady / at age) "
        "| m plain (steady / at age) | v measured (all / dense) | v block (steady / at age) "
        "| v plain (steady / at age) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in grid.runs.values():
        stall = run.entry.get("stall") or {}
        cells = []
        for s in ("m", "v"):
            st = stall.get(s) or {}
            pairs = (
                ("measured", "measured_dense"),
                ("predicted_steady", "predicted_at_age"),
                ("predicted_plain_steady", "predicted_plain_at_age"),
            )
            cells += [" / ".join(_num(st.get(key), ".3f") for key in pair) for pair in pairs]
        window = (stall.get("v") or {}).get("window_steps")
        steps = f"{window[0]}–{window[1]}" if window else "–"
        lines.append(
            f"| {run.name} | {_states_text(run.config)} | {resets_text(run.entry)} | "
            f"{steps} | " + " | ".join(cells) + " |"
        )
    return lines


def frozen_section(frozen: dict[str, Any]) -> list[str]:
    """Markdown: the frozen-weights experiment's setup, per-bin fractions and threshold."""
    setup, variants, threshold = frozen["setup"], frozen["variants"], frozen["threshold"]
    nr, sr = variants["nearest"], variants["stochastic"]
    lr = frozen["lr"]
    lines = [
        f"{setup['preset']}, BF16 weights without an FP32 master copy, SRAdamW with FP32 "
        f"states, constant lr {lr:g}, {setup['steps']} steps of {setup['batch']}×"
        f"{setup['seq_len']} tokens, seed {setup['seed']}, weight decay "
        f"{setup['weight_decay']:g}; {frozen['elements']:,} elements of the 2-D weight "
        "matrices (input embedding excluded).",
        "",
        "| | nearest (NR) | stochastic (SR) |",
        "|---|---|---|",
        f"| ever changed | {nr['ever_changed']:.4f} | {sr['ever_changed']:.4f} |",
        f"| changed in the last step | {nr['changed_last_step']:.4f} | "
        f"{sr['changed_last_step']:.4f} |",
        f"| final loss | {_num(nr['losses'][-1])} | {_num(sr['losses'][-1])} |",
        "",
        f"NR freezing threshold (|w| where the NR ever-changed fraction falls below 1/2): "
        f"measured {_num(threshold['measured_abs_w'], '.4g')} = "
        f"{_num(threshold['measured_over_lr'], '.0f')}·lr; predicted between 256·lr = "
        f"{threshold['predicted_256_lr']:.4g} and 512·lr = {threshold['predicted_512_lr']:.4g} "
        "(NR drops an update Δ when |Δ| < ULP(w)/2, i.e. |w| ≳ 2^8·|Δ|, with |Δ| ≈ lr).",
        "",
        "| initial \\|w\\| | elements | NR ever changed | SR ever changed |",
        "|---|---|---|---|",
    ]
    edges, counts = frozen["bins"]["edges"], frozen["bins"]["count"]
    for i, count in enumerate(counts):
        if count:
            span = f"< {edges[1]:.3g}" if i == 0 else f"{edges[i]:.3g} – {edges[i + 1]:.3g}"
            lines.append(
                f"| {span} | {count:,} | "
                f"{_num(nr['ever_changed_by_bin'][i], '.3f')} | "
                f"{_num(sr['ever_changed_by_bin'][i], '.3f')} |"
            )
    return lines


def burst_table(grid: GridData) -> list[str]:
    """Markdown: per reset run, the update RMS after a reset of v against its no-reset twin's
    steady value, and the train-loss gap to the twin around a reset (means over resets)."""
    late = f"{1 - LATE_FRACTION:.0%}–100%"
    lines = [
        "| run | twin | v period | resets | update RMS +"
        + " | update RMS +".join(str(k) for k in RMS_AFTER)
        + f" | twin steady RMS | loss gap −{GAP_BEFORE}..0 | loss gap peak "
        f"(+{GAP_PEAK[0]}..+{GAP_PEAK[1]}) | loss gap late ({late} of period) |",
        "|---|---|---|---|" + "---|" * len(RMS_AFTER) + "---|---|---|---|",
    ]
    for b in reset_bursts(grid):
        lines.append(
            f"| {b.name} | {b.twin or '–'} | {b.period or 'adaptive'} | {len(b.resets)} | "
            + " | ".join(_num(b.rms_at(k), ".3f") for k in RMS_AFTER)
            + f" | {_num(b.twin_rms, '.3f')} | {_signed(b.gap_before)} | "
            f"{_signed(b.gap_peak)} | {_signed(b.gap_late)} |"
        )
    return lines


def _signed(value: float | None) -> str:
    return _num(value, "+.4f")


def _val_losses(run: RunData) -> dict[int, float]:
    return {int(k): v for k, v in (run.entry.get("val_loss") or {}).items()}


def val_steps_table(grid: GridData) -> list[str]:
    """Markdown: validation loss at every validation step of ``grid``: the fp32 runs' values,
    every other run's difference to the fp32 run of its seed ('–': not reached)."""
    per_run = {name: _val_losses(run) for name, run in grid.runs.items()}
    steps = sorted(set().union(*per_run.values()))
    if not steps:
        return ["No run reached a validation step."]
    lines = ["| run | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for name, val in per_run.items():
        reference = reference_of(grid, name)
        if reference is None or reference.name == name:
            cells = [_num(val.get(s)) for s in steps]
        else:
            ref = _val_losses(reference)
            cells = [_delta(val.get(s), ref.get(s)) for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def seeds_table(grid: GridData) -> list[str]:
    """Markdown: runs with more than one seed (``name`` and ``name-seedN``): at each
    validation step every seed reached, the mean over seeds of the run's difference to the
    fp32 run of the same seed, ± half the range over seeds (for fp32 itself: its loss).
    Empty where the grid has no seeded runs."""
    groups: dict[str, list[RunData]] = {}
    for name, run in grid.runs.items():
        groups.setdefault(_SEEDED.match(name)["base"], []).append(run)
    rows = []
    for base, runs in groups.items():
        pairs = [(run, reference_of(grid, run.name)) for run in runs]
        if len(runs) < 2 or any(ref is None for _, ref in pairs):
            continue
        common = set.intersection(
            *(set(_val_losses(run)) & set(_val_losses(ref)) for run, ref in pairs)
        )
        rows.append((base, len(runs), {step: _seed_spread(pairs, step) for step in common}))
    if not rows:
        return []
    steps = sorted(set().union(*(cells for _, _, cells in rows)))
    lines = [
        "| run | seeds | " + " | ".join(str(s) for s in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for base, count, cells in rows:
        text = [
            f"{cells[s][0]:{'.4f' if base == REFERENCE_RUN else '+.4f'}} ± {cells[s][1]:.4f}"
            if s in cells
            else "–"
            for s in steps
        ]
        lines.append(f"| {base} | {count} | " + " | ".join(text) + " |")
    return lines


def _seed_spread(pairs: Sequence[tuple[RunData, RunData]], step: int) -> tuple[float, float]:
    """(mean, half range) over seeds at ``step`` of a run's validation loss minus its
    reference's (the loss itself where the run is its own reference)."""
    values = [
        _val_losses(run)[step] - (0.0 if ref is run else _val_losses(ref)[step])
        for run, ref in pairs
    ]
    return sum(values) / len(values), (max(values) - min(values)) / 2


def burst_section(grid: GridData) -> list[str]:
    """Markdown: the reset-burst table and the validation losses of ``grid``."""
    return [
        f"## Grid `{grid.name}`: what a reset of v does",
        "",
        "Update RMS: the RMS of the applied AdamW update over the learning rate, on a fixed "
        "sample of rows, k steps after a reset of v (k = 1 is the first update from the "
        "zeroed state; with re-warmup it includes the re-warmup factor), averaged over the "
        "run's resets; the twin (the same run without resets, same batches) at its log steps "
        "from the first reset on. Loss gap: train loss minus the twin's at the same step, "
        "averaged over resets and over the steps since a reset named in the header (negative: "
        "before the reset).",
        "",
        *burst_table(grid),
        "",
        f"Validation loss of grid `{grid.name}`: the {REFERENCE_RUN} runs, and each other "
        f"run's difference to the {REFERENCE_RUN} run of its seed (same batches).",
        "",
        *val_steps_table(grid),
        "",
        *_seeds_part(grid),
    ]


def _seeds_part(grid: GridData) -> list[str]:
    table = seeds_table(grid)
    if not table:
        return []
    return [
        "Over seeds: mean ± half the range of each run's difference to the "
        f"{REFERENCE_RUN} run of its seed, at the validation steps every seed reached.",
        "",
        *table,
        "",
    ]


def health_table(grid: GridData) -> list[str]:
    """Markdown: per run with FP32-shadow records, the final validation loss, the shadow's
    comparisons and the state counts at its last shadow step, and the range of bias v."""
    lines = [
        "| run | states | step | val loss | "
        + " | ".join(header for header, _ in HEALTH_COLUMNS.values())
        + " | bias v min / max |",
        "|---|---|---|---|" + "---|" * len(HEALTH_COLUMNS) + "---|",
    ]
    for row in health_rows(grid):
        run = grid.runs[row.name]
        cells = [_num(row.values[k], fmt) for k, (_, fmt) in HEALTH_COLUMNS.items()]
        lines.append(
            f"| {run.name} | {_states_text(run.config)} | {row.step} | "
            f"{_num(run.entry.get('final_val_loss'))} | "
            + " | ".join(cells)
            + f" | {_num(row.low, '+.3f')} / {_num(row.high, '+.3f')} |"
        )
    return lines


def health_section(grid: GridData) -> list[str]:
    """Markdown: the state-health table of ``grid``."""
    return [
        f"## Grid `{grid.name}`: state health against the FP32 shadow",
        "",
        f"{_describe(grid)}. At each run's last log step (the step column): the stored "
        "states against FP32 copies of m and v kept on a sample of blocks "
        "(`optim.shadow_sample`) from the same gradients: the cosine between the two updates "
        "m̂/(√v̂+ε), the relative error ‖stored − FP32‖ / ‖FP32‖ and the bias "
        "Σ(stored − FP32) / Σ|FP32|; the stall fractions; the fractions of m's elements "
        "stored as 0 from a non-zero value (underflow) and at the largest magnitude their "
        "code holds (saturated). Bias v min / max: its lowest and highest value over the "
        "log steps. "
        "Val loss: at the last validation step.",
        "",
        *health_table(grid),
        "",
    ]


def _describe(grid: GridData) -> str:
    first = next(iter(grid.runs.values())).config
    return (
        f"{first['model']['preset']}, seq_len {first['model']['seq_len']}, batch "
        f"{first['train']['global_batch_size']}, {first['train']['steps']} steps, "
        f"lr {first['optim']['lr']:g}, β₂ {first['optim']['beta2']:g}"
    )


def markdown(data: StudyData, figures: Sequence[str]) -> str:
    """The whole ``results.md``."""
    lines = [
        "# Study results",
        "",
        "Made by `python -m experiments.study report` from: "
        + ", ".join(f"`{s}`" for s in data.sources)
        + ".",
        "",
    ]
    for grid in data.grids.values():
        lines += [
            f"## Grid `{grid.name}`: losses",
            "",
            _describe(grid) + ".",
            "",
            *loss_table(grid),
            "",
        ]
    for grid in data.grids.values():
        lines += [
            f"## Grid `{grid.name}`: stall fractions, measured vs theory",
            "",
            f"Measured: mean stalled fraction over the last {STEADY_FRACTION:.0%} of the logged "
            "steps (the steps column), over all weights and over the dense attention and MLP "
            "weights alone (embedding rows of tokens missing from a batch get zero gradients, "
            "which the theory does not model). Theory (zero-mean Gaussian gradients): the "
            "steady state, and the prediction at each step's state age since its last reset "
            "(or the start), averaged over the same steps. Block: the block-scaled model "
            "(`srtrain.theory.blocks`: each element on its block's absolute grid, within-block "
            "scale spread λ fitted for m, and the biased mean of v under NR); plain: each "
            "element's grid at its own magnitude (`srtrain.theory`).",
            "",
            *stall_table(grid),
            "",
        ]
    burst = burst_grid(data.grids)
    if burst is not None:
        lines += burst_section(burst)
    health = health_grid(data.grids)
    if health is not None:
        lines += health_section(health)
    if data.frozen is not None:
        lines += [
            "## Frozen BF16 weights (no master copy): NR vs SR",
            "",
            *frozen_section(data.frozen),
            "",
        ]
    lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    return "\n".join(lines)


def write_report(directories: Sequence[Path], out: Path) -> list[Path]:
    """Write results.md, the figures and one loss figure per grid into ``out``; returns the
    written paths."""
    from experiments.study import plots

    data = load_study(directories)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plots.stall_bf16_nr_vs_sr(data.grids, out / FIGURES[0]),
        plots.stall_formats(data.grids, out / FIGURES[1]),
        plots.frozen_weights(data.frozen, out / FIGURES[2]),
        plots.reset_burst(data.grids, out / FIGURES[3]),
        plots.state_health(data.grids, out / FIGURES[4]),
        *(plots.loss_curves(grid, out / loss_figure(name)) for name, grid in data.grids.items()),
    ]
    path = out / RESULTS_MD
    path.write_text(markdown(data, [p.name for p in written]))
    return [path, *written]
