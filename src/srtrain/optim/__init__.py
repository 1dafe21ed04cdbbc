"""Optimizers over low-precision states."""

from srtrain.optim.sradamw import SRAdamW

__all__ = ["SRAdamW"]
