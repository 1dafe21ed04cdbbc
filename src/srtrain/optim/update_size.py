"""The size of the update an optimizer step applied, against the learning rate, per layer group.

On a fixed sample of each parameter's rows (every :data:`SAMPLE_EVERY`-th row by its global
row index, so sharding and resumes do not change the sample; a 1-D parameter's elements are
its rows), the step's update is read from the parameter itself::

    u = (p_before · (1 - lr·wd) - p_after) / lr

which is the normalised AdamW update ``r·m̂/(√v̂+ε)`` the step applied (``r``: the re-warmup
factor after a reset), exactly for FP32 parameters and with their stochastic rounding for
BF16 ones. Its root mean square over a group's sampled elements is about 1 right after a
reset (``m̂/√v̂ = ±1`` for every element at age 1) and well below 1 in steady training,
where ``m̂`` averages noisy gradients: the burst a reset causes, and how fast it fades.

Measuring copies the sampled rows before the step (1/64 of the parameters) and keeps two
numbers per group on the device; the sums are reduced over the shard group once, when the
measured steps are taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from srtrain.optim.shards import local_shard
from srtrain.param_groups import GROUPS

SAMPLE_EVERY = 64


def sampled_rows(global_first_row: int, local_rows: int, every: int = SAMPLE_EVERY) -> np.ndarray:
    """Local indices of the rows whose global index is a multiple of ``every``."""
    start = -global_first_row % every
    return np.arange(start, local_rows, every, dtype=np.int64)


class UpdateSizes:
    """Measures the applied update's size per layer group on chosen steps.

    ``params``: the optimizer's parameters in order (plain tensors or DTensor shards);
    ``labels``: each one's layer group (:data:`srtrain.param_groups.GROUPS`); ``offsets``: the
    global flat index of each local shard's first element. Call :meth:`before_step` and
    :meth:`after_step` around ``optimizer.step()`` on a step to measure, and :meth:`take`
    on every rank of ``group`` to collect the measured steps.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        labels: Sequence[str],
        offsets: Sequence[int],
        device: torch.device | str,
    ) -> None:
        if not len(params) == len(labels) == len(offsets):
            raise ValueError(
                f"UpdateSizes: {len(params)} parameters, {len(labels)} labels, "
                f"{len(offsets)} offsets"
            )
        self.device = torch.device(device)
        self._members: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        for p, label, offset in zip(params, labels, offsets, strict=True):
            if label not in GROUPS:
                raise ValueError(f"UpdateSizes: group {label!r} is not one of {GROUPS}")
            local = local_shard(p)
            if local.numel() == 0:
                continue
            cols = math.prod(local.shape[1:])
            rows = sampled_rows(offset // cols, local.shape[0])
            if len(rows):
                index = torch.from_numpy(rows).to(local.device)
                self._members.append((p, GROUPS.index(label), index))
        self._before: list[torch.Tensor] | None = None
        self._pending: dict[int, torch.Tensor] = {}

    def before_step(self) -> None:
        """Copy the sampled rows as they are before the step."""
        self._before = [
            local_shard(p).detach().index_select(0, index).float() for p, _, index in self._members
        ]

    def after_step(self, step: int, lr_decay: Sequence[tuple[float, float]]) -> None:
        """Record step ``step``'s update; ``lr_decay``: each member parameter's (lr, weight
        decay), in the order of ``params``' members (see :meth:`hyperparameters`)."""
        if self._before is None:
            raise RuntimeError("UpdateSizes.after_step without before_step")
        sums = torch.zeros(len(GROUPS), 2, dtype=torch.float64, device=self.device)
        for (p, group, index), before, (lr, decay) in zip(
            self._members, self._before, lr_decay, strict=True
        ):
            if lr <= 0.0:
                continue
            after = local_shard(p).detach().index_select(0, index).float()
            kept = torch.tensor(np.float32(1.0 - lr * decay), device=after.device)
            update = (before * kept - after) / np.float32(lr)
            sums[group, 0] += update.double().square().sum().to(self.device)
            sums[group, 1] += update.numel()
        self._before = None
        self._pending[step] = sums

    def hyperparameters(self, optimizer: torch.optim.Optimizer) -> list[tuple[float, float]]:
        """Each member's (lr, weight decay) from ``optimizer``'s parameter groups."""
        of = {
            id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]
        }
        return [of[id(p)] for p, _, _ in self._members]

    def take(self, group: dist.ProcessGroup | None = None) -> dict[int, dict[str, float]]:
        """The measured steps since the last take: per step, the RMS of the update over all
        sampled elements (``"all"``) and per layer group with elements. Sums run over
        ``group``'s ranks (one model's shards: under HSDP the shard group); every rank of it
        must call, with the same steps measured."""
        if not self._pending:
            return {}
        steps = sorted(self._pending)
        sums = torch.stack([self._pending.pop(s) for s in steps])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        out: dict[int, dict[str, float]] = {}
        for step, rows in zip(steps, sums.tolist(), strict=True):
            sizes = {
                name: math.sqrt(sq / n) for name, (sq, n) in zip(GROUPS, rows, strict=True) if n
            }
            total_sq, total_n = sum(r[0] for r in rows), sum(r[1] for r in rows)
            if total_n:
                sizes["all"] = math.sqrt(total_sq / total_n)
            out[step] = sizes
        return out
