"""Where a training step's time goes: the GPU's busy share and the host's named regions.

    python -m experiments.step_profile --json OUT.json [--window 20] CONFIG [overrides...]

Trains ``CONFIG`` with ``overrides`` (one process, :func:`srtrain.trainer.run`) under
``torch.profiler`` for the last ``--window`` steps only (the profiler advances after every
optimizer step, so each ``ProfilerStep`` span is one whole training step: data, forward,
backward, the optimizer, logging). From the exported trace, per step: the wall time; the
GPU's busy time (the union of its kernels, copies and sets); and the union of the host's
spans of each named region: FSDP2's hooks and collectives (``FSDP::``), compiled code
(``Torch-Compiled Region``) and the optimizer step (``Optimizer.step#``). Each region's
share is its time over the step's (regions can overlap each other, and the GPU runs
alongside). It files those medians with the run's tokens/s and MFU (per log interval, under
the profiler), the environment and the command. Without CUDA the GPU's time is absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from srtrain.bench.__main__ import environment
from srtrain.config import load_config
from srtrain.trainer import run

# region → the prefix of the profiler's span names it gathers
REGIONS = {
    "FSDP2 hooks and collectives": "FSDP::",
    "compiled code": "Torch-Compiled Region",
    "optimizer step": "Optimizer.step#",
}
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP_PREFIX = "ProfilerStep#"


def union_us(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """The length of the union of ``spans`` (start, end) clipped to [lo, hi]."""
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def innermost(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The spans that contain no other, in order: the profiler's steps without the span it
    may keep around all of them."""
    spans = sorted(spans)
    return [
        (lo, hi)
        for lo, hi in spans
        if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
    ]


def step_breakdown(trace: dict) -> list[dict]:
    """Per profiled step of a chrome trace (``export_chrome_trace``): its wall time, the
    GPU's busy time (None without GPU events) and each region's host time, in µs."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = innermost(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(STEP_PREFIX)
    )
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES]
    regions = {
        name: [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("cat") != "kernel" and e["name"].startswith(prefix)
        ]
        for name, prefix in REGIONS.items()
    }
    rows = []
    for lo, hi in steps:
        row = {"start_us": lo, "wall_us": hi - lo}
        row["gpu_busy_us"] = union_us(gpu, lo, hi) if gpu else None
        row |= {name: union_us(spans, lo, hi) for name, spans in regions.items()}
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Medians over the steps of each measure, and each one's share of the step's wall."""
    wall = statistics.median(r["wall_us"] for r in rows)
    out = {"steps": len(rows), "wall_us": wall}
    for key in ["gpu_busy_us", *REGIONS]:
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            out[key] = statistics.median(values)
            out[f"{key} share"] = out[key] / wall
    return out


def profile_run(config: str, overrides: list[str], window: int) -> dict:
    """Train under the profiler over the last ``window`` steps; the per-step breakdown and
    its summary, and the run's tokens/s and MFU."""
    cfg = load_config(config, overrides)
    steps = cfg.train.steps
    if not 0 < window < steps:
        raise SystemExit(f"error: --window {window} must be between 1 and train.steps - 1")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "trace.json"
        schedule = torch.profiler.schedule(wait=steps - window - 1, warmup=1, active=window)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=lambda p: p.export_chrome_trace(str(trace_file)),
        )
        handle = register_optimizer_step_post_hook(lambda *_: profiler.step())
        try:
            with profiler:
                result = run(cfg)
        finally:
            handle.remove()
        trace = json.loads(trace_file.read_text())
    rows = step_breakdown(trace)
    return {
        "summary": summarize(rows),
        "steps": rows,
        "tokens_per_s": result.tokens_per_s,
        "mfu": result.mfu,
        "peak_memory_gib": result.peak_memory_gib,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="the result file to write")
    parser.add_argument("--window", type=int, default=20, help="the last steps profiled")
    parser.add_argument("config", help="a recipe (YAML)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    data = {"environment": environment("python -m experiments.step_profile")}
    data |= {"config": args.config, "overrides": args.overrides, "window": args.window}
    data |= profile_run(args.config, args.overrides, args.window)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    summary = data["summary"]
    parts = [f"step {summary['wall_us'] / 1000:.2f} ms (median of {summary['steps']})"]
    for key in ["gpu_busy_us", *REGIONS]:
        if key in summary:
            label = "GPU busy" if key == "gpu_busy_us" else key
            parts.append(f"{label} {summary[key] / 1000:.2f} ms ({summary[key + ' share']:.1%})")
    print("; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
