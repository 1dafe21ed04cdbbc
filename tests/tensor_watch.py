"""A dispatch mode that records the largest plain tensor any op returns (memory checks)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestOutput(TorchDispatchMode):
    """Records in ``numel`` the most elements of any plain (non-subclass) tensor an op
    returns while the mode is active; views count as their own size."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor:
                self.numel = max(self.numel, t.numel())
        return out
