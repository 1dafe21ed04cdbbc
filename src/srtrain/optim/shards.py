"""What the trainer asks of any optimizer over FSDP2 shards: parameter order, local sizes,
and optimizer states gathered in full."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


# Dtypes gloo cannot all-gather, and one of the same width that it moves bit for bit.
_GATHER_AS = {torch.int16: torch.bfloat16}


def full_state(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an optimizer state on every rank, bit for bit (a plain tensor as it
    is). Unlike ``DTensor.full_tensor()`` this works for every state dtype on gloo too: int16
    (SRAdamW's BF16 codes), which gloo cannot all-gather, travels as bfloat16 bits."""
    if not isinstance(t, DTensor):
        return t
    carrier = _GATHER_AS.get(t.dtype)
    if carrier is None:
        return t.full_tensor()
    moved = DTensor.from_local(
        t.to_local().view(carrier),
        t.device_mesh,
        t.placements,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )
    return moved.full_tensor().view(t.dtype)


class LocalShards:
    """Mixin for a ``torch.optim.Optimizer``: its parameters in group order, and the
    element count of each one's local shard (what stall counts are measured over)."""

    param_groups: list[dict]

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def local_numels(self) -> list[int]:
        """Elements of each parameter's local shard, in parameter order."""
        return [local_shard(p).numel() for p in self._params()]
