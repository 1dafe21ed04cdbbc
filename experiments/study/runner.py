"""Run a grid: one training subprocess per run, a few at a time per GPU, within a deadline.

Each run trains through the repository's ``train`` entry point in its own process with
``CUDA_VISIBLE_DEVICES`` naming one GPU (or none, on the CPU), writes its run directory
``OUT/<name>`` and its console output to ``OUT/<name>/train.log``; a run never outlives the
runner (on Linux it gets SIGKILL when the runner dies, even by SIGKILL). Runs start in grid order
on the GPU with the fewest runs going. At the deadline (or on SIGTERM/SIGINT) the runs still
going get SIGTERM (a run saves a checkpoint after its step in flight: srtrain.stopping), then
SIGKILL after ``KILL_GRACE_S``, and are marked incomplete. After every finished run and at
the end, ``OUT/summary.json`` and ``OUT/results.tar.gz`` (every run's config.yaml,
metrics.jsonl, train.log and events.json, and the summary) are rewritten atomically, also
into an optional export directory that holds nothing else (e.g. the few files a remote
machine sends back).

The summary records where its runs trained: ``commit`` (of the checkout the runs import,
``+changes`` where its tracked files differ from it; ``SRTRAIN_COMMIT`` overrides;
``unknown`` outside a git checkout), ``device`` (the GPUs' names, or the CPU's), ``torch``
and ``triton``, for this invocation; ``invocations`` lists them for every invocation that
wrote to the same output directory (``--resume`` runs a grid in pieces), oldest first.
Summaries written before these fields existed read as ``unknown``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import srtrain
from experiments.study.grid import REPO, Grid, GridError, Run
from experiments.study.summary import (
    CONFIG_FILE,
    LOG_FILE,
    RUN_FILES,
    summarize_dir,
    write_atomic,
    write_events,
)
from srtrain.checkpoint import latest
from srtrain.config import parse_override

TRAIN = REPO / "train"
SUMMARY_FILE = "summary.json"
RESULTS_FILE = "results.tar.gz"
KILL_GRACE_S = 10.0
POLL_S = 0.5
LOG_TAIL_CHARS = 4000
MAX_THREADS = 4
# Launcher variables that would make a child join someone else's process group.
DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
CPU = "cpu"
STALE_STATUS = {"running": "incomplete", "pending": "not_started"}
PR_SET_PDEATHSIG = 1


PROVENANCE_KEYS = ("commit", "device", "torch", "triton")
UNKNOWN = "unknown"


def checkout_commit(root: Path = REPO) -> str:
    """``SRTRAIN_COMMIT``, else the short commit of the git checkout at ``root`` with
    ``+changes`` where tracked files differ from it; ``unknown`` outside a checkout."""
    forced = os.environ.get("SRTRAIN_COMMIT")
    if forced:
        return forced

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return UNKNOWN
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:
        return UNKNOWN
    return head.stdout.strip() + ("+changes" if changed else "")


def device_name(gpus: Sequence[str]) -> str:
    """The distinct names of the listed GPUs (``NVIDIA H200``), or the CPU's for ``cpu``."""
    if list(gpus) == [CPU]:
        return platform.processor() or platform.machine() or CPU
    import torch

    names = dict.fromkeys(torch.cuda.get_device_name(int(g)) for g in gpus)
    return ", ".join(names) or UNKNOWN


def provenance(gpus: Sequence[str]) -> dict[str, str]:
    """Commit, device and the torch and Triton versions of an invocation on ``gpus``."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = UNKNOWN
    return {
        "commit": checkout_commit(),
        "device": device_name(gpus),
        "torch": torch.__version__,
        "triton": triton_version,
    }


def parse_gpus(text: str | None) -> list[str]:
    """``cpu`` or comma-separated CUDA device indices; default: every visible GPU, else cpu."""
    import torch

    count = torch.cuda.device_count()
    if text is None:
        return [str(i) for i in range(count)] or [CPU]
    if text == CPU:
        return [CPU]
    parts = text.split(",")
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise GridError(f"--gpus {text!r}: expected 'cpu' or distinct GPU indices like 0,1")
    missing = [p for p in parts if int(p) >= count]
    if missing:
        raise GridError(
            f"--gpus {text!r}: GPU {missing[0]} does not exist "
            f"({count} CUDA device(s) visible); use indices below {count} or 'cpu'"
        )
    return [str(int(p)) for p in parts]


def check_out_dir(out: Path) -> Path:
    """The output directory, created if missing; its parent must exist."""
    if out.exists() and not out.is_dir():
        raise GridError(f"--out {out}: exists and is not a directory")
    if not out.parent.is_dir():
        raise GridError(f"--out {out}: parent directory {out.parent} does not exist")
    out.mkdir(exist_ok=True)
    return out


def run_overrides(run: Run, extra: Sequence[str], cpu: bool, run_dir: Path) -> list[str]:
    """The run's overrides, then the device, the extra ones and its run directory.

    When the extra overrides change ``train.steps`` but not ``optim.warmup_steps``, the
    warmup follows as 10% of the steps (the study's schedule).
    """
    keys = {".".join(parse_override(o)[:2]): parse_override(o)[2] for o in extra}
    added = []
    if "train.steps" in keys and "optim.warmup_steps" not in keys:
        steps = keys["train.steps"]
        if isinstance(steps, int) and not isinstance(steps, bool):
            added.append(f"optim.warmup_steps={steps // 10}")
    device = ["parallel.device=cpu"] if cpu else []
    return [*run.overrides, *device, *extra, *added, f"train.run_dir={run_dir}"]


def child_env(gpu: str, threads: int) -> dict[str, str]:
    """Environment of a run: one GPU (none for cpu), few threads, no launcher variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DIST_ENV and not k.startswith("TORCHELASTIC_")
    }
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu == CPU else gpu
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    src = str(Path(srtrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def die_with_parent() -> None:
    """In a child process before exec: on Linux, get SIGKILL when the parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Job:
    """A run's process and bookkeeping."""

    run: Run
    run_dir: Path
    overrides: list[str]
    status: str = "pending"  # pending, running, complete, incomplete, failed, not_started
    gpu: str | None = None
    proc: subprocess.Popen | None = None
    log: IO[bytes] | None = None
    started: float = 0.0
    ended: float = 0.0
    returncode: int | None = None
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def start(self, gpu: str, threads: int, resume: bool = False) -> None:
        """Launch the training process. The run directory starts empty, unless ``resume``
        and it holds a checkpoint: then the trainer resumes from its latest one and the log
        is appended to."""
        resuming = resume and latest(self.run_dir) is not None
        if not resuming:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir.mkdir(parents=True)
        self.log = (self.run_dir / LOG_FILE).open("ab" if resuming else "wb")
        cmd = [sys.executable, str(TRAIN), "--config", str(self.run.config), *self.overrides]
        self.log.write(("+ " + " ".join(cmd) + "\n").encode())
        self.log.flush()
        self.gpu, self.started, self.status = gpu, time.monotonic(), "running"
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=child_env(gpu, threads),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the run's process group (the trainer and anything it started)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def finish(self) -> None:
        """Record the exit: complete, incomplete (killed here) or failed."""
        self.returncode = self.proc.wait()
        self.ended = time.monotonic()
        self.log.close()
        if self.killed:
            self.status = "incomplete"
        else:
            self.status = "complete" if self.returncode == 0 else "failed"
        try:
            write_events(self.run_dir)
        except Exception as err:  # a cut-short event file must not lose the summary
            self.extra["events_error"] = f"{type(err).__name__}: {err}"


def _log_tail(path: Path) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - LOG_TAIL_CHARS))
        return f.read().decode(errors="replace")


def job_entry(job: Job) -> dict[str, Any]:
    """The summary entry of a run in any state."""
    entry: dict[str, Any] = {
        "name": job.run.name,
        "config": str(job.run.config),
        "overrides": job.overrides,
        "status": job.status,
        "gpu": job.gpu,
        "returncode": job.returncode,
        "wall_s": round((job.ended or time.monotonic()) - job.started, 1) if job.started else 0.0,
    }
    if (job.run_dir / CONFIG_FILE).exists():
        entry.update(summarize_dir(job.run_dir))
    else:
        entry["steps_reached"] = 0
    if job.status == "failed":
        entry["log_tail"] = _log_tail(job.run_dir / LOG_FILE)
    entry.update(job.extra)
    return entry


class Study:
    """The jobs of one grid in one output directory, and the files that summarise them."""

    def __init__(
        self,
        grid: Grid,
        out: Path,
        extra: Sequence[str],
        cpu: bool,
        export: Path | None = None,
        resume: bool = False,
        gpus: Sequence[str] | None = None,
    ) -> None:
        self.grid, self.out, self.extra, self.export = grid, out, list(extra), export
        self.previous, self.invocations = self._previous_entries()
        done = {e["name"] for e in self.previous if e["status"] == "complete"} if resume else set()
        self.jobs = [
            Job(r, out / r.name, run_overrides(r, extra, cpu, out / r.name))
            for r in grid.runs
            if r.name not in done
        ]
        self.started = time.time()
        self.provenance = provenance(gpus if gpus is not None else [CPU] if cpu else [])
        self.meta: dict[str, Any] = {}

    def _previous_entries(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Entries of an earlier summary in ``out`` (kept for runs this invocation does not
        redo, placeholders, replaced on writing, for those it does, in their old order) and
        the provenance of the invocations that wrote it."""
        path = self.out / SUMMARY_FILE
        if not path.exists():
            return [], []
        old = json.loads(path.read_text())
        if old.get("grid") != self.grid.name:
            raise GridError(
                f"--out {self.out} holds results of grid {old.get('grid')!r}, "
                f"not {self.grid.name!r}; choose another directory"
            )
        redo = set(self.grid.names)
        kept = [
            e for e in old.get("runs", []) if e["name"] in redo or (self.out / e["name"]).is_dir()
        ]
        for entry in kept:  # a runner that was killed left these behind
            entry["status"] = STALE_STATUS.get(entry["status"], entry["status"])
        invocations = old.get("invocations") or [
            {"started": old.get("started"), **{k: old.get(k, UNKNOWN) for k in PROVENANCE_KEYS}}
        ]
        return kept, invocations

    def write(self) -> dict[str, Any]:
        """Rewrite summary.json and results.tar.gz from the current state of every run."""
        current = {j.run.name: job_entry(j) for j in self.jobs}
        entries = [current.pop(e["name"], e) for e in self.previous] + list(current.values())
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started))
        summary = {
            "grid": self.grid.name,
            "out": str(self.out),
            "extra_overrides": self.extra,
            "started": started,
            "wall_s": round(time.time() - self.started, 1),
            **self.provenance,
            "invocations": [*self.invocations, {"started": started, **self.provenance}],
            **self.meta,
            "runs": entries,
        }
        text = json.dumps(summary, indent=1).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            _add_bytes(tar, SUMMARY_FILE, text)
            for entry in entries:
                for name in RUN_FILES:
                    path = self.out / entry["name"] / name
                    if path.is_file():
                        _add_bytes(tar, f"{entry['name']}/{name}", path.read_bytes())
        for directory in (self.out, self.export):
            if directory is not None:
                write_atomic(directory / SUMMARY_FILE, text)
                write_atomic(directory / RESULTS_FILE, buffer.getvalue())
        return summary


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _stop_all(running: list[Job]) -> None:
    """SIGTERM every running job, then SIGKILL those still alive after the grace period."""
    for job in running:
        if job.proc.poll() is None:
            job.killed = True
            job.signal(signal.SIGTERM)
    end = time.monotonic() + KILL_GRACE_S
    while any(j.proc.poll() is None for j in running) and time.monotonic() < end:
        time.sleep(0.1)
    for job in running:
        job.signal(signal.SIGKILL)


def run_grid(
    grid: Grid,
    out: Path,
    gpus: Sequence[str],
    per_gpu: int = 1,
    deadline_s: float | None = None,
    extra: Sequence[str] = (),
    export: Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train every run of ``grid`` under ``out``; returns the final summary.

    ``export``: a second directory that gets only summary.json and results.tar.gz.
    ``resume``: continue an earlier invocation on the same ``out``: runs it completed are
    kept as they are, runs with a checkpoint resume from it (give the runs checkpoints,
    e.g. ``checkpoint.enabled=true checkpoint.interval=500``), the others start afresh.
    Long grids are run this way in pieces, each within a ``deadline_s``.
    """
    if per_gpu < 1:
        raise GridError(f"--per-gpu {per_gpu}: must be at least 1")
    if not TRAIN.is_file():
        raise GridError(f"the train entry point {TRAIN} is missing; run from a source checkout")
    if deadline_s is not None and deadline_s <= 0:
        raise GridError(f"--deadline {deadline_s}: must be a positive number of seconds")
    cpu = list(gpus) == [CPU]
    study = Study(
        grid,
        check_out_dir(out),
        extra,
        cpu,
        check_out_dir(export) if export is not None else None,
        resume,
        gpus,
    )
    slots = len(gpus) * per_gpu
    threads = max(1, min(MAX_THREADS, (os.cpu_count() or 1) // slots))
    study.meta = {
        "gpus": list(gpus),
        "per_gpu": per_gpu,
        "deadline_s": deadline_s,
        "omp_threads": threads,
    }
    stop = {"signal": None}

    def request_stop(signum, _frame):
        stop["signal"] = signum

    handlers = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    start = time.monotonic()
    pending, running = list(study.jobs), []
    turn = 0
    stopped_by = None
    try:
        study.write()
        while pending or running:
            if deadline_s is not None and time.monotonic() - start >= deadline_s:
                stopped_by = "deadline"
            elif stop["signal"] is not None:
                stopped_by = signal.Signals(stop["signal"]).name
            if stopped_by:
                _say(f"stopping ({stopped_by}): {', '.join(j.run.name for j in running)}")
                _stop_all(running)
                break
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                job.finish()
                _say(f"{job.run.name}: {job.status} after {job.ended - job.started:.0f} s")
                study.write()
            while pending and len(running) < slots:
                load = {g: sum(j.gpu == g for j in running) for g in gpus}
                order = list(gpus[turn:]) + list(gpus[:turn])
                gpu = min(order, key=lambda g: load[g])
                turn = (gpus.index(gpu) + 1) % len(gpus)
                job = pending.pop(0)
                job.start(gpu, threads, resume)
                running.append(job)
                _say(f"{job.run.name}: started on {'CPU' if gpu == CPU else 'GPU ' + gpu}")
            time.sleep(POLL_S)
    finally:
        for job in running:
            if job.proc.poll() is None:
                job.killed = True
                job.signal(signal.SIGKILL)
            job.finish()
        for job in pending:
            job.status = "not_started"
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    study.meta["stopped_by"] = stopped_by
    return study.write()
