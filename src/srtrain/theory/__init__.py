"""Stall theory of low-precision Adam states.

- :mod:`srtrain.theory.plain`: each element's grid at its own magnitude (ρ̂, stall
  probabilities of ``m`` and ``v``, the startup window, reset periods);
- :mod:`srtrain.theory.blocks`: block-scaled formats, each element on its block's grid
  (the model the trainer's predictions and the study use);
- :mod:`srtrain.theory.common`: the validation and quadrature both share;
- ``python -m srtrain.theory`` prints both models for every format.
"""

from srtrain.theory.blocks import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_SPREAD,
    block_stall_at_age,
    block_stall_probability,
    relative_step,
)
from srtrain.theory.common import DEFAULT_BETAS, MOMENTS, ROUNDINGS
from srtrain.theory.plain import (
    DEFAULT_TOLERANCE,
    p_stall_at_age,
    p_stall_m_nearest,
    p_stall_m_stochastic,
    p_stall_nearest,
    p_stall_stochastic,
    reset_period,
    rho_hat,
    stall_probability,
)

__all__ = [
    "DEFAULT_BETAS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_SPREAD",
    "DEFAULT_TOLERANCE",
    "MOMENTS",
    "ROUNDINGS",
    "block_stall_at_age",
    "block_stall_probability",
    "p_stall_at_age",
    "p_stall_m_nearest",
    "p_stall_m_stochastic",
    "p_stall_nearest",
    "p_stall_stochastic",
    "relative_step",
    "reset_period",
    "rho_hat",
    "stall_probability",
]
