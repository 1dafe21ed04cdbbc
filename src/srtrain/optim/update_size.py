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


class _Batch:
    """The sampled rows of the members whose rows have one length, read in one copy: each
    sampled row's member and layer group (on the device), and each member's row count."""

    def __init__(self, members: list[tuple[torch.Tensor, int, int, int]], cols: int, device):
        self.members = members  # (parameter, member number, first sampled local row, rows)
        self.cols = cols
        counts = [rows for *_, rows in members]
        numbers = np.repeat(np.array([m for _, m, _, _ in members], dtype=np.int64), counts)
        self.row_member = torch.from_numpy(numbers).to(device)

    def read(self) -> torch.Tensor:
        """The members' sampled rows now, as one [rows, cols] float32 tensor."""
        return torch.cat(
            [
                local_shard(p).detach().reshape(-1, self.cols)[first::SAMPLE_EVERY]
                for p, _, first, _ in self.members
            ]
        ).float()


class UpdateSizes:
    """Measures the applied update's size per layer group on chosen steps.

    ``params``: the optimizer's parameters in order (plain tensors or DTensor shards);
    ``labels``: each one's layer group (:data:`srtrain.param_groups.GROUPS`); ``offsets``: the
    global flat index of each local shard's first element. Call :meth:`before_step` and
    :meth:`after_step` around ``optimizer.step()`` on a step to measure, and :meth:`take`
    on every rank of ``group`` to collect the measured steps. A measured step costs a few
    launches per row length, whatever the number of parameters.
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
        self._members: list[torch.Tensor] = []  # parameters with sampled rows, in order
        groups, elements, by_cols = [], [], {}
        for p, label, offset in zip(params, labels, offsets, strict=True):
            if label not in GROUPS:
                raise ValueError(f"UpdateSizes: group {label!r} is not one of {GROUPS}")
            local = local_shard(p)
            if local.numel() == 0:
                continue
            cols = math.prod(local.shape[1:])
            rows = len(sampled_rows(offset // cols, local.shape[0]))
            if rows:
                first = -(offset // cols) % SAMPLE_EVERY
                member = (p, len(self._members), first, rows)
                by_cols.setdefault((cols, local.device), []).append(member)
                self._members.append(p)
                groups.append(GROUPS.index(label))
                elements.append(rows * cols)
        self._group = np.array(groups, dtype=np.int64)
        self._elements = np.array(elements, dtype=np.float64)
        self._batches = [_Batch(m, cols, dev) for (cols, dev), m in by_cols.items()]
        group_of = torch.from_numpy(self._group)
        self._row_group = [group_of[b.row_member.cpu()].to(self.device) for b in self._batches]
        self._before: list[torch.Tensor] | None = None
        self._pending: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy the sampled rows as they are before the step."""
        self._before = [batch.read() for batch in self._batches]

    @torch.no_grad()
    def after_step(self, step: int, lr_decay: Sequence[tuple[float, float]]) -> None:
        """Record step ``step``'s update; ``lr_decay``: each member parameter's (lr, weight
        decay), in the order of ``params``' members (see :meth:`hyperparameters`)."""
        if self._before is None:
            raise RuntimeError("UpdateSizes.after_step without before_step")
        if len(lr_decay) != len(self._members):
            raise ValueError(
                f"UpdateSizes.after_step: {len(lr_decay)} (lr, weight decay) pairs for "
                f"{len(self._members)} members"
            )
        values = np.array(lr_decay, dtype=np.float64).reshape(-1, 2)
        lr, decay = values[:, 0], values[:, 1]
        measured = lr > 0.0  # a member at lr 0 applies no update to measure
        scalars = np.stack([np.where(measured, lr, 1.0), 1.0 - lr * decay]).astype(np.float32)
        sums = torch.zeros(len(GROUPS), 2, dtype=torch.float64)
        sums[:, 1] = torch.from_numpy(
            np.bincount(self._group, self._elements * measured, minlength=len(GROUPS))
        )
        sums = sums.to(self.device)
        batches = zip(self._batches, self._row_group, self._before, strict=True)
        for batch, row_group, before in batches:
            device = before.device
            lr_kept = torch.from_numpy(scalars).to(device)[:, batch.row_member]
            # each row's |p_after - p_before·kept| over its lr, squared: the rows' sums of
            # squares of the update (one pass over the rows, then per-row float64)
            change = torch.addcmul(batch.read(), before, lr_kept[1, :, None], value=-1.0)
            norms = torch.linalg.vector_norm(change, dim=1).double() / lr_kept[0].double()
            squares = norms.square()
            if not measured.all():
                squares = torch.where(
                    torch.from_numpy(measured).to(device)[batch.row_member], squares, 0.0
                )
            sums[:, 0].index_add_(0, row_group, squares.to(self.device))
        self._before = None
        self._pending[step] = sums

    def hyperparameters(self, optimizer: torch.optim.Optimizer) -> list[tuple[float, float]]:
        """Each member's (lr, weight decay) from ``optimizer``'s parameter groups."""
        of = {
            id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]
        }
        return [of[id(p)] for p in self._members]

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
