"""Fused AdamW over one shard: one pass reads param, grad, m and v and writes them back.

The kernel computes :func:`srtrain.numerics.adamw.adamw_step_reference` bit for bit.
Work is laid out as blocks of ``BS`` elements along each row (the block-scale
blocks of scaled formats; plain tiles otherwise), ``TB`` blocks per tile; a few
programs per multiprocessor loop over the tiles and keep their counts in
registers until the end. Per-shard counts (m stalled, v stalled, params changed,
non-finite grads) are added atomically to a device buffer, so the step never waits
on the host.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from srtrain.kernels.triton_numerics import (
    bf16_bits_to_float,
    block_scale_exp,
    decode_grid,
    draw_from,
    element_hash,
    encode_grid,
    format_constexprs,
    round_bf16,
    round_bits,
)
from srtrain.numerics.adamw import AdamWScalars, RoundingPlan, check_step_inputs
from srtrain.numerics.formats import Format, row_layout
from srtrain.numerics.rounding import StoredState

UNSCALED_TILE_WIDTH = 256


@triton.jit
def tile_coords(tile, cols, blocks_per_row, nblocks, TB: tl.constexpr, BS: tl.constexpr):
    """Block ids, row, first column and element offsets of tile ``tile`` (a [TB, BS] grid)."""
    b = tile * TB + tl.arange(0, TB)[:, None]
    bmask = b < nblocks
    row = b // blocks_per_row
    col0 = (b % blocks_per_row) * BS
    col = col0 + tl.arange(0, BS)[None, :]
    valid = bmask & (col < cols)
    elem = row.to(tl.int64) * cols + col
    return b, bmask, row, col0, valid, elem


@triton.jit
def load_state(codes_ptr, scales_ptr, b, bmask, elem, row, col0, valid, cols,
               TB: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr, P: tl.constexpr,
               EMIN: tl.constexpr, SIGNED: tl.constexpr, BITS: tl.constexpr,
               KMIN: tl.constexpr, KMAX: tl.constexpr):
    """float32 values of a stored state on a [TB, BS] tile (0 where not valid)."""
    if KIND == 0:
        x = tl.load(codes_ptr + elem, mask=valid, other=0.0)
    elif KIND == 1:
        x = bf16_bits_to_float(tl.load(codes_ptr + elem, mask=valid, other=0))
    else:
        scale_byte = tl.load(scales_ptr + b, mask=bmask, other=127).to(tl.int32)
        k = tl.minimum(tl.maximum(scale_byte - 127, KMIN), KMAX)
        if BITS == 8:
            code = tl.load(codes_ptr + elem, mask=valid, other=0).to(tl.uint32)
        else:
            half = tl.arange(0, BS // 2)[None, :]
            byte_index = row.to(tl.int64) * ((cols + 1) // 2) + col0 // 2 + half
            byte_mask = bmask & (col0 + 2 * half < cols)
            byte = tl.load(codes_ptr + byte_index, mask=byte_mask, other=0).to(tl.uint32)
            code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (TB, BS))
        x = decode_grid(code, k, P, EMIN, SIGNED, BITS)
        x = tl.where(scale_byte == 255, float("nan"), x)
        x = tl.where(valid, x, 0.0)
    return x


@triton.jit
def store_state(x, codes_ptr, scales_ptr, b, bmask, elem, row, col0, valid, cols, rand,
                TB: tl.constexpr, BS: tl.constexpr, KIND: tl.constexpr, P: tl.constexpr,
                EMIN: tl.constexpr, EMAX: tl.constexpr, MAXF: tl.constexpr,
                SIGNED: tl.constexpr, BITS: tl.constexpr, KMIN: tl.constexpr,
                KMAX: tl.constexpr, STOCHASTIC: tl.constexpr, KEEP_POSITIVE: tl.constexpr):
    """Round ``x`` into the state's format, store it, and return the stored values."""
    if KIND == 0:
        tl.store(codes_ptr + elem, x, mask=valid)
        stored = x
    elif KIND == 1:
        r = round_bf16(x.to(tl.uint32, bitcast=True), rand, STOCHASTIC)
        tl.store(codes_ptr + elem, (r >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
        stored = r.to(tl.float32, bitcast=True)
    else:
        u = x.to(tl.uint32, bitcast=True)
        finite = (u & 0x7FFFFFFF) < 0x7F800000
        absmax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)[:, None]
        bad = tl.max((~finite & valid).to(tl.int32), axis=1)[:, None] > 0
        k = block_scale_exp(absmax, P, EMAX, MAXF, KMIN, KMAX)
        r = round_bits(u, k, rand, P, EMIN, EMAX, MAXF, SIGNED, STOCHASTIC)
        if KEEP_POSITIVE:
            smallest = (k + (EMIN - P + 127)).to(tl.uint32) << 23
            r = tl.where((r == 0) & (u > 0) & (u < 0x7F800000), smallest, r)
        code = encode_grid(r, k, P, EMIN, SIGNED, BITS)
        code = tl.where(valid & ~bad, code, 0)
        tl.store(scales_ptr + b, tl.where(bad, 255, k + 127).to(tl.uint8), mask=bmask)
        if BITS == 8:
            tl.store(codes_ptr + elem, code.to(tl.uint8), mask=valid)
        else:
            even, odd = tl.split(tl.reshape(code, (TB, BS // 2, 2)))
            half = tl.arange(0, BS // 2)[None, :]
            byte_index = row.to(tl.int64) * ((cols + 1) // 2) + col0 // 2 + half
            byte_mask = bmask & (col0 + 2 * half < cols)
            tl.store(codes_ptr + byte_index, (even | (odd << 4)).to(tl.uint8), mask=byte_mask)
        stored = tl.where(bad, float("nan"), r.to(tl.float32, bitcast=True))
    return stored


@triton.jit
def adamw_tile(
    p_ptr, g_ptr, m_codes, m_scales, v_codes, v_scales, tile,
    cols, blocks_per_row, nblocks, offset,
    beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay,
    key0, km1, kv1, kp1,
    TB: tl.constexpr, BS: tl.constexpr,
    P_BF16: tl.constexpr, G_BF16: tl.constexpr, P_SR: tl.constexpr,
    M_SR: tl.constexpr, V_SR: tl.constexpr,
    M_KIND: tl.constexpr, M_P: tl.constexpr, M_EMIN: tl.constexpr, M_EMAX: tl.constexpr,
    M_MAXF: tl.constexpr, M_SIGNED: tl.constexpr, M_BITS: tl.constexpr,
    M_KMIN: tl.constexpr, M_KMAX: tl.constexpr,
    V_KIND: tl.constexpr, V_P: tl.constexpr, V_EMIN: tl.constexpr, V_EMAX: tl.constexpr,
    V_MAXF: tl.constexpr, V_SIGNED: tl.constexpr, V_BITS: tl.constexpr,
    V_KMIN: tl.constexpr, V_KMAX: tl.constexpr,
):
    """One AdamW step on one [TB, BS] tile of a shard; its four count masks (int32)."""
    b, bmask, row, col0, valid, elem = tile_coords(tile, cols, blocks_per_row, nblocks, TB, BS)
    index = offset.to(tl.int64) + elem

    if P_BF16:
        p_old = bf16_bits_to_float(tl.load(p_ptr + elem, mask=valid, other=0))
    else:
        p_old = tl.load(p_ptr + elem, mask=valid, other=0.0)
    if G_BF16:
        g = bf16_bits_to_float(tl.load(g_ptr + elem, mask=valid, other=0))
    else:
        g = tl.load(g_ptr + elem, mask=valid, other=0.0)
    m_old = load_state(m_codes, m_scales, b, bmask, elem, row, col0, valid, cols, TB, BS,
                       M_KIND, M_P, M_EMIN, M_SIGNED, M_BITS, M_KMIN, M_KMAX)
    v_old = load_state(v_codes, v_scales, b, bmask, elem, row, col0, valid, cols, TB, BS,
                       V_KIND, V_P, V_EMIN, V_SIGNED, V_BITS, V_KMIN, V_KMAX)

    m_new = m_old * beta1 + g * one_minus_beta1
    v_new = v_old * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v_new) * inv_bc2_sqrt + eps
    p_new = p_old * decay - tl.math.div_rn(m_new, denom) * step_size

    h = element_hash(key0, index)
    m_stored = store_state(m_new, m_codes, m_scales, b, bmask, elem, row, col0, valid, cols,
                           draw_from(h, km1, index), TB, BS, M_KIND, M_P, M_EMIN, M_EMAX,
                           M_MAXF, M_SIGNED, M_BITS, M_KMIN, M_KMAX, M_SR, False)
    v_stored = store_state(v_new, v_codes, v_scales, b, bmask, elem, row, col0, valid, cols,
                           draw_from(h, kv1, index), TB, BS, V_KIND, V_P, V_EMIN, V_EMAX,
                           V_MAXF, V_SIGNED, V_BITS, V_KMIN, V_KMAX, V_SR, True)
    if P_BF16:
        r = round_bf16(p_new.to(tl.uint32, bitcast=True), draw_from(h, kp1, index), P_SR)
        tl.store(p_ptr + elem, (r >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
        p_stored = r.to(tl.float32, bitcast=True)
    else:
        tl.store(p_ptr + elem, p_new, mask=valid)
        p_stored = p_new

    g_bits = g.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return ((valid & (m_stored == m_old)).to(tl.int32),
            (valid & (v_stored == v_old)).to(tl.int32),
            (valid & (p_stored != p_old)).to(tl.int32),
            (valid & (g_bits >= 0x7F800000)).to(tl.int32))


@triton.jit(do_not_specialize=["offset", "k0", "km1", "kv1", "kp1"])
def fused_adamw_kernel(
    p_ptr, g_ptr, m_codes, m_scales, v_codes, v_scales, counts_ptr,
    cols, blocks_per_row, nblocks, ntiles, offset,
    beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay,
    k0, km1, kv1, kp1,
    TB: tl.constexpr, BS: tl.constexpr,
    P_BF16: tl.constexpr, G_BF16: tl.constexpr, P_SR: tl.constexpr,
    M_SR: tl.constexpr, V_SR: tl.constexpr,
    M_KIND: tl.constexpr, M_P: tl.constexpr, M_EMIN: tl.constexpr, M_EMAX: tl.constexpr,
    M_MAXF: tl.constexpr, M_SIGNED: tl.constexpr, M_BITS: tl.constexpr,
    M_KMIN: tl.constexpr, M_KMAX: tl.constexpr,
    V_KIND: tl.constexpr, V_P: tl.constexpr, V_EMIN: tl.constexpr, V_EMAX: tl.constexpr,
    V_MAXF: tl.constexpr, V_SIGNED: tl.constexpr, V_BITS: tl.constexpr,
    V_KMIN: tl.constexpr, V_KMAX: tl.constexpr,
):
    """One AdamW step over a shard: each program loops over tiles, counting in registers."""
    m_stalled = tl.zeros((TB, BS), tl.int32)
    v_stalled = tl.zeros((TB, BS), tl.int32)
    changed = tl.zeros((TB, BS), tl.int32)
    nonfinite = tl.zeros((TB, BS), tl.int32)
    for tile in range(tl.program_id(0), ntiles, tl.num_programs(0)):
        c_m, c_v, c_p, c_g = adamw_tile(
            p_ptr, g_ptr, m_codes, m_scales, v_codes, v_scales, tile,
            cols, blocks_per_row, nblocks, offset,
            beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay,
            k0.to(tl.uint32, bitcast=True), km1.to(tl.uint32, bitcast=True),
            kv1.to(tl.uint32, bitcast=True), kp1.to(tl.uint32, bitcast=True),
            TB, BS, P_BF16, G_BF16, P_SR, M_SR, V_SR,
            M_KIND, M_P, M_EMIN, M_EMAX, M_MAXF, M_SIGNED, M_BITS, M_KMIN, M_KMAX,
            V_KIND, V_P, V_EMIN, V_EMAX, V_MAXF, V_SIGNED, V_BITS, V_KMIN, V_KMAX)
        m_stalled += c_m
        v_stalled += c_v
        changed += c_p
        nonfinite += c_g
    tl.atomic_add(counts_ptr + 0, tl.sum(tl.sum(m_stalled.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(tl.sum(v_stalled.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(counts_ptr + 2, tl.sum(tl.sum(changed.to(tl.int64), axis=1), axis=0))
    tl.atomic_add(counts_ptr + 3, tl.sum(tl.sum(nonfinite.to(tl.int64), axis=1), axis=0))


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_elements() -> int:
    """Elements per tile: large in the interpreter (its cost is per tile)."""
    return 16384 if interpreted() else 1024


def num_programs(ntiles: int, device: torch.device, per_sm: int = 4) -> int:
    """Programs of a persistent launch: a few per multiprocessor, never more than tiles."""
    if interpreted() or device.type != "cuda":
        return max(1, min(ntiles, 8))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(ntiles, per_sm * sms))


def signed32(word: int) -> int:
    """A 32-bit key word as a signed int32 kernel argument."""
    return word - (1 << 32) if word >= 1 << 31 else word


def tile_layout(shape: tuple[int, ...], fmts: tuple[Format, ...], block_size: int):
    """(cols, blocks_per_row, nblocks, BS) of a shard: scale blocks, or flat tiles."""
    numel = 1
    for d in shape:
        numel *= d
    if any(f.scaled for f in fmts):
        rows, cols = row_layout(shape)
        bs = block_size
    else:
        rows, cols = 1, numel
        bs = UNSCALED_TILE_WIDTH
    blocks_per_row = -(-cols // bs) if cols else 0
    return cols, blocks_per_row, rows * blocks_per_row, bs


def int_view(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as int16 bits (exact in the interpreter too)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def scales_or_codes(state: StoredState) -> torch.Tensor:
    return state.scales if state.scales is not None else state.codes


def fused_adamw_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: StoredState,
    v: StoredState,
    scalars: AdamWScalars,
    plan: RoundingPlan,
    offset: int,
    counts: torch.Tensor,
    *,
    tile: int | None = None,
    programs_per_sm: int = 4,
    num_warps: int = 8,
) -> None:
    """Triton twin of :func:`srtrain.numerics.adamw.adamw_step_reference` (same arguments).

    ``tile`` (elements per tile), ``programs_per_sm`` and ``num_warps`` tune the launch only.
    """
    check_step_inputs(param, grad, m, v, counts)
    if m.block_size != v.block_size:
        raise ValueError("m and v must share one block size")
    if param.numel() == 0:
        return
    cols, blocks_per_row, nblocks, bs = tile_layout(tuple(param.shape), (m.fmt, v.fmt),
                                                    m.block_size)
    if not plan.key_m[0] == plan.key_v[0] == plan.key_param[0]:
        raise ValueError("the keys of one step must share their first word (see rng_key)")
    tb = max(1, (tile or tile_elements()) // bs)
    ntiles = triton.cdiv(nblocks, tb)
    fused_adamw_kernel[(num_programs(ntiles, param.device, programs_per_sm),)](
        int_view(param), int_view(grad),
        int_view(m.codes), scales_or_codes(m), int_view(v.codes), scales_or_codes(v),
        counts, cols, blocks_per_row, nblocks, ntiles, offset,
        scalars.beta1, scalars.one_minus_beta1, scalars.beta2, scalars.one_minus_beta2,
        scalars.inv_bias_correction2_sqrt, scalars.eps, scalars.step_size, scalars.decay,
        *(signed32(w) for w in (plan.key_m[0], plan.key_m[1], plan.key_v[1],
                                plan.key_param[1])),
        TB=tb, BS=bs,
        P_BF16=param.dtype == torch.bfloat16, G_BF16=grad.dtype == torch.bfloat16,
        P_SR=plan.param_stochastic, M_SR=plan.m_stochastic, V_SR=plan.v_stochastic,
        **format_constexprs("M_", m.fmt), **format_constexprs("V_", v.fmt),
        num_warps=num_warps, enable_fp_fusion=False,
    )

