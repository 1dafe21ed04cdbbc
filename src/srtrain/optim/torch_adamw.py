"""torch's AdamW (fused on CUDA) behind the trainer's optimizer interface: the baseline run.

Its states are ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype (FP32 with the FP32
master weights), rounded to nearest; it counts no stalls and has no resets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from srtrain.optim.shards import LocalShards, local_shard

# what a checkpoint records as the state format of every parameter: torch's own state
# layout, which no SRAdamW format loads from
STATE_FORMAT = "torch_adamw"


class TorchAdamW(LocalShards, torch.optim.AdamW):
    """``torch.optim.AdamW`` with ``fused=True`` for CUDA parameters (the default
    multi-tensor path elsewhere), plus what the trainer asks of an optimizer."""

    counts_stalls = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("TorchAdamW got no parameters")
        first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=local_shard(first).device.type == "cuda" or None,
        )
        for group in self.param_groups:
            group.update(m_format=STATE_FORMAT, v_format=STATE_FORMAT, block_size=0)

    @property
    def implementation(self) -> str:
        """ "fused" or "foreach": the torch kernels that run the step."""
        return "fused" if self.defaults["fused"] else "foreach"

    def state_bytes(self) -> int:
        """Bytes of ``exp_avg`` and ``exp_avg_sq`` held on this rank."""
        return sum(
            local_shard(value).numel() * value.element_size()
            for state in self.state.values()
            for key, value in state.items()
            if key in ("exp_avg", "exp_avg_sq")
        )

    def init_state(self) -> None:
        """The zero state torch creates at the first step, for a checkpoint to load into."""
        fused = self.defaults["fused"]
        for p in self._params():
            if self.state[p]:
                continue
            device = p.device if fused else torch.device("cpu")
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }

    def prepare_step(self) -> None:
        """Nothing to stage ahead of the step."""
