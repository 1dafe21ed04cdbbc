"""The optimizer step inside backward: each FSDP2 unit is stepped as soon as its gradients
are reduce-scattered, and its gradients are freed at once.

So the sharded gradients of the whole model are never held together: at most those of the
units in flight. Global-norm clipping needs every gradient first, so here the gradients are
clipped by the previous step's global norm (``min(1, max_norm / (norm + 1e-6))``, the
coefficient :func:`srtrain.parallel.clip_grad_norm_` applies), the norm being summed unit by
unit as the units arrive; the first step of a run that knows no previous norm is not clipped.
A unit whose gradient is non-finite (on any rank) is not updated: its parameters, states
and step counters stay as they were, and the step reports it.

Each unit costs one all-reduce of one float over the shard group (every rank must agree
whether the unit is finite), queued on FSDP's reduce stream behind the unit's
reduce-scatter, and the fused step's launches over the unit's shards; nothing waits for
the GPU until :meth:`StepInBackward.finish`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from srtrain.optim.shards import local_shard
from srtrain.optim.sradamw import SRAdamW
from srtrain.parallel import is_sharded, sum_of_squares


@dataclass
class BackwardStep:
    """What one step inside backward did: the global gradient norm before clipping (0-d
    float32 on the device; non-finite when a unit's gradient is), the coefficient the step
    clipped by, and the units skipped for a non-finite gradient (their indices among the
    units). The next step clips by the norm over the finite units."""

    grad_norm: torch.Tensor
    clip_coefficient: float
    skipped_units: list[int]


class StepInBackward:
    """Steps ``optimizer`` unit by unit inside each backward pass.

    ``units``: the parameters of each FSDP2 unit (:func:`srtrain.parallel.fsdp_units`), which
    together hold every parameter of ``optimizer`` exactly once; ``max_norm``: the clipping
    norm (``inf``: none); ``group``: the ranks sharing a replica's shards (sums of squared
    sharded gradients are reduced over it; None on one process).

    Per step: :meth:`begin` before backward, the backward itself (FSDP2 calls the hooks
    registered here once per parameter after assigning its sharded gradient; a unit is
    stepped when its last gradient arrives), then :meth:`finish`. Parameters whose gradient
    never arrives (unused in the forward) are not stepped; a unit only part of whose
    gradients arrived is stepped in :meth:`finish`.
    """

    def __init__(
        self,
        optimizer: SRAdamW,
        units: Sequence[Sequence[torch.nn.Parameter]],
        max_norm: float,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        if not isinstance(optimizer, SRAdamW):
            raise TypeError(f"the step inside backward needs SRAdamW, got {type(optimizer)}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (inf: no clipping), got {max_norm}")
        held = {id(p) for group_ in optimizer.param_groups for p in group_["params"]}
        seen: set[int] = set()
        self.units = [list(unit) for unit in units if unit]
        for unit in self.units:
            for p in unit:
                if id(p) not in held:
                    raise ValueError("a unit holds a parameter the optimizer does not")
                if id(p) in seen:
                    raise ValueError("a parameter is in two units")
                seen.add(id(p))
        if seen != held:
            raise ValueError(f"{len(held - seen)} of the optimizer's parameters are in no unit")
        self.optimizer, self.max_norm, self.device = optimizer, max_norm, device
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        count = len(self.units)
        self._gates = torch.ones(count, dtype=torch.float32, device=device)  # read by launches
        self._unit_sq = torch.zeros(count, dtype=torch.float32, device=device)
        self._norm = torch.full((), math.nan, dtype=torch.float32, device=device)  # previous
        self._coefficient = torch.ones((), dtype=torch.float32, device=device)
        self._closed = torch.full((), math.nan, dtype=torch.float32, device=device)  # skip
        self._unit_of = {id(p): u for u, unit in enumerate(self.units) for p in unit}
        self._arrived = [0] * count
        self._stepped = [False] * count
        self._in_step = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._gradient_arrived)
            for unit in self.units
            for p in unit
        ]

    # ----------------------------------------------------------------------- a step

    def begin(self) -> None:
        """Before backward: the clipping coefficient of this step from the previous norm."""
        if self._in_step:
            raise RuntimeError("begin() twice without finish()")
        self._in_step = True
        self._arrived = [0] * len(self.units)
        self._stepped = [False] * len(self.units)
        self._unit_sq.zero_()
        known = torch.isfinite(self._norm)
        scale = torch.clamp(self.max_norm / (self._norm + 1e-6), max=1.0)
        self._coefficient.copy_(torch.where(known, scale, torch.ones_like(scale)))

    def _gradient_arrived(self, param: torch.Tensor) -> None:
        if not self._in_step:
            raise RuntimeError(
                "a gradient arrived outside begin()/finish() with optim.step_in_backward"
            )
        u = self._unit_of[id(param)]
        if self._stepped[u]:
            raise RuntimeError(
                "a unit's gradient arrived after the unit was stepped (a module used twice in "
                "one forward); optim.step_in_backward needs each unit reduced once a step"
            )
        self._arrived[u] += 1
        if self._arrived[u] == len(self.units[u]):
            self._step_unit(u)

    @torch.no_grad()
    def _step_unit(self, u: int) -> None:
        """Clip and step unit ``u``'s parameters that have gradients, then free those."""
        self._stepped[u] = True
        params = [p for p in self.units[u] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        locals_ = [local_shard(g) for g in grads]
        sharded = [t for g, t in zip(grads, locals_, strict=True) if is_sharded(g)]
        replicated = [t for g, t in zip(grads, locals_, strict=True) if not is_sharded(g)]
        squares = self._unit_sq[u]  # a view: the unit's sum is written in place
        squares.copy_(sum_of_squares(sharded, self.device))
        if self.group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        if replicated:  # counted once, not reduced
            squares += sum_of_squares(replicated, self.device)
        gate = self._gates[u]
        torch.where(torch.isfinite(squares), self._coefficient, self._closed, out=gate)
        self.optimizer.step_unit(params, gate)
        cuda = self.device.type == "cuda"
        for p, local in zip(params, locals_, strict=True):
            if cuda:  # the launches read it on this stream after the allocator frees it
                local.record_stream(torch.cuda.current_stream(self.device))
            p.grad = None

    @torch.no_grad()
    def finish(self) -> BackwardStep:
        """After backward: step the units whose gradients arrived in part, give the skipped
        units their counters back and end the optimizer's step; this step's norm becomes the
        next step's clipping norm. Waits for the GPU once (which units were skipped)."""
        if not self._in_step:
            raise RuntimeError("finish() without begin()")
        for u, unit in enumerate(self.units):
            if not self._stepped[u] and any(p.grad is not None for p in unit):
                self._step_unit(u)
        self._in_step = False
        # the one wait for the GPU: each unit's sum and this step's coefficient together
        *sums, coefficient = torch.cat([self._unit_sq, self._coefficient.reshape(1)]).tolist()
        skipped = [u for u, s in enumerate(sums) if not math.isfinite(s) and self._stepped[u]]
        self.optimizer.end_unit_steps([self.units[u] for u in skipped])
        finite = torch.isfinite(self._unit_sq)
        self._norm.copy_(torch.where(finite, self._unit_sq, 0.0).sum().sqrt())
        return BackwardStep(self._unit_sq.sum().sqrt(), coefficient, skipped)

    # ------------------------------------------------------------------- checkpoints

    @property
    def previous_norm(self) -> float:
        """The norm the next step clips by (NaN before the first step)."""
        return float(self._norm)

    @previous_norm.setter
    def previous_norm(self, norm: float) -> None:
        self._norm.fill_(norm)

    def remove(self) -> None:
        """Unregister the hooks (the parameters are then stepped by ``optimizer.step()``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
