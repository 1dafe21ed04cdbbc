"""What the trainer asks of any optimizer over FSDP2 shards: parameter order and local sizes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class LocalShards:
    """Mixin for a ``torch.optim.Optimizer``: its parameters in group order, and the
    element count of each one's local shard (what stall counts are measured over)."""

    param_groups: list[dict]

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def local_numels(self) -> list[int]:
        """Elements of each parameter's local shard, in parameter order."""
        return [local_shard(p).numel() for p in self._params()]
