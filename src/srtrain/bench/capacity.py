"""Capacity benchmark: the largest LLaMA shape each optimizer variant trains on one GPU, and
the best tokens/s each reaches at 7B.

Every trial runs in its own process (``srtrain.bench.capacity_trial``) under a timeout, so
an out-of-memory error or a hang ends that trial alone and the next starts on a clean
device. Rows are written to the result file as they come.

Ladder: sequence 2048, micro-batch 1, activation checkpointing, BF16 compute, vocabulary
32000, LLaMA shapes from 7B to 52B. Each variant starts at a given rung (by default the
largest that the memory planner, ``srtrain.plan``, expects to fit in an H200, planned with
the variant's settings, ``optim.step_in_backward`` included), climbs until the first rung
that does not fit, or, when the start does not fit, descends to the first that does. Every
row carries the planner's peak beside the measured one.

Throughput (7B by default): micro-batches climb without activation checkpointing until one
does not fit; then, with checkpointing, only the micro-batches above the largest that fit
without it (at one micro-batch, recomputation only adds work), again until one does not fit.
The best tokens/s of the fitting trials is the variant's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from srtrain.bench.capacity_trial import VARIANTS, TrialSpec, trial_config
from srtrain.models import Shape, resolve_model_config
from srtrain.plan import GIB, GPU_MEMORY_GIB, plan_run


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> Shape:
    return Shape("llama", hidden=hidden, intermediate=intermediate, heads=heads, layers=layers)


# rungs named by their parameter count at vocabulary 32000 (untied embeddings, MHA)
LADDER: dict[str, Shape] = {
    "7b": _llama(4096, 11008, 32, 32),  # 6.74B, LLaMA-7B
    "13b": _llama(5120, 13824, 40, 40),  # 13.02B, LLaMA-13B
    "20b": _llama(6144, 16384, 44, 48),  # 20.33B
    "26b": _llama(6656, 17920, 48, 52),  # 26.11B
    "30b": _llama(6656, 17920, 56, 52),  # 30.39B
    "35b": _llama(7168, 19200, 56, 56),  # 35.09B
    "40b": _llama(7168, 19200, 64, 56),  # 40.04B
    "43b": _llama(7168, 19200, 68, 56),  # 42.51B
    "46b": _llama(7680, 20480, 64, 60),  # 45.79B
    "52b": _llama(8192, 22016, 64, 64),  # 52.33B
}
# the CPU dry path: the same machinery on shapes a CPU trains in seconds (vocabulary 512)
DRY_LADDER: dict[str, Shape] = {
    "0.5m": _llama(128, 344, 2, 4),  # 0.53M, llama-tiny's blocks
    "3.4m": _llama(256, 688, 4, 4),  # 3.43M
}
SEQ_LEN = 2048
VOCAB_SIZE = 32000
DRY_SEQ_LEN = 64
DRY_VOCAB_SIZE = 512
MICRO_BATCHES = (1, 2, 4, 8)
LADDER_STEPS = (1, 2)  # warm-up (the states appear in step 1), measured
THROUGHPUT_STEPS = (2, 3)
DRY_STEPS = (1, 1)
DEFAULT_VARIANTS = tuple(VARIANTS)
NAME_WIDTH = max(len(name) for name in VARIANTS)  # the variant column of printed lines

FIT, OOM, ERROR = "fit", "oom", "error"


class BudgetSpentError(Exception):
    """The run's time budget leaves no room for another trial."""


def outcome(row: dict) -> str:
    """A row's outcome: fit, oom (does not fit), or error (failed for another reason)."""
    if row.get("fit"):
        return FIT
    return OOM if row.get("oom") else ERROR


def search_ladder(rungs: list[str], start: str, trial: Callable[[str], str]) -> str | None:
    """The largest rung that fits, trying as few as possible: from ``start`` up to the first
    that does not fit, or down to the first that does. ``trial`` runs one rung and returns
    its outcome; an error (not a lack of memory) ends the search."""
    i = rungs.index(start)
    first = trial(rungs[i])
    if first == FIT:
        largest = i
        for j in range(i + 1, len(rungs)):
            if trial(rungs[j]) != FIT:
                break
            largest = j
        return rungs[largest]
    if first == ERROR:
        return None
    for j in range(i - 1, -1, -1):
        result = trial(rungs[j])
        if result == FIT:
            return rungs[j]
        if result == ERROR:
            return None
    return None


def search_throughput(micro_batches: Iterable[int], trial: Callable[[int, bool], str]) -> None:
    """Run the throughput trials ``trial(micro_batch, activation_checkpointing)``: without
    checkpointing up to the first micro-batch that does not fit, then with checkpointing from
    the next micro-batch up to the first that does not fit. An error ends the search."""
    ordered = sorted(micro_batches)
    largest_without = 0
    for mb in ordered:
        result = trial(mb, False)
        if result == ERROR:
            return
        if result != FIT:
            break
        largest_without = mb
    for mb in ordered:
        if mb > largest_without and trial(mb, True) != FIT:
            return


def predicted_bytes(spec: TrialSpec) -> int:
    """The memory planner's peak bytes per GPU for a trial (``srtrain.plan.plan_run`` on the
    trial's ``gpus``)."""
    cfg = trial_config(spec)
    return plan_run(cfg, spec.gpus, resolve_model_config(cfg.model, spec.vocab_size)).plan.total


def _child_env() -> dict[str, str]:
    """The environment of a trial: this one, with srtrain importable and no torchrun rank."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def launch_trial(spec: TrialSpec, timeout: float) -> dict:
    """Run one trial in a fresh process (its own process group, killed after ``timeout``
    seconds); its row, with ``wall_s``. A process that ends without a row gives a row with
    ``fit`` false, the reason, and the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="srtrain-capacity-") as tmp:
        spec_path, row_path, log_path = (
            Path(tmp) / n for n in ("spec.json", "row.json", "log.txt")
        )
        spec_path.write_text(json.dumps(spec.to_dict()))
        cmd = [sys.executable, "-m", "srtrain.bench.capacity_trial", str(spec_path), str(row_path)]
        start = time.perf_counter()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True
            )
            try:
                returncode = proc.wait(timeout=timeout)
                reason = f"trial process exited with status {returncode}"
            except subprocess.TimeoutExpired:
                reason = f"timeout after {timeout:g} s"
            finally:  # also when this process is interrupted: no trial outlives its launcher
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall = time.perf_counter() - start
        if row_path.exists():
            row = json.loads(row_path.read_text())
        else:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-20:]
            row = {**spec.row(), "fit": False, "oom": False, "error": reason, "log_tail": tail}
    row["wall_s"] = wall
    return row


@dataclass
class CapacityPlan:
    """What one capacity run does."""

    variants: list[str]
    shapes: dict[str, Shape]  # every rung by name, smallest first
    ladder: list[str]  # the rungs the ladder search climbs (empty: no ladder search)
    starts: dict[str, str]  # variant → start rung (absent: the planner's largest that fits)
    throughput_rung: str | None  # None: no throughput search
    micro_batches: tuple[int, ...]
    seq_len: int
    vocab_size: int
    device: str
    ladder_steps: tuple[int, int]
    throughput_steps: tuple[int, int]
    timeout: float
    budget: float | None  # seconds for the whole run; None: no limit


class Recorder:
    """Rows of a run, rewritten to the result file after each trial."""

    def __init__(self, path: Path | None, environment: dict, settings: dict) -> None:
        self.path = path
        self.environment = environment
        self.settings = settings
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        """Record a row and write the file."""
        self.rows.append(row)
        self.write()

    def result(self) -> dict:
        """The result file's content: environment, settings, rows and their summary."""
        return {
            "environment": self.environment,
            "settings": self.settings,
            "rows": self.rows,
            "summary": summarize(self.rows),
        }

    def write(self) -> None:
        """Write the result file (replaced whole, never half-written)."""
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.result(), indent=2))
        tmp.replace(self.path)


def trial_spec(
    plan: CapacityPlan,
    variant: str,
    rung: str,
    search: str,
    micro_batch: int = 1,
    activation_checkpointing: bool = True,
) -> TrialSpec:
    """The spec of one trial of ``plan``: the ladder's settings unless told otherwise."""
    steps = plan.ladder_steps if search == "ladder" else plan.throughput_steps
    return TrialSpec(
        variant=variant,
        rung=rung,
        shape=plan.shapes[rung],
        seq_len=plan.seq_len,
        micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing,
        warmup_steps=steps[0],
        measured_steps=steps[1],
        device=plan.device,
        vocab_size=plan.vocab_size,
        search=search,
    )


def planned_start(plan: CapacityPlan, variant: str) -> str:
    """The largest ladder rung the planner expects ``variant`` to fit in an H200
    (``srtrain.plan.GPU_MEMORY_GIB``); the smallest when it expects none to."""
    start = plan.ladder[0]
    for rung in plan.ladder:
        if predicted_bytes(trial_spec(plan, variant, rung, "ladder")) > GPU_MEMORY_GIB * GIB:
            break
        start = rung
    return start


def run_capacity(
    plan: CapacityPlan, recorder: Recorder, progress: Callable[[str], None] = print
) -> list[dict]:
    """Run the ladder and throughput searches of ``plan``; every row goes to ``recorder``."""
    deadline = None if plan.budget is None else time.monotonic() + plan.budget
    rungs = plan.ladder
    gpu_bytes = int(GPU_MEMORY_GIB * GIB)

    def run(spec: TrialSpec) -> str:
        timeout = plan.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < min(plan.timeout, 30.0):
                raise BudgetSpentError
            timeout = min(timeout, left)
        predicted = predicted_bytes(spec)
        row = launch_trial(spec, timeout)
        row.update(predicted_gib=predicted / GIB, predicted_fits=predicted <= gpu_bytes)
        recorder.add(row)
        progress(format_row(row))
        return outcome(row)

    try:
        for variant in plan.variants if rungs else ():
            start = plan.starts.get(variant) or planned_start(plan, variant)
            search_ladder(
                rungs, start, lambda rung, v=variant: run(trial_spec(plan, v, rung, "ladder"))
            )
        if plan.throughput_rung is not None:
            for variant in plan.variants:
                search_throughput(
                    plan.micro_batches,
                    lambda mb, ac, v=variant: run(
                        trial_spec(plan, v, plan.throughput_rung, "throughput", mb, ac)
                    ),
                )
    except BudgetSpentError:
        progress("time budget spent: the remaining trials were not run")
    return recorder.rows


def format_row(row: dict) -> str:
    """One line for a finished trial."""
    head = (
        f"{row['variant']:<{NAME_WIDTH}} {row['rung']:>4} mb {row['micro_batch']} "
        f"AC {'on' if row['activation_checkpointing'] else 'off':<3}"
    )
    wall = f"{row.get('wall_s', 0.0):5.0f} s"
    planned = f"  plan {row['predicted_gib']:.1f} GiB" if "predicted_gib" in row else ""
    if row.get("fit"):
        return (
            f"{head} fit   peak {row['peak_allocated_gib']:6.1f} GiB"
            + (f" (reserved {row['peak_reserved_gib']:.1f})" if "peak_reserved_gib" in row else "")
            + f"{planned}  {row['tokens_per_s']:9,.0f} tok/s  MFU {row['mfu']:.3f}  {wall}"
        )
    kind = "OOM  " if row.get("oom") else "ERROR"
    return f"{head} {kind} {row.get('phase', '')}: {row.get('error', '')}{planned}  {wall}"


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per variant: the largest ladder rung that fit (params, peaks, the planner's peak), the
    smallest that ran
    out of memory, the ratio of its parameters to torch's largest; and the best throughput
    trial (tokens/s, MFU, micro-batch, checkpointing) with its ratio to torch's best."""
    summary: dict[str, dict] = {}
    for row in rows:
        entry = summary.setdefault(row["variant"], {})
        if row.get("search") == "ladder":
            if row.get("fit"):
                if row["params"] > entry.get("params", -1):
                    entry.update(
                        largest=row["rung"],
                        params=row["params"],
                        peak_allocated_gib=row.get("peak_allocated_gib"),
                        peak_reserved_gib=row.get("peak_reserved_gib"),
                        predicted_gib=row.get("predicted_gib"),
                    )
            elif row.get("oom"):
                if row.get("params", 0) < entry.get("no_fit_params", float("inf")):
                    entry.update(no_fit=row["rung"], no_fit_params=row.get("params", 0))
            else:
                entry.setdefault("errors", []).append(f"{row['rung']}: {row.get('error', '')}")
        elif row.get("search") == "throughput":
            if row.get("fit") and row["tokens_per_s"] > entry.get("tokens_per_s", -1.0):
                entry.update(
                    throughput_rung=row["rung"],
                    tokens_per_s=row["tokens_per_s"],
                    mfu=row["mfu"],
                    micro_batch=row["micro_batch"],
                    activation_checkpointing=row["activation_checkpointing"],
                )
            elif not row.get("fit") and not row.get("oom"):
                entry.setdefault("errors", []).append(
                    f"{row['rung']} mb {row['micro_batch']}: {row.get('error', '')}"
                )
    base = summary.get("torch", {})
    for entry in summary.values():
        entry.pop("no_fit_params", None)
        if "params" in entry and "params" in base:
            entry["params_vs_torch"] = entry["params"] / base["params"]
        if "tokens_per_s" in entry and "tokens_per_s" in base:
            entry["tokens_per_s_vs_torch"] = entry["tokens_per_s"] / base["tokens_per_s"]
    return summary


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _count(params: int | None) -> str:
    """A parameter count in billions (or millions, below a billion)."""
    if params is None:
        return "-"
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"


def summary_table(summary: dict[str, dict]) -> str:
    """The summary as a text table, one line per variant."""
    header = (
        f"{'variant':<{NAME_WIDTH}} {'largest':>7} {'params':>7} {'peak GiB':>8} {'resv GiB':>8} "
        f"{'plan GiB':>8} "
        f"{'×torch':>6} {'no fit':>6} | {'tok/s':>8} {'MFU':>5} {'mb':>2} {'AC':>3} "
        f"{'×torch':>6}"
    )
    lines = [header, "-" * len(header)]
    for variant, e in summary.items():
        ac = e.get("activation_checkpointing")
        lines.append(
            f"{variant:<{NAME_WIDTH}} {e.get('largest', '-'):>7} "
            f"{_count(e.get('params')):>7} "
            f"{_cell(e.get('peak_allocated_gib'), '.1f'):>8} "
            f"{_cell(e.get('peak_reserved_gib'), '.1f'):>8} "
            f"{_cell(e.get('predicted_gib'), '.1f'):>8} "
            f"{_cell(e.get('params_vs_torch'), '.2f'):>6} "
            f"{e.get('no_fit', '-'):>6} | "
            f"{_cell(e.get('tokens_per_s'), ',.0f'):>8} {_cell(e.get('mfu'), '.3f'):>5} "
            f"{_cell(e.get('micro_batch'), 'd'):>2} "
            f"{'-' if ac is None else ('on' if ac else 'off'):>3} "
            f"{_cell(e.get('tokens_per_s_vs_torch'), '.2f'):>6}"
        )
        for error in e.get("errors", []):
            lines.append(f"{'':<{NAME_WIDTH}} error: {error}")
    return "\n".join(lines)


def parse_names(text: str, allowed: Iterable[str], what: str) -> list[str]:
    """Comma-separated names, each checked against ``allowed``."""
    allowed = list(allowed)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in allowed:
            raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(allowed)}")
    if not names:
        raise ValueError(f"no {what} given; allowed: {', '.join(allowed)}")
    return names


def build_plan(
    *,
    variants: str | None = None,
    rungs: str | None = None,
    starts: str | None = None,
    ladder: bool = True,
    throughput: bool = True,
    throughput_rung: str | None = None,
    micro_batches: str | None = None,
    timeout: float = 300.0,
    budget: float | None = None,
    dry: bool = False,
) -> CapacityPlan:
    """The plan of a run from command-line values; ValueError names a bad value.

    ``rungs`` picks ladder rungs (kept in ladder order); ``starts`` maps variants to start
    rungs (``torch=7b,fp4-bf16w=26b``). ``dry`` runs on the CPU with the small dry ladder.
    """
    all_shapes = DRY_LADDER if dry else LADDER
    chosen_variants = parse_names(variants or ",".join(DEFAULT_VARIANTS), VARIANTS, "variant")
    picked = set(parse_names(rungs, all_shapes, "rung")) if rungs else set(all_shapes)
    ladder_rungs = [n for n in all_shapes if n in picked] if ladder else []
    start_map: dict[str, str] = {}
    for item in starts.split(",") if starts else []:
        variant, sep, rung = item.partition("=")
        if not sep:
            raise ValueError(f"--start item {item!r} must look like variant=rung (torch=7b)")
        parse_names(variant, VARIANTS, "variant")
        parse_names(rung, ladder_rungs or all_shapes, "start rung")
        start_map[variant] = rung
    tp_rung = throughput_rung or next(iter(all_shapes))
    parse_names(tp_rung, all_shapes, "throughput rung")
    mbs = MICRO_BATCHES
    if micro_batches:
        try:
            mbs = tuple(sorted({int(m) for m in micro_batches.split(",")}))
        except ValueError:
            mbs = ()
        if not mbs or mbs[0] < 1:
            raise ValueError(
                f"--micro-batches {micro_batches!r}: give positive integers, "
                "comma-separated (1,2,4,8)"
            )
    if timeout <= 0 or (budget is not None and budget <= 0):
        raise ValueError("--timeout and --budget take positive seconds")
    return CapacityPlan(
        variants=chosen_variants,
        shapes=dict(all_shapes),
        ladder=ladder_rungs,
        starts=start_map,
        throughput_rung=tp_rung if throughput else None,
        micro_batches=mbs,
        seq_len=DRY_SEQ_LEN if dry else SEQ_LEN,
        vocab_size=DRY_VOCAB_SIZE if dry else VOCAB_SIZE,
        device="cpu" if dry else "cuda",
        ladder_steps=DRY_STEPS if dry else LADDER_STEPS,
        throughput_steps=DRY_STEPS if dry else THROUGHPUT_STEPS,
        timeout=timeout,
        budget=budget,
    )


def read_rows(paths: Iterable[Path]) -> list[dict]:
    """The rows of recorded result files, in order."""
    rows: list[dict] = []
    for path in paths:
        try:
            rows.extend(json.loads(Path(path).read_text())["rows"])
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{path}: not a capacity result file ({err})") from None
    return rows
