"""What a CPU-host result file records about where it ran, and how it is written.

Shared by ``default_job.py``, ``prepare_bench.py``, ``corpus_scale.py``, ``tokenizer_bench.py`` and
``faults_table.py``: the date, the host (``a 2-core AMD EPYC``, as srtrain's benchmarks name
it), torch and Triton versions, the checkout's commit (with ``+changes`` where the named
sources differ from it) and the command.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Sequence
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


def loaded_environment(command: str, load_before: Sequence[float]) -> dict:
    """:func:`environment` of ``command`` (the ``src`` sources checked), with the host's 1-,
    5- and 15-minute load averages before the runs (``load_before``) and after them (now):
    a loaded host lowers the rates measured."""
    return {
        **environment(command, "src"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def write(out: Path, data: dict) -> dict:
    """Write ``data`` to ``out`` as indented JSON (creating its directory); returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data
