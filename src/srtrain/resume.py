"""Where a run continues from: the trainer state a checkpoint carries, which checkpoint a
run resumes (its own newest, else ``checkpoint.load``), and the run dir's first writes once
that is settled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from srtrain.checkpoint import (
    CheckpointManager,
    checkpoint_step,
    load,
    load_latest_valid,
    resolve_checkpoint,
)
from srtrain.config import Config, dump_config
from srtrain.console import print_line
from srtrain.errors import agree
from srtrain.metrics import MEMORY_CUDA, MEMORY_MAXRSS, MetricsLogger, trim_records
from srtrain.nospace import no_space, out_of_space
from srtrain.parallel import DistInfo
from srtrain.rundir import CONFIG_FILE

# The trainer state a checkpoint's ``extra`` carries: section → key → type of its value.
TRAINER_STATE: dict[str, dict[str, type]] = {
    "loader": {"split": str, "seed": int, "seq_len": int, "num_windows": int, "position": int},
    "resets": dict.fromkeys(
        ("age_m", "age_v", "window_m", "window_v", "window_elements", "window_steps"), int
    ),
}


# extra's key for the norm the next step inside backward clips by (None before the first)
CLIP_NORM_KEY = "clip_norm"


def trainer_state_problem(extra: dict) -> str | None:
    """What keeps a checkpoint's ``extra`` from restoring the trainer (the first section or
    key missing or of the wrong type, e.g. ``loader.position of type str``); None if it can."""
    for section, keys in TRAINER_STATE.items():
        saved = extra.get(section)
        if not isinstance(saved, dict):
            return f"{section} missing" if saved is None else f"{section} malformed"
        for key, kind in keys.items():
            value = saved.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                what = "missing" if value is None else f"of type {type(value).__name__}"
                return f"{section}.{key} {what}"
    return None


def resume(
    cfg: Config, run_dir: Path, model, optimizer, log: Callable[[str], None]
) -> tuple[int, dict | None, str | None]:
    """Step and trainer state to continue from, and the line saying which and why.

    The run dir's own newest usable checkpoint wins (``log`` receives a line for each
    corrupt one passed over, on rank 0); ``checkpoint.load`` seeds the run only while its
    run dir has no usable checkpoint; else the run starts afresh (no line)."""
    seed = cfg.checkpoint.load
    if cfg.checkpoint.enabled:
        instead = f"starting from checkpoint.load={seed} instead" if seed else None
        found = load_latest_valid(
            run_dir, model, optimizer, log=log, otherwise=instead, check_extra=trainer_state_problem
        )
        if found is not None:
            step, extra = found
            ignored = (
                f" (its own newest checkpoint: checkpoint.load={seed} seeds a run only before "
                "its first checkpoint)"
                if seed
                else ""
            )
            return step, extra, f"resumed from step {step} of {run_dir}{ignored}"
    if not seed:
        return 0, None, None
    path = resolve_checkpoint(seed)
    step = checkpoint_step(path)
    why = (
        f"{run_dir} has no usable checkpoint of its own yet"
        if cfg.checkpoint.enabled
        else "checkpoint.enabled is false, so the run keeps none of its own"
    )
    extra = load(path, model, optimizer, check_extra=trainer_state_problem)
    return step, extra, f"started from {path} (step {step}): {why}"


def open_run_dir(
    cfg: Config, info: DistInfo, run_dir: Path, start: int, resumed: bool
) -> tuple[CheckpointManager | None, MetricsLogger]:
    """The run dir's first writes, once every check has passed (every rank calls it; a
    failure on any rank raises on every rank): the checkpoint manager, and on rank 0
    ``config.yaml``, ``metrics.jsonl`` cut back to ``start`` (emptied for a run starting
    afresh, atomically: see :func:`trim_records`) and the TensorBoard writer, which hides
    the events of steps after ``start`` too. ``resumed``: whether a checkpoint was loaded."""

    def open_all() -> tuple[CheckpointManager | None, MetricsLogger]:
        checkpoints = (
            CheckpointManager(
                run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, data_dir=cfg.data.dir
            )
            if cfg.checkpoint.enabled
            else None
        )
        if info.is_main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                dump_config(cfg, run_dir / CONFIG_FILE)
            except OSError as err:
                if out_of_space(err):
                    raise no_space(run_dir) from None
                raise
            trim_records(run_dir, start if resumed else 0, log=print_line)
        memory_source = MEMORY_CUDA if info.device.type == "cuda" else MEMORY_MAXRSS
        logger = MetricsLogger(
            run_dir, info.rank, memory_source=memory_source, purge_step=start + 1
        )
        return checkpoints, logger

    return agree(open_all, info.device)
