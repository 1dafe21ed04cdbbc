#!/usr/bin/env python3
"""The README's default job, timed and filed: ``./train`` in a fresh directory.

Usage: python tools/default_job.py --record docs/results/data/default-job/DATE-cpu.json
       python tools/default_job.py --record FILE train.steps=50 parallel.compute_dtype=bf16

Runs the checkout's ``./train`` in an empty temporary directory, so it prepares
``data/builtin`` (the Python standard library, tokenized) and trains ``runs/tiny`` from
scratch exactly as a first-time user's run does; the wall time includes the preparation. It
files the wall time, the host, the software versions, the commit, the run's first console
line, the steps trained, the vocabulary, and the first and last training loss and the last
validation loss and the FP32 shadow's values at each log step read from the run's
``metrics.jsonl``, and the tokens/s of each console log line. Overrides after the options
are passed to ``./train`` and filed with the rest. ``tools/figures.py`` renders README's
sentence from the newest record without overrides (figure ``default-job``),
docs/training.md's CPU compute dtypes from the records that set ``parallel.compute_dtype``
(``cpu-compute-dtype``) and its typical shadow values from those that set ``optim.m_format``
(``shadow-typical``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_record import environment, write

ROOT = Path(__file__).resolve().parents[1]


TOKENS_PER_S = re.compile(r"\| ([\d,]+) tok/s \|")


def run_default_job(workdir: Path, overrides: list[str]) -> tuple[float, str]:
    """Run ``./train OVERRIDES`` in ``workdir``; its wall time in seconds and its console
    output."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "train"), *overrides],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SRTRAIN_")},
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"./train exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout


def measured(workdir: Path, console: str) -> dict:
    """Steps, vocabulary, losses and console tokens/s of the finished default run in
    ``workdir``."""
    records = [
        json.loads(line)
        for line in (workdir / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r for r in records if r.get("loss") is not None]
    vals = [r for r in records if r.get("val_loss") is not None]
    meta = json.loads((workdir / "data" / "builtin" / "meta.json").read_text())
    return {
        "steps": losses[-1]["step"],
        "vocab_size": meta["vocab_size"],
        "first_loss": losses[0]["loss"],
        "last_loss": losses[-1]["loss"],
        "last_val_loss": vals[-1]["val_loss"] if vals else None,
        "shadow": {
            key: [r[key] for r in records if r.get(key) is not None]
            for key in sorted({k for r in records for k in r if k.startswith("shadow_")})
        },
        "tokens_per_s": [
            float(m.group(1).replace(",", "")) for m in TOKENS_PER_S.finditer(console)
        ],
    }


def record(out: Path, overrides: list[str]) -> dict:
    """Run the default job with ``overrides`` and write what it measured to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        wall, console = run_default_job(Path(tmp), overrides)
        values = measured(Path(tmp), console)
    command = " ".join(["python tools/default_job.py --record", out.name, *overrides])
    data = {
        "environment": environment(command, "src", "configs", "train"),
        "overrides": overrides,
        "wall_s": round(wall, 1),
        **values,
        "banner": next((line for line in console.splitlines() if line.startswith("srtrain:")), ""),
    }
    return write(out, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides of ./train")
    args = parser.parse_args(argv)
    data = record(args.record, args.overrides)
    print(json.dumps({k: v for k, v in data.items() if k != "environment"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
