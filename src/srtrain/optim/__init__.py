"""Optimizers over low-precision states, and torch's AdamW as the baseline."""

from srtrain.optim.sradamw import SRAdamW
from srtrain.optim.torch_adamw import TorchAdamW

__all__ = ["SRAdamW", "TorchAdamW"]
