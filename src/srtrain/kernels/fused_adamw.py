"""Device code of the fused AdamW step: one tile read once (param, grad, m, v) and written once.

:func:`adamw_tile` computes :func:`srtrain.numerics.adamw.adamw_step_reference` bit for
bit on a [TB, BS] tile. Scaled formats lay tiles out as ``TB`` block-scale blocks of
``BS`` elements along each row (:func:`tile_coords`); unscaled shards are one flat row
(:func:`flat_coords`), so element offsets are constants from the tile's start and the
global index words come from 32-bit adds. The launch lives in
:mod:`srtrain.kernels.multi_adamw`.
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
    round_bf16,
    round_bits,
)
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
def pow2(k):
    """2**k as float32 for int32 ``k`` in the normal range."""
    return ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def flat_coords(tile, numel, TB: tl.constexpr, BS: tl.constexpr, ALIGNED: tl.constexpr):
    """Start (int64), element offsets from the start and mask of tile ``tile`` of a flat shard.

    ``ALIGNED`` promises that ``numel`` is a multiple of 16, so masks hold over 16-element
    runs and loads can be vectorised.
    """
    start = tile.to(tl.int64) * (TB * BS)
    offs = tl.arange(0, TB)[:, None] * BS + tl.arange(0, BS)[None, :]
    remaining = tl.minimum(numel - start, TB * BS).to(tl.int32)
    if ALIGNED:
        remaining = tl.multiple_of(remaining, 16)
    return start, offs, offs < remaining


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
        if BITS == 8:  # E4M3 codes convert exactly in hardware; the scale is a power of two
            x = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * pow2(k)
        else:
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
        # one reduction gives both the largest magnitude and whether any value is NaN/±Inf
        top = tl.max(tl.where(valid, u & 0x7FFFFFFF, 0), axis=1)[:, None]
        bad = top >= 0x7F800000
        k = block_scale_exp(top.to(tl.float32, bitcast=True), P, EMAX, MAXF, KMIN, KMAX)
        r = round_bits(u, k, rand, P, EMIN, EMAX, MAXF, SIGNED, STOCHASTIC)
        if KEEP_POSITIVE:
            smallest = (k + (EMIN - P + 127)).to(tl.uint32) << 23
            r = tl.where((r == 0) & (u > 0) & (u < 0x7F800000), smallest, r)
        if BITS == 8:  # r / 2**k is an exact E4M3 value: the hardware conversion is exact
            scaled = r.to(tl.float32, bitcast=True) * pow2(-k)
            code = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)
        else:
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
    p_ptr, g_ptr, m_codes, m_scales, v_codes, v_scales,
    b, bmask, row, col0, valid, elem, cols, lo, hi,
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
    """One AdamW step on one [TB, BS] tile at element offsets ``elem`` (global index words
    ``lo``, ``hi``); returns two packed count words per element (uint32): m stalled +
    v stalled << 16, and param changed + non-finite grad << 16."""
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

    h = element_hash(key0, lo)
    m_stored = store_state(m_new, m_codes, m_scales, b, bmask, elem, row, col0, valid, cols,
                           draw_from(h, km1, hi), TB, BS, M_KIND, M_P, M_EMIN, M_EMAX,
                           M_MAXF, M_SIGNED, M_BITS, M_KMIN, M_KMAX, M_SR, False)
    v_stored = store_state(v_new, v_codes, v_scales, b, bmask, elem, row, col0, valid, cols,
                           draw_from(h, kv1, hi), TB, BS, V_KIND, V_P, V_EMIN, V_EMAX,
                           V_MAXF, V_SIGNED, V_BITS, V_KMIN, V_KMAX, V_SR, True)
    if P_BF16:
        r = round_bf16(p_new.to(tl.uint32, bitcast=True), draw_from(h, kp1, hi), P_SR)
        tl.store(p_ptr + elem, (r >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
        p_stored = r.to(tl.float32, bitcast=True)
    else:
        tl.store(p_ptr + elem, p_new, mask=valid)
        p_stored = p_new

    g_bits = g.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    mv = (valid & (m_stored == m_old)).to(tl.uint32) | (
        (valid & (v_stored == v_old)).to(tl.uint32) << 16)
    pg = (valid & (p_stored != p_old)).to(tl.uint32) | (
        (valid & (g_bits >= 0x7F800000)).to(tl.uint32) << 16)
    return mv, pg


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_elements() -> int:
    """Elements per tile: large in the interpreter (its cost is per tile)."""
    return 16384 if interpreted() else 1024


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
