"""The AdamW step on one shard with low-precision states: the reference in plain PyTorch.

Arithmetic is float32, one rounding per operation, in this order (the Triton
kernel performs the same operations, so results agree bit for bit)::

    m' = m·β1 + g·(1-β1)
    v' = v·β2 + (g·g)·(1-β2)
    p' = p·(1-lr·wd) - (m' / (sqrt(v') · (1/sqrt(1-β2^age_v)) + eps)) · (lr·r / (1-β1^age_m))

``r`` is the re-warmup factor after a reset (:func:`rewarmup_factor`; 1 otherwise).

The update uses m', v' before they are rounded for storage; the stored states are
then rounded (nearest or stochastic) into their formats, and a BF16 parameter into
BF16. A positive v is never stored as zero (see
:func:`srtrain.numerics.rounding.keep_positive_bits`). m and v share one draw per
element under the states' key: m decides on its top 16 bits and v on its low 16 bits
(see :func:`srtrain.numerics.rounding.split_draw`). The scalar factors are
computed in float64 on the host and rounded once to float32. Square roots are
correctly rounded (torch's float32 ``sqrt`` on CPU is not always).

Counted per call, in the order of the ``COUNT_*`` indices (m first, then v); the first
:data:`NUM_STALL_COUNTS` (the stall counts) on every call, the rest (the health counts)
only on calls with ``health`` (else their entries are left as they were):

- stalled: the stored value did not change (a NaN never equals its old value);
- parameters changed, and non-finite gradient elements;
- underflow: a non-zero proposal (m' or v', before rounding; NaN counts as non-zero) was
  stored as ±0;
- saturated: the stored magnitude is the largest finite one its code can hold: the
  format's largest value, times the block's scale for block-scaled formats (there the
  top code of the block; values past it only exist at the top scale);
- scale changed: blocks whose stored scale byte differs from the one before the step
  (always 0 for unscaled formats, which have no blocks).

Non-finite values are counted as stored, like the stall counts: a NaN or ±Inf element is
neither underflowed nor saturated, nor is any element of a block-scaled block that the
non-finite value turned NaN, and a block turning NaN changes its scale byte.

A step may be *gated* by a device scalar (``grad_scale``, a 0-d float32 tensor): a finite
gate multiplies every gradient element in float32 before anything else (the clipping
coefficient; the non-finite count sees the scaled gradient); a non-finite gate (NaN, ±Inf)
skips the step: parameter, states, scales and counts are left exactly as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from srtrain.numerics.formats import bits_float
from srtrain.numerics.rounding import (
    StoredState,
    bf16_bits,
    bf16_from_bits,
    dequantize,
    draw,
    global_index,
    largest_magnitudes,
    quantize,
    split_draw,
)

COUNT_M_STALLED = 0
COUNT_V_STALLED = 1
COUNT_PARAM_CHANGED = 2
COUNT_NONFINITE_GRAD = 3
NUM_STALL_COUNTS = 4  # counted on every step; the health counts follow
COUNT_M_UNDERFLOW = 4
COUNT_V_UNDERFLOW = 5
COUNT_M_SATURATED = 6
COUNT_V_SATURATED = 7
COUNT_M_SCALE_CHANGED = 8
COUNT_V_SCALE_CHANGED = 9
NUM_COUNTS = 10


def to_f32(x: float) -> float:
    """Round a Python float to the nearest float32 value (ties to even; past the range: ±inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


@dataclass(frozen=True)
class AdamWScalars:
    """The float32 scalars of one AdamW step."""

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bias_correction2_sqrt: float
    eps: float
    step_size: float
    decay: float

    def row(self) -> tuple[float, ...]:
        """The scalars in field order (the fused kernel's table columns)."""
        return (
            self.beta1,
            self.one_minus_beta1,
            self.beta2,
            self.one_minus_beta2,
            self.inv_bias_correction2_sqrt,
            self.eps,
            self.step_size,
            self.decay,
        )

    @classmethod
    def make(
        cls,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        age_m: int,
        age_v: int,
        rewarmup: float = 1.0,
    ) -> AdamWScalars:
        """Scalars for states of ages ``age_m``, ``age_v`` (steps since reset, >= 1);
        ``rewarmup`` in (0, 1] scales the update's step size (not the weight decay)."""
        if age_m < 1 or age_v < 1:
            raise ValueError(f"state ages must be >= 1 at an update, got m={age_m} v={age_v}")
        if not 0.0 < rewarmup <= 1.0:
            raise ValueError(f"rewarmup factor must be in (0, 1], got {rewarmup}")
        exact = (
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            (1.0 - beta2**age_v) ** -0.5,
            eps,
            lr * rewarmup / (1.0 - beta1**age_m),
            1.0 - lr * weight_decay,
        )
        with np.errstate(over="ignore"):  # each rounded as to_f32 rounds it, in one cast
            return cls(*np.array(exact, dtype=np.float64).astype(np.float32).tolist())


def rewarmup_factor(step: int, age_m: int, age_v: int, steps: int) -> float:
    """The step-size factor of an update at optimizer step ``step`` whose states have ages
    ``age_m``, ``age_v``: the learning rate warms up again over ``steps`` steps after a
    reset, linearly in the youngest reset state's age (``min(1, age / steps)``).

    A state whose age equals the step was never reset (the learning-rate schedule's own
    warm-up covers it); ``steps=0`` turns the re-warmup off.
    """
    young = [age for age in (age_m, age_v) if age < step]
    if steps <= 0 or not young:
        return 1.0
    return min(1.0, min(young) / steps)


@dataclass(frozen=True)
class RoundingPlan:
    """Rounding of each stored quantity and the keys of their stochastic draws: m and v
    split one draw under ``key_states``, a BF16 parameter draws under ``key_param``."""

    m_stochastic: bool
    v_stochastic: bool
    param_stochastic: bool
    key_states: tuple[int, int]
    key_param: tuple[int, int]


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root (through float64, exact for float32 inputs)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _mode(stochastic: bool) -> str:
    return "stochastic" if stochastic else "nearest"


def check_step_inputs(
    param: torch.Tensor, grad: torch.Tensor, m: StoredState, v: StoredState, counts: torch.Tensor
) -> None:
    """Raise a clear error when the tensors of one step do not fit together."""
    if param.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"parameters must be float32 or bfloat16, got {param.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"gradients must be float32 or bfloat16, got {grad.dtype}")
    shape = tuple(param.shape)
    if tuple(grad.shape) != shape:
        raise ValueError(f"gradient shape {tuple(grad.shape)} does not match parameter {shape}")
    for name, state in (("m", m), ("v", v)):
        if state.shape != shape:
            raise ValueError(f"state {name} has shape {state.shape}, parameter {shape}")
        tensors = [state.codes] + ([state.scales] if state.scales is not None else [])
        if any(t.device != param.device for t in tensors):
            raise ValueError(
                f"state {name} is on {state.codes.device}, parameter on {param.device}"
            )
    if grad.device != param.device or counts.device != param.device:
        raise ValueError(
            f"gradient ({grad.device}) and counts ({counts.device}) must be on the parameter's "
            f"device ({param.device})"
        )
    if not param.is_contiguous():
        raise ValueError("parameter shards must be contiguous")
    if counts.dtype != torch.int64 or counts.numel() != NUM_COUNTS or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous int64 tensor of {NUM_COUNTS} entries")


def check_gate(grad_scale: torch.Tensor) -> None:
    """Raise unless ``grad_scale`` is a 0-d float32 tensor (a step's gate)."""
    if not isinstance(grad_scale, torch.Tensor):
        raise TypeError(f"a gate must be a 0-d float32 tensor, got {type(grad_scale).__name__}")
    if grad_scale.dtype != torch.float32 or grad_scale.dim() != 0:
        raise ValueError(
            f"a gate must be a 0-d float32 tensor, got {grad_scale.dtype} of shape "
            f"{tuple(grad_scale.shape)}"
        )


def gate_open(grad_scale: torch.Tensor | None) -> bool:
    """Whether a step under gate ``grad_scale`` (None: ungated) updates at all: the gate is
    None or finite (a host sync when it lives on a GPU)."""
    if grad_scale is None:
        return True
    check_gate(grad_scale)
    return bool(torch.isfinite(grad_scale))


def scales_changed(old: StoredState, new: StoredState) -> torch.Tensor:
    """How many blocks' scale bytes differ between two versions of a state (0 unscaled)."""
    if old.scales is None:
        return torch.zeros((), dtype=torch.int64, device=old.codes.device)
    return (old.scales != new.scales).sum()


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: StoredState,
    v: StoredState,
    scalars: AdamWScalars,
    plan: RoundingPlan,
    offset: int,
    counts: torch.Tensor,
    health: bool = True,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Update ``param``, ``m`` and ``v`` in place and add this shard's counts to ``counts``.

    ``offset`` is the global index of the shard's first element in its full
    parameter; ``counts`` is an int64 tensor of :data:`NUM_COUNTS` entries. Without
    ``health`` only the stall counts (the first :data:`NUM_STALL_COUNTS`) are added; the
    results are the same either way. ``grad_scale`` (a 0-d float32 tensor on any device)
    gates the step: finite, it multiplies the gradient in float32 before anything else;
    NaN or ±Inf, the step changes nothing, counts included. None: ungated.
    """
    check_step_inputs(param, grad, m, v, counts)
    if not gate_open(grad_scale) or param.numel() == 0:
        return
    dev = param.device

    def f32(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32, device=dev)

    p_old = param.detach().to(torch.float32)
    g = grad.detach().to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale.to(dev)
    m_old = dequantize(m)
    v_old = dequantize(v)
    m_new = m_old * f32(scalars.beta1) + g * f32(scalars.one_minus_beta1)
    v_new = v_old * f32(scalars.beta2) + (g * g) * f32(scalars.one_minus_beta2)
    denom = sqrt_rn(v_new) * f32(scalars.inv_bias_correction2_sqrt) + f32(scalars.eps)
    p_new = p_old * f32(scalars.decay) - (m_new / denom) * f32(scalars.step_size)

    rand_m = rand_v = None
    if plan.m_stochastic or plan.v_stochastic:
        rand_m, rand_v = split_draw(draw(plan.key_states, global_index(offset, m_new.numel(), dev)))
    m_stored = quantize(m_new, m.fmt, m.block_size, _mode(plan.m_stochastic), rand=rand_m)
    v_stored = quantize(
        v_new, v.fmt, v.block_size, _mode(plan.v_stochastic), keep_positive=True, rand=rand_v
    )
    if param.dtype == torch.bfloat16:
        rand = None
        if plan.param_stochastic:
            rand = draw(plan.key_param, global_index(offset, p_new.numel(), dev))
        bits = bf16_bits(p_new.reshape(-1), plan.param_stochastic, rand)
        p_stored = bits_float(bits).reshape(p_new.shape)
        p_write = bf16_from_bits(bits, p_new.shape)
    else:
        p_stored = p_write = p_new

    m_values, v_values = dequantize(m_stored), dequantize(v_stored)
    step_counts = [
        (m_values == m_old).sum(),
        (v_values == v_old).sum(),
        (p_stored != p_old).sum(),
        (~torch.isfinite(g)).sum(),
    ]
    if health:
        step_counts += [
            ((m_new != 0) & (m_values == 0)).sum(),
            ((v_new != 0) & (v_values == 0)).sum(),
            (m_values.abs() == largest_magnitudes(m_stored)).sum(),
            (v_values.abs() == largest_magnitudes(v_stored)).sum(),
            scales_changed(m, m_stored),
            scales_changed(v, v_stored),
        ]
    counts[: len(step_counts)] += torch.stack(step_counts).to(counts.device, torch.int64)

    with torch.no_grad():
        param.copy_(p_write)
        m.codes.copy_(m_stored.codes)
        v.codes.copy_(v_stored.codes)
        if m.scales is not None:
            m.scales.copy_(m_stored.scales)
        if v.scales is not None:
            v.scales.copy_(v_stored.scales)


def shadow_moments_reference(
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    beta1: float,
    beta2: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Advance FP32 moments in place with gradients of the same lengths (any float dtype,
    taken as float32), each product and sum rounded once to float32:
    ``m = m·β1 + g·(1-β1)``, ``v = v·β2 + (g·g)·(1-β2)``.

    ``grad_scale`` gates the update as it gates :func:`adamw_step_reference`: finite, ``g``
    is the gradient times it (float32); NaN or ±Inf, no moment changes. None: ungated."""
    if not grads or not gate_open(grad_scale):
        return
    if grad_scale is None:
        grads = [g.float() for g in grads]
    else:
        grads = [g.float() * grad_scale.to(g.device) for g in grads]
    squares = torch._foreach_mul(grads, grads)
    scaled = torch._foreach_mul(grads, to_f32(1.0 - beta1))
    torch._foreach_mul_(squares, to_f32(1.0 - beta2))
    torch._foreach_mul_(ms, to_f32(beta1))
    torch._foreach_add_(ms, scaled)
    torch._foreach_mul_(vs, to_f32(beta2))
    torch._foreach_add_(vs, squares)
