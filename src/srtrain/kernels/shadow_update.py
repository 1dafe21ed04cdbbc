"""The sampled FP32 shadow's moment updates for many parameters in one launch.

Computes :func:`srtrain.numerics.adamw.shadow_moments_reference` bit for bit: for each
parameter, the gradient at its sampled elements (flat indices into its contiguous local
gradient) advances the FP32 shadow ``m`` and ``v`` (its first ``n`` elements). A static
table holds each parameter's index, ``m`` and ``v`` addresses, sample size and betas; a
table of each step gives its gradient's address and dtype, uploaded from page-locked memory
so that the step neither waits for the GPU nor for a copy. A step may be gated by a device
scalar, as the spec's ``grad_scale``: a finite gate multiplies the gradients (float32), a
non-finite one (NaN, ±Inf) leaves every shadow as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from srtrain.kernels.triton_numerics import bf16_bits_to_float, interpreted, is_finite
from srtrain.numerics.adamw import check_gate, to_f32

# Elements per program: a sample is a few blocks of a parameter, rarely more than a few
# thousand elements on one rank.
BLOCK = 1024
# Gradient dtypes by their code in the step table: those of SRAdamW's parameters.
GRAD_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _load_grad(address, idx, mask, bf16):
    """The gradient at flat indices ``idx`` of the float32 tensor at ``address``, or of the
    bfloat16 one where ``bf16`` (read by its bits: the interpreter's bfloat16 conversion
    flushes subnormals), as float32."""
    if bf16:
        g = bf16_bits_to_float(tl.load(address.to(tl.pointer_type(tl.int16)) + idx, mask=mask))
    else:
        g = tl.load(address.to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)
    return g


@triton.jit
def shadow_update_kernel(
    static_ptr, floats_ptr, step_ptr, gate_ptr, BLOCK: tl.constexpr, GATED: tl.constexpr
):
    """Program (parameter, chunk): the chunk's ``BLOCK`` sampled elements of that parameter.
    Rows per parameter: ``static_ptr`` (int64) its index, m and v addresses and sample size;
    ``floats_ptr`` (float32) β1, 1-β1, β2, 1-β2; ``step_ptr`` (int64) its gradient's address
    and :data:`GRAD_DTYPES` code. With ``GATED``, the float32 gate at ``gate_ptr``: finite,
    it multiplies the gradient; NaN or ±Inf, the program stores nothing (without, the kernel
    holds no trace of a gate)."""
    entry = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    row = static_ptr + entry * 4
    n = tl.load(row + 3)
    gate = 0.0
    if GATED:
        gate = tl.load(gate_ptr)
        n = tl.where(is_finite(gate), n, 0)
    if start < n:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        idx = tl.load(tl.load(row).to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=0)
        g = _load_grad(tl.load(step_ptr + entry * 2), idx, mask, tl.load(step_ptr + entry * 2 + 1))
        if GATED:  # one float32 product, unfused (enable_fp_fusion=False), as the spec's
            g = g * gate
        scalars = floats_ptr + entry * 4
        beta1 = tl.load(scalars)
        one_minus_beta1 = tl.load(scalars + 1)
        beta2 = tl.load(scalars + 2)
        one_minus_beta2 = tl.load(scalars + 3)
        m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32)) + offs
        v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32)) + offs
        square = g * g
        m = tl.load(m_ptr, mask=mask) * beta1
        v = tl.load(v_ptr, mask=mask) * beta2
        tl.store(m_ptr, m + g * one_minus_beta1, mask=mask)
        tl.store(v_ptr, v + square * one_minus_beta2, mask=mask)


def grad_code(dtype: torch.dtype) -> int:
    """A gradient dtype's code in the step table; a clear error for one the kernel lacks."""
    try:
        return GRAD_DTYPES.index(dtype)
    except ValueError:
        names = ", ".join(str(d).split(".")[-1] for d in GRAD_DTYPES)
        raise ValueError(f"the shadow update takes {names} gradients, got {dtype}") from None


class ShadowUpdate:
    """One launch advancing the FP32 shadows of ``indices`` (each an int64 tensor of flat
    indices into a parameter's local gradient) in ``ms`` and ``vs`` (float32, at least as
    long) with ``betas`` (each parameter's (beta1, beta2)), reading gradients of
    ``grad_dtypes`` (one of :data:`GRAD_DTYPES` a parameter). The tensors must stay alive and
    in place while the update is used; all on one device. It computes
    :func:`~srtrain.numerics.adamw.shadow_moments_reference` bit for bit, gate included."""

    def __init__(
        self,
        indices: Sequence[torch.Tensor],
        ms: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        betas: Sequence[tuple[float, float]],
        grad_dtypes: Sequence[torch.dtype],
    ) -> None:
        n = len(indices)
        if not n or not len(ms) == len(vs) == len(betas) == len(grad_dtypes) == n:
            raise ValueError(
                "ShadowUpdate needs one index, m, v, betas and gradient dtype per parameter (>= 1)"
            )
        for index, m, v in zip(indices, ms, vs, strict=True):
            if index.dtype != torch.int64 or index.dim() != 1 or not index.is_contiguous():
                raise ValueError("shadow indices must be contiguous 1-D int64 tensors")
            for t in (m, v):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() < index.numel():
                    raise ValueError("shadow m and v must be contiguous float32 over the sample")
        codes = [grad_code(dtype) for dtype in grad_dtypes]
        self.device = indices[0].device
        self.sizes = [index.numel() for index in indices]
        self._keep = (list(indices), list(ms), list(vs))
        static = np.array(
            [
                (i.data_ptr(), m.data_ptr(), v.data_ptr(), i.numel())
                for i, m, v in zip(indices, ms, vs, strict=True)
            ],
            dtype=np.uint64,
        ).view(np.int64)
        floats = np.array(
            [(to_f32(b1), to_f32(1.0 - b1), to_f32(b2), to_f32(1.0 - b2)) for b1, b2 in betas],
            dtype=np.float32,
        )
        self._static = torch.from_numpy(static).to(self.device)
        self._floats = torch.from_numpy(floats).to(self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros((n, 2), dtype=torch.int64, pin_memory=cuda)
        self._host[:, 1] = torch.tensor(codes, dtype=torch.int64)
        self._device_table = torch.empty_like(self._host, device=self.device) if cuda else None
        self._copied: torch.cuda.Event | None = None
        self._grid = (n, max(-(-max(self.sizes) // BLOCK), 1), 1)
        self._launchers: dict[tuple[bool, bool], Callable[..., None]] = {}

    def run(self, addresses: np.ndarray, gate: torch.Tensor | None = None) -> None:
        """Advance every shadow with its parameter's local gradient, given by ``addresses``:
        one unsigned 64-bit address a parameter (same order) of a contiguous gradient of the
        dtype given at construction, alive until the launch has run (as the stream orders
        it: a tensor freed after the call is not reused before).

        ``gate`` (a 0-d float32 tensor on the update's device, read by the kernel without a
        host sync; None: ungated) gates every shadow, as the spec's ``grad_scale``: finite,
        it multiplies the gradients (float32); NaN or ±Inf, no shadow changes."""
        if len(addresses) != len(self.sizes):
            raise ValueError(f"the shadow update needs {len(self.sizes)} gradient addresses")
        if gate is not None:
            check_gate(gate)
            if gate.device != self.device:
                raise ValueError(f"the gate is on {gate.device}; the update runs on {self.device}")
        if self._copied is not None:  # the previous step's table has reached the device
            self._copied.synchronize()
        self._host.numpy()[:, 0] = np.asarray(addresses, dtype=np.uint64).view(np.int64)
        step = self._host
        if self._device_table is not None:
            self._device_table.copy_(self._host, non_blocking=True)
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
            step = self._device_table
        args = (self._static, self._floats, step, gate, BLOCK, gate is not None)
        if self.device.type != "cuda" or interpreted():
            shadow_update_kernel[self._grid](*args, enable_fp_fusion=False)
            return
        # the compiled kernel of this gating (and gate alignment) is called directly, without
        # Triton's argument binding and cache lookup
        key = (gate is not None, gate is not None and gate.data_ptr() % 16 == 0)
        launcher = self._launchers.get(key)
        if launcher is None:
            compiled = shadow_update_kernel.warmup(*args, grid=self._grid, enable_fp_fusion=False)
            launcher = self._launchers[key] = compiled[self._grid]
        launcher(*args)
