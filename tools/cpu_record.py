"""What a CPU-host result file records about where it ran, and how it is written.

Shared by ``default_job.py``, ``prepare_bench.py``, ``corpus_scale.py`` and
``faults_table.py``: the date, the host (``a 2-core AMD EPYC``, as srtrain's benchmarks name
it), torch and Triton versions, the checkout's commit (with ``+changes`` where the named
sources differ from it) and the command.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit(*sources: str) -> str:
    """The checkout's commit, with ``+changes`` where its tracked ``sources`` differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", *sources)
    return head + ("+changes" if changed and head != "unknown" else "")


def environment(command: str, *sources: str) -> dict:
    """Date, host, torch and Triton versions, commit (``sources`` checked for changes) and
    ``command`` of a result measured now."""
    import torch
    import triton

    from srtrain.bench.__main__ import cpu_name

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": cpu_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit(*sources),
        "command": command,
    }


def write(out: Path, data: dict) -> dict:
    """Write ``data`` to ``out`` as indented JSON (creating its directory); returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data
