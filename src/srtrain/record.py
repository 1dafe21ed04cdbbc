"""The run's history as training writes it: losses, validation values, metrics.jsonl.

:class:`History` keeps each step's loss on the device until the next log step (one
all-reduce then for all of them), the validation losses of steps whose records are still
pending, and writes the records: ``metrics.jsonl`` on rank 0 (appended once per log step,
after ``check()`` confirms the run still owns its directory) and TensorBoard through the
:class:`~srtrain.metrics.MetricsLogger`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from srtrain.console import StepProgress
from srtrain.metrics import MetricsLogger, append_records


class History:
    """Pending losses and validation values of a run, and their records."""

    def __init__(
        self,
        logger: MetricsLogger,
        run_dir: Path,
        is_main: bool,
        check: Callable[[], None],
        total_steps: int,
    ) -> None:
        self.logger, self.run_dir, self.is_main = logger, run_dir, is_main
        self.check, self.total_steps = check, total_steps
        self._losses: list[torch.Tensor] = []
        self._steps: list[int] = []
        self._val_pending: dict[int, dict[str, float]] = {}

    def add_loss(self, step: int, loss: torch.Tensor) -> None:
        """This rank's mean loss of ``step``, kept on its device."""
        self._losses.append(loss)
        self._steps.append(step)

    def take_losses(self) -> list[dict]:
        """The pending steps' records (``step`` and the mean loss over all ranks), in order;
        every rank calls it together (one all-reduce)."""
        values = torch.stack(self._losses)
        dist.all_reduce(values)
        losses = (values / dist.get_world_size()).tolist()
        records = [{"step": s, "loss": v} for s, v in zip(self._steps, losses, strict=True)]
        self._losses, self._steps = [], []
        return records

    def add_validation(
        self, step: int, scalars: dict[str, float], fields: dict[str, float]
    ) -> None:
        """Validation losses of ``step``: ``scalars`` (TensorBoard tag → value) are logged
        now, ``fields`` (record key → value) go into the step's record when it is written."""
        self.check()
        self._val_pending[step] = fields
        self.logger.log_step(step, scalars, progress=StepProgress(self.total_steps))

    def write(self, records: list[dict]) -> None:
        """Append ``records`` (with their validation losses) to metrics.jsonl on rank 0."""
        for record in records:
            record.update(self._val_pending.pop(record["step"], {}))
        self.check()
        if self.is_main:
            append_records(self.run_dir, records)
