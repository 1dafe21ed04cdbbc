"""The study's figures (matplotlib, Agg backend); each function writes one PNG and returns it.

A figure whose runs are missing from the inputs is still written, saying what it lacks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from experiments.study.bursts import GAP_BEFORE, burst_grid, reset_bursts
from experiments.study.health import health_grid, shadow_records, uses_nearest
from experiments.study.summary import TRAIN_TAIL, dense_stalls, predicted_by_record

ROUNDING_NAMES = {"nearest": "NR", "stochastic": "SR"}
SMOOTH_STEPS = 50
GAP_SMOOTH_STEPS = 5  # centred moving average of the loss gap after a reset
DPI = 120


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _empty(path: Path, message: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    return _save(fig, path)


def _pick_grid(grids: Mapping[str, Any], names: Sequence[str]):
    """The ablation grid if it has any of ``names``, else the first grid that does."""
    ordered = sorted(grids.values(), key=lambda g: g.name != "ablation")
    return next((g for g in ordered if any(n in g.runs for n in names)), None)


def _series(run, key: str) -> tuple[list[int], list[float]]:
    logged = run.logged
    return [r["step"] for r in logged], [r[key] for r in logged]


def _plot_measured(ax, run, state: str, color, label: str) -> None:
    """The dense (attention + MLP) stall fraction, solid, over the all-weights one, faint;
    the all-weights one alone, solid, when the run has no per-group fractions."""
    steps, measured = _series(run, f"stall_{state}")
    dense = dense_stalls(run.config, run.events.get("stall_by_group"), state)
    if dense:
        ax.plot(steps, measured, color=color, lw=0.8, alpha=0.35)
        ax.plot(
            list(dense),
            list(dense.values()),
            color=color,
            lw=1.2,
            label=f"{label} (dense weights; faint: all)",
        )
    else:
        ax.plot(steps, measured, color=color, lw=1.2, label=f"{label} (all weights)")


def _theory_at_age(run, state: str) -> list[float]:
    resets = (run.entry.get("resets") or {}).get(state, [])
    return predicted_by_record(run.config, run.logged, resets, state)


def stall_bf16_nr_vs_sr(grids: Mapping[str, Any], path: Path) -> Path:
    """Stall fraction of v and m over steps: BF16 NR vs SR vs SR with resets, with theory."""
    names = ("bf16-nr", "bf16-sr", "bf16-sr-resets", "bf16-sr-resets-sym")
    grid = _pick_grid(grids, names)
    if grid is None:
        return _empty(path, "no runs named bf16-nr / bf16-sr in the inputs")
    resets_run = "bf16-sr-resets" if "bf16-sr-resets" in grid.runs else "bf16-sr-resets-sym"
    runs = [grid.runs[n] for n in ("bf16-nr", "bf16-sr", resets_run) if n in grid.runs]
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colors = plt.get_cmap("tab10").colors
    for ax, state in zip(axes, ("v", "m"), strict=True):
        for color, run in zip(colors, runs, strict=False):
            _plot_measured(ax, run, state, color, run.name)
            steps = [r["step"] for r in run.logged]
            ax.plot(
                steps,
                _theory_at_age(run, state),
                color=color,
                lw=1,
                ls=":",
                label=f"{run.name} theory at state age",
            )
            steady = (run.entry.get("stall") or {}).get(state, {}).get("predicted_steady")
            if steady is not None and not run.entry.get("resets", {}).get(state):
                ax.axhline(steady, color=color, lw=0.8, ls="--")
            for step in (run.entry.get("resets") or {}).get(state, []):
                ax.axvline(step, color=color, lw=0.5, alpha=0.4)
        ax.set_ylabel(f"stalled fraction of {state}")
        if state == "v":
            ax.set_ylim(-0.02, 1.02)
        else:  # m stalls rarely in BF16: let its axis zoom in
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].set_title(
        f"BF16 states, grid {grid.name}: measured (solid: attention + MLP weights, "
        "faint: all), theory at the state's age (dotted),\nsteady state (dashed), "
        "resets (thin vertical)",
        fontsize=9,
    )
    axes[0].legend(fontsize=7, loc="lower right")
    axes[1].set_xlabel("step")
    return _save(fig, path)


def _sr_no_reset_runs(grid) -> list:
    return [
        r
        for r in grid.runs.values()
        if r.config["resets"]["mode"] == "none"
        and r.config["optim"]["v_rounding"] == "stochastic"
        and r.config["optim"]["v_format"] != "fp32"
    ]


def stall_formats(grids: Mapping[str, Any], path: Path) -> Path:
    """Stall fraction of v over steps for every format with SR and no resets, per grid."""
    panels = [(g, _sr_no_reset_runs(g)) for g in grids.values()]
    panels = [(g, runs) for g, runs in panels if runs]
    if not panels:
        return _empty(path, "no runs with stochastic rounding and no resets in the inputs")
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (grid, runs) in zip(axes[0], panels, strict=True):
        for color, run in zip(colors, runs, strict=False):
            _plot_measured(ax, run, "v", color, f"{run.name} ({run.config['optim']['v_format']})")
            steps = [r["step"] for r in run.logged]
            ax.plot(steps, _theory_at_age(run, "v"), color=color, lw=1, ls=":")
            steady = (run.entry.get("stall") or {}).get("v", {}).get("predicted_steady")
            if steady is not None:
                ax.axhline(steady, color=color, lw=0.8, ls="--")
        preset = runs[0].config["model"]["preset"]
        ax.set_title(
            f"v stall, SR, no resets: {preset} (grid {grid.name})\n"
            "measured (solid: attention + MLP, faint: all weights), theory at age "
            "(dotted), steady state (dashed)",
            fontsize=9,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("stalled fraction of v")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curves(grid: Any, path: Path) -> Path:
    """A grid's train loss curves (moving average) and final validation loss per variant."""
    runs = list(grid.runs.values())
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    cmap = plt.get_cmap("tab20")
    for i, run in enumerate(runs):
        steps = [r["step"] for r in run.records]
        losses = [r["loss"] for r in run.records]
        style = "-" if run.config["resets"]["mode"] == "none" else "--"
        curves.plot(
            steps, _smooth(losses, SMOOTH_STEPS), color=cmap(i % 20), ls=style, lw=1, label=run.name
        )
    curves.set_xlabel("step")
    curves.set_ylabel(f"train loss (moving average over {SMOOTH_STEPS} steps)")
    tails = [v for r in runs for v in _smooth([x["loss"] for x in r.records], SMOOTH_STEPS)[-1:]]
    if tails:
        low, high = min(tails), max(tails)
        curves.set_ylim(low - 0.1, high + 0.6 * (high - low) + 0.5)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7, ncol=2)
    curves.set_title(f"grid {grid.name}: train loss (dashed: with resets)", fontsize=9)
    positions = list(range(len(runs)))
    finals, trains = (
        [math.nan if r.entry.get(key) is None else r.entry[key] for r in runs]
        for key in ("final_val_loss", "final_train_loss")
    )
    bars.barh(positions, finals, color=[cmap(i % 20) for i in positions])
    bars.plot(trains, positions, "k|", ms=12, label=f"train loss (last {TRAIN_TAIL} steps)")
    bars.set_yticks(positions, [r.name for r in runs], fontsize=8)
    bars.invert_yaxis()
    known = [v for v in finals + trains if math.isfinite(v)]
    if known:
        span = max(known) - min(known)
        bars.set_xlim(min(known) - max(0.05, 0.5 * span), max(known) + max(0.05, 0.3 * span))
        for y, value in zip(positions, finals, strict=True):
            if math.isfinite(value):
                bars.text(value, y, f" {value:.3f}", va="center", fontsize=7)
    reference = grid.runs.get("fp32")
    if reference is not None and reference.entry.get("final_val_loss") is not None:
        bars.axvline(
            reference.entry["final_val_loss"],
            color="black",
            lw=0.8,
            ls="--",
            label="fp32 validation loss",
        )
    bars.legend(fontsize=8)
    bars.set_xlabel("final validation loss")
    bars.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def frozen_weights(frozen: Mapping[str, Any] | None, path: Path) -> Path:
    """Fraction of BF16 weights that ever changed vs their initial |w|, NR vs SR."""
    if frozen is None:
        return _empty(path, "no frozen.json in the inputs (python -m experiments.study frozen)")
    edges, counts = frozen["bins"]["edges"], frozen["bins"]["count"]
    centres = [math.sqrt(a * b) for a, b in itertools.pairwise(edges)]
    lr = frozen["lr"]
    fig, ax = plt.subplots(figsize=(8, 5))
    hist = ax.twinx()
    hist.bar(
        edges[:-1],
        counts,
        width=[b - a for a, b in itertools.pairwise(edges)],
        align="edge",
        color="0.85",
        zorder=0,
    )
    hist.set_yscale("log")
    hist.set_ylabel("elements per bin", color="0.5")
    ax.set_zorder(hist.get_zorder() + 1)
    ax.patch.set_visible(False)
    for rounding, color in (("nearest", "tab:red"), ("stochastic", "tab:blue")):
        variant = frozen["variants"][rounding]
        points = [
            (c, f)
            for c, n, f in zip(centres, counts, variant["ever_changed_by_bin"], strict=True)
            if n and f is not None
        ]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            "o-",
            ms=3,
            color=color,
            label=f"{ROUNDING_NAMES[rounding]} (overall {variant['ever_changed']:.3f})",
        )
    for factor, style in ((256, "--"), (512, ":")):
        ax.axvline(factor * lr, color="black", ls=style, lw=1, label=f"{factor}·lr")
    measured = frozen["threshold"]["measured_abs_w"]
    if measured is not None:
        ax.axvline(
            measured, color="tab:red", lw=0.8, alpha=0.6, label=f"NR 50% at {measured / lr:.0f}·lr"
        )
    ax.set_xscale("log")
    ax.set_xlabel("initial |w|")
    ax.set_ylabel("fraction of weights ever changed")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    setup = frozen["setup"]
    ax.set_title(
        f"BF16 weights, no master copy: {setup['preset']}, lr {lr:g}, {setup['steps']} steps",
        fontsize=10,
    )
    return _save(fig, path)


def _centred(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average; the window shrinks at the ends."""
    half = window // 2
    spans = (values[max(0, i - half) : i + half + 1] for i in range(len(values)))
    return [sum(span) / len(span) for span in spans]


def reset_burst(grids: Mapping[str, Any], path: Path) -> Path:
    """Update RMS (left) and train-loss gap to the no-reset twin (right) against steps since a
    reset of v, averaged over each reset run's resets; the grid named ``resets`` if it has
    reset runs with ``update_rms`` records, else the first grid that does."""
    grid = burst_grid(grids)
    if grid is None:
        return _empty(path, "no runs with resets and update_rms records in the inputs")
    bursts = reset_bursts(grid)
    fig, (rms, gap) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = plt.get_cmap("tab10").colors
    for color, burst in zip(colors, bursts, strict=False):
        ks = sorted(burst.rms)
        rms.plot(
            ks,
            [burst.rms[k] for k in ks],
            color=color,
            lw=1.2,
            marker=".",
            ms=3,
            label=f"{burst.name} (v every {burst.period or '?'}, {len(burst.resets)}×)",
        )
        if burst.twin_rms is not None:
            rms.axhline(burst.twin_rms, color=color, lw=0.8, ls="--")
        if burst.gap:
            ks = sorted(burst.gap)
            gap.plot(
                ks,
                _centred([burst.gap[k] for k in ks], GAP_SMOOTH_STEPS),
                color=color,
                lw=1,
                label=f"{burst.name} − {burst.twin}",
            )
    rms.set_xlabel("steps since a reset of v")
    rms.set_ylabel("update RMS / lr")
    rms.set_ylim(bottom=0)
    rms.grid(alpha=0.3)
    rms.legend(fontsize=7)
    rms.set_title(
        f"grid {grid.name}: applied update RMS after a reset (mean over resets);\n"
        "dashed: the no-reset twin's mean at log steps",
        fontsize=9,
    )
    gap.axhline(0, color="black", lw=0.6)
    gap.axvline(0, color="black", lw=0.6, ls=":")
    gap.set_xlabel(f"steps since a reset of v (from −{GAP_BEFORE} to the period)")
    gap.set_ylabel("train loss − twin's train loss")
    gap.grid(alpha=0.3)
    gap.legend(fontsize=7)
    gap.set_title(
        f"train-loss gap to the no-reset twin (mean over resets, centred moving "
        f"average over {GAP_SMOOTH_STEPS} steps)",
        fontsize=9,
    )
    return _save(fig, path)


# (metrics.jsonl key, y label, y scale) of the health figure's panels before the loss panel;
# "logit" spreads cosines near 1, and falls back to linear where a value is not in (0, 1)
HEALTH_PANELS = (
    ("shadow_update_cosine", "update cosine, stored vs FP32 states", "logit"),
    ("shadow_rel_err_m", "rel_err m = ‖m − m_FP32‖ / ‖m_FP32‖", "log"),
    ("shadow_rel_err_v", "rel_err v = ‖v − v_FP32‖ / ‖v_FP32‖", "log"),
    ("shadow_bias_v", "bias v = Σ(v − v_FP32) / Σ|v_FP32|", "linear"),
    ("underflow_m", "underflow m (fraction stored as 0)", "linear"),
)


COSINE_TICKS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 0.9995, 0.9999)


def _health_scale(ax, scale: str, values: Sequence[float]) -> None:
    if scale == "logit" and values and all(0 < v < 1 for v in values):
        ax.set_yscale("logit")
        ax.yaxis.set_major_locator(FixedLocator(COSINE_TICKS))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    elif scale == "log" and any(v > 0 for v in values):
        ax.set_yscale("log", nonpositive="mask")


def state_health(grids: Mapping[str, Any], path: Path) -> Path:
    """The FP32 shadow's comparisons, underflow of m and the loss over steps, one line per
    run with shadow records: a colour per state-format pair, dashed where a state is
    rounded to nearest; the grid named ``health`` if it has such runs, else the first grid
    that does."""
    grid = health_grid(grids)
    if grid is None:
        return _empty(path, "no runs with FP32-shadow records (shadow_update_cosine) in the inputs")
    runs = [r for r in grid.runs.values() if shadow_records(r)]
    formats = list(
        dict.fromkeys((r.config["optim"]["m_format"], r.config["optim"]["v_format"]) for r in runs)
    )
    colors = plt.get_cmap("tab10").colors
    style = {  # a colour per state-format pair, dashed where a state is rounded to nearest
        run.name: {
            "color": colors[
                formats.index((run.config["optim"]["m_format"], run.config["optim"]["v_format"]))
                % len(colors)
            ],
            "ls": "--" if uses_nearest(run) else "-",
            "lw": 1,
        }
        for run in runs
    }
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), sharex=True)
    panels = list(axes.flat)
    for ax, (key, label, scale) in zip(panels, HEALTH_PANELS, strict=False):
        shown = []
        for run in runs:
            records = [r for r in shadow_records(run) if r.get(key) is not None]
            values = [r[key] for r in records]
            shown += values
            ax.plot([r["step"] for r in records], values, label=run.name, **style[run.name])
        _health_scale(ax, scale, shown)
        if key == "shadow_bias_v":
            ax.axhline(0, color="black", lw=0.6)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, which="both" if scale == "log" else "major")
    loss = panels[len(HEALTH_PANELS)]
    tails = []
    for run in runs:
        smooth = _smooth([r["loss"] for r in run.records], SMOOTH_STEPS)
        tails += smooth[-1:]
        val = sorted((int(k), v) for k, v in (run.entry.get("val_loss") or {}).items())
        final = run.entry.get("final_val_loss")
        loss.plot(
            [r["step"] for r in run.records],
            smooth,
            label=run.name if final is None else f"{run.name} (val {final:.3f})",
            **style[run.name],
        )
        loss.plot(
            [s for s, _ in val], [v for _, v in val], "o", color=style[run.name]["color"], ms=5
        )
    if tails:
        low, high = min(tails), max(tails)
        loss.set_ylim(low - 0.1, high + 0.6 * (high - low) + 0.5)
    loss.set_ylabel(f"train loss (moving average over {SMOOTH_STEPS} steps); dots: val", fontsize=9)
    loss.grid(alpha=0.3)
    loss.legend(fontsize=8)
    panels[0].legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(
        f"grid {grid.name}: stored states against FP32 copies of m and v on sampled blocks "
        "(solid: stochastic rounding, dashed: nearest)",
        fontsize=10,
    )
    return _save(fig, path)
