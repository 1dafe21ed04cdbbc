"""Every path under a run directory, and what a run dir says about its run.

A run dir (``train.run_dir``) holds::

    config.yaml            the run's config, rewritten at each start (CONFIG_FILE)
    metrics.jsonl          one record per step, rank 0 (METRICS_FILE, srtrain.metrics)
    tb/                    TensorBoard events (TB_DIR, srtrain.metrics)
    checkpoints/step-N/    complete checkpoints (CHECKPOINTS_DIR, srtrain.checkpoint)
    .srtrain-lock.G        the owner's lease, generation G (LOCK_PREFIX, srtrain.rundir_lock)

The modules that write each part name it from here; this one imports only the config's
error type.
"""

from __future__ import annotations

import os
from pathlib import Path

from srtrain.config import ConfigError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
CHECKPOINTS_DIR = "checkpoints"
LOCK_PREFIX = ".srtrain-lock."


def check_writable(run_dir: str | Path) -> None:
    """Raise ConfigError unless this process can create ``run_dir`` or write into it;
    writes nothing."""
    path = Path(os.path.abspath(run_dir))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = "fix the permissions or choose another train.run_dir"
    if not existing.is_dir():
        raise ConfigError(
            f"train.run_dir: {run_dir} cannot be created: {existing} is not a "
            "directory; choose another train.run_dir"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == path:
            raise ConfigError(f"train.run_dir: {run_dir} is not writable; {fix}")
        raise ConfigError(
            f"train.run_dir: {run_dir} cannot be created: {existing} is not writable; {fix}"
        )


def finished_message(run_dir: str | Path, steps: int, checkpoint: int) -> str:
    """What a start in a run dir whose run has finished says: where it stands, how to train
    longer, how to start afresh."""
    where = (
        f"already finished its {steps} steps"
        if checkpoint == steps
        else f"is already at step {checkpoint}, past train.steps={steps}"
    )
    return (
        f"{run_dir} {where} (checkpoint step-{checkpoint}); to train longer: run again "
        f"with train.steps={2 * checkpoint} (same run dir; the learning-rate schedule "
        f"stretches to the new length); to start fresh: remove {run_dir} or set "
        "train.run_dir"
    )
