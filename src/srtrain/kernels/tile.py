"""Device code of the fused AdamW step on one tile, read once (param, grad, m, v) and
written once.

:func:`adamw_tile` computes :func:`srtrain.numerics.adamw.adamw_step_reference` bit for
bit on a [TB, BS] tile. A tile of a scaled shard holds ``TB`` block-scale blocks of ``BS``
elements from several narrow rows or one part of a wide row (:func:`row_tile`); unscaled
shards are one flat row (:func:`flat_coords`). Either way element offsets are 32-bit
values from one 64-bit start per tile, and the global index words come from 32-bit adds.
The kernel that walks the tiles lives in :mod:`srtrain.kernels.step_kernel` (its host
launcher in :mod:`srtrain.kernels.launch`, the host geometry in
:mod:`srtrain.kernels.layout`), the state codes in :mod:`srtrain.kernels.state_codes`, the
memory accesses in :mod:`srtrain.kernels.memory`.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from srtrain.kernels.memory import layout_anchor, load_values, store_runs, store_tile
from srtrain.kernels.state_codes import (
    BF16_CODES,
    E4M3_CODES,
    FP4_CODES,
    FP32_CODES,
    block_scale_exp,
    code_value,
    e4m3_code,
    encode_grid,
    fp4_pair_values,
    grid_code,
    pow2,
    scale_factor,
)
from srtrain.kernels.triton_numerics import (
    DRAW_HIGH,
    DRAW_LOW,
    DRAW_WHOLE,
    HARDWARE,
    bf16_bits_to_float,
    draw,
    draw_in_span,
    draw_part,
    round_bf16,
    round_bits,
)


class TileGeometry(NamedTuple):
    """Where a tile's elements lie from its first element, as :func:`shard_tile` gives it:
    element offsets and mask ([TB, BS]), block offsets and mask ([TB, 1]), the offset of each
    block's first FP4 byte ([TB, 1]) and the FP4 byte-pair mask ([TB, BS // 2])."""

    offs: tl.tensor
    valid: tl.tensor
    block_offs: tl.tensor
    bvalid: tl.tensor
    block_bytes: tl.tensor
    pair_valid: tl.tensor


class RowLayout(NamedTuple):
    """A shard's rows as a tile reads them (int32): ``rows`` rows of ``cols`` elements,
    ``2**slot_bits`` blocks of a row a tile row, ``blocks_per_row`` scale blocks and
    ``row_bytes`` FP4 bytes a row (unscaled shards: one row, the rest unused)."""

    rows: tl.tensor
    cols: tl.tensor
    slot_bits: tl.tensor
    blocks_per_row: tl.tensor
    row_bytes: tl.tensor


class TileShape(NamedTuple):
    """A launch's compile-time tile geometry, one argument of the step's device functions:
    element types of the parameter, gradient, m codes and v codes as read (``P_T``,
    ``G_T``, ``MC_T``, ``VC_T``); tiles of ``TB`` blocks of ``BS`` elements, whose
    counts each thread sums over runs of ``RUN`` (:func:`count_sums`); ``FLAT``: unscaled
    states, each shard one row (:func:`flat_coords`); ``ALIGNED``: rows that take the
    vectorised accesses; ``WIDE``: rows at least a tile wide (a tile is part of one row);
    ``CARRY``: a shard's global indices may cross a multiple of 2**32; ``SPANS``: tiles
    start at multiples of their span and draw through span words (:func:`draw_in_span`)."""

    P_T: tl.dtype
    G_T: tl.dtype
    MC_T: tl.dtype
    VC_T: tl.dtype
    TB: int
    BS: int
    RUN: int
    FLAT: bool
    ALIGNED: bool
    WIDE: bool
    CARRY: bool
    SPANS: bool


@triton.jit
def row_tile(group, col_tile, layout, TB: tl.constexpr, BS: tl.constexpr, SCALAR: tl.constexpr):
    """Tile ``col_tile`` of row group ``group`` of a scaled shard laid out as ``layout``
    (:class:`RowLayout`): ``TB`` scale blocks of ``BS`` elements, ``2**slot_bits``
    consecutive blocks of each of ``TB >> slot_bits`` rows (one row part when rows are wide).

    Returns the tile's first element, first FP4 byte and first block (int64), and its
    :class:`TileGeometry` from there. With ``SCALAR`` (accesses one element at a time, see
    :func:`layout_anchor`) element offsets and byte offsets are int64.
    """
    rows, cols, slot_bits = layout.rows, layout.cols, layout.slot_bits
    blocks_per_row, row_bytes = layout.blocks_per_row, layout.row_bytes
    first_row = group << (TB.bit_length() - 1 - slot_bits)  # TB >> slot_bits rows a tile
    col_start = col_tile * (BS << slot_bits)
    j = tl.arange(0, TB)[:, None]
    r = j >> slot_bits
    block_col = (j & ((1 << slot_bits) - 1)) * BS
    col = col_start + block_col
    bvalid = (first_row + r < rows) & (col < cols)
    offs = r * cols + block_col + tl.arange(0, BS)[None, :]
    valid = bvalid & (col + tl.arange(0, BS)[None, :] < cols)
    start = first_row.to(tl.int64) * cols + col_start
    start_bytes = first_row.to(tl.int64) * row_bytes + col_start // 2
    first_block = first_row.to(tl.int64) * blocks_per_row + col_start // BS
    block_offs = r * blocks_per_row + (block_col // BS)
    block_bytes = r * row_bytes + block_col // 2
    if SCALAR:  # 64-bit sums leave each element's constant part to the address's immediate
        offs = (r * cols + block_col).to(tl.int64) + tl.arange(0, BS)[None, :].to(tl.int64)
        block_bytes = block_bytes.to(tl.int64)
    pair_valid = bvalid & (col + 2 * tl.arange(0, BS // 2)[None, :] < cols)
    return (
        start,
        start_bytes,
        first_block,
        TileGeometry(offs, valid, block_offs, bvalid, block_bytes, pair_valid),
    )


@triton.jit
def shard_tile(
    group,
    col_tile,
    layout,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    SCALAR: tl.constexpr,
    FULL: tl.constexpr,
):
    """Tile ``col_tile`` of row group ``group`` of a shard laid out as ``layout``
    (:class:`RowLayout`): :func:`flat_coords` for unscaled states (one row, group 0; its
    block and byte values are 0), :func:`row_tile` for scaled ones; the same four values
    either way. ``FULL`` promises a tile whose every element lies in the shard
    (:func:`tile_is_full`): its masks are constants the compiler drops."""
    if FLAT:
        start, offs, valid = flat_coords(col_tile, layout.cols, TB, BS, ALIGNED)
        span = (start, 0, 0, TileGeometry(offs, valid, 0, 0, 0, 0))
    else:
        span = row_tile(group, col_tile, layout, TB, BS, SCALAR)
    if FULL:
        start, start_bytes, first_block, geometry = span
        span = (
            start,
            start_bytes,
            first_block,
            TileGeometry(
                geometry.offs,
                tl.full((TB, BS), 1, tl.int1),
                geometry.block_offs,
                tl.full((TB, 1), 1, tl.int1),
                geometry.block_bytes,
                tl.full((TB, BS // 2), 1, tl.int1),
            ),
        )
    return span


@triton.jit
def tile_is_full(group, col_tile, layout, TB: tl.constexpr, BS: tl.constexpr, FLAT: tl.constexpr):
    """Whether every element of a :func:`shard_tile` lies in the shard: all its rows, and all
    columns of its ``2**slot_bits`` blocks a row."""
    if FLAT:
        full = (col_tile + 1).to(tl.int64) * (TB * BS) <= layout.cols
    else:
        width = BS << layout.slot_bits
        full = ((group + 1) * (TB >> layout.slot_bits) <= layout.rows) & (
            (col_tile + 1) * width <= layout.cols
        )
    return full


# IEEE square root of four values, correctly rounded: the sequence ptxas emits for
# sqrt.rn.f32 where the operand lies in [2**-101, the largest float] (reciprocal square
# root, two products, two fused multiply-adds), with one range test for the four and one
# branch to sqrt.rn.f32 for them all if any lies outside (zero, subnormal, tiny, ±Inf,
# NaN or negative). ptxas gives each sqrt.rn.f32 its own test, branch and call.
_SQRT_ONE = (
    "rsqrt.approx.ftz.f32 r, $%(x)d; mul.rn.ftz.f32 s, $%(x)d, r; "
    "mul.rn.ftz.f32 h, r, 0f3F000000; neg.f32 e, s; fma.rn.f32 e, e, s, $%(x)d; "
    "fma.rn.f32 $%(y)d, e, h, s; sub.u32 t, $%(x)d, 0x0D000000; "
)
SQRT4 = tl.constexpr(
    "{ .reg .pred far, f; .reg .b32 t; .reg .f32 r, s, h, e; "
    + _SQRT_ONE % {"x": 4, "y": 0}
    + "setp.gt.u32 far, t, 0x727FFFFF; "
    + "".join(
        _SQRT_ONE % {"x": 4 + i, "y": i} + "setp.gt.u32 f, t, 0x727FFFFF; or.pred far, far, f; "
        for i in range(1, 4)
    )
    + "@!far bra SQRT_DONE_${:uid}; "
    + "".join(f"sqrt.rn.f32 ${i}, ${4 + i}; " for i in range(4))
    + "SQRT_DONE_${:uid}: }"
)


@triton.jit
def sqrt_rn(x):
    """Correctly rounded square root of float32 ``x``: :data:`SQRT4` on the GPU, four values
    at a time; in the interpreter ``tl.sqrt_rn``."""
    if HARDWARE:
        root = tl.inline_asm_elementwise(
            SQRT4, "=f,=f,=f,=f,f,f,f,f", [x], dtype=tl.float32, is_pure=True, pack=4
        )
    else:
        root = tl.sqrt_rn(x)
    return root


@triton.jit
def store_bf16(
    pointers, x, rand, mask, STOCHASTIC: tl.constexpr, PTX: tl.constexpr, PART: tl.constexpr
):
    """Round float32 ``x`` to BF16 (:func:`round_bf16`, under the part ``PART`` of draws
    ``rand``), store its bits as int16 through :func:`store_tile`, and return the stored
    values as float32."""
    r = round_bf16(x.to(tl.uint32, bitcast=True), rand, STOCHASTIC, PART)
    store_tile(pointers, (r >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask, PTX)
    return r.to(tl.float32, bitcast=True)


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
def load_state(
    codes_ptr,
    scales_ptr,
    geometry,
    anchor,
    TB: tl.constexpr,
    BS: tl.constexpr,
    C: tl.constexpr,
    SCALAR: tl.constexpr,
):
    """A stored state's tile as loaded (pointers at the tile's first code and first scale):
    its codes (float32 values, BF16 bits, E4M3 codes or FP4 byte pairs, zero where not
    valid) and its blocks' scale bytes (0 for unscaled states). With ``SCALAR``, FP4 byte
    pairs are laid out by a :func:`layout_anchor` at ``anchor``."""
    scale_byte = 0
    if C.KIND == FP32_CODES:
        codes = tl.load(codes_ptr + geometry.offs, mask=geometry.valid, other=0.0)
    elif C.KIND == BF16_CODES:
        codes = tl.load(codes_ptr + geometry.offs, mask=geometry.valid, other=0)
    else:
        scale_byte = tl.load(scales_ptr + geometry.block_offs, mask=geometry.bvalid, other=127)
        if C.KIND == E4M3_CODES:
            codes = tl.load(codes_ptr + geometry.offs, mask=geometry.valid, other=0)
        else:
            half = tl.arange(0, BS // 2)[None, :]
            codes = tl.load(
                codes_ptr + geometry.block_bytes + half, mask=geometry.pair_valid, other=0
            )
            if SCALAR:
                codes = codes | layout_anchor(anchor, TB, BS // 2)
    return codes, scale_byte


@triton.jit
def state_values(codes, scale_byte, TB: tl.constexpr, BS: tl.constexpr, C: tl.constexpr):
    """float32 values [TB, BS] of a state tile loaded by :func:`load_state`."""
    if C.KIND == FP32_CODES:
        x = codes
    elif C.KIND == BF16_CODES:
        x = bf16_bits_to_float(codes)
    else:
        factor = scale_factor(scale_byte.to(tl.int32), C.KMIN, C.KMAX)
        if C.KIND == E4M3_CODES:
            x = code_value(codes.to(tl.uint32), factor, C.P, C.EMIN, C.SIGNED, C.KIND)
        elif HARDWARE:  # the low nibbles' values go to even columns, the high ones' to odd
            even, odd = fp4_pair_values(codes, C.P, C.EMIN, C.SIGNED)
            x = tl.reshape(tl.join(even, odd), (TB, BS)) * factor
        else:  # even columns hold the low nibble
            packed = codes.to(tl.uint32)
            code = tl.reshape(tl.join(packed & 0xF, packed >> 4), (TB, BS))
            x = code_value(code, factor, C.P, C.EMIN, C.SIGNED, C.KIND)
    return x


@triton.jit
def store_state(
    x,
    codes_ptr,
    scales_ptr,
    geometry,
    rand,
    TB: tl.constexpr,
    BS: tl.constexpr,
    C: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    KEEP_POSITIVE: tl.constexpr,
    NONNEGATIVE: tl.constexpr,
    SCALAR: tl.constexpr,
    PART: tl.constexpr,
):
    """Round ``x`` into the state's format under the part ``PART`` of draws ``rand``, store
    it (one element at a time with ``SCALAR``), and return the stored values, the largest
    finite magnitude their codes hold (:func:`largest_magnitude`) and, for a scaled format,
    which blocks ([TB, 1]) hold NaN or ±Inf and their new scale bytes (else False and 0).
    ``NONNEGATIVE`` promises no negative ``x`` (:func:`grid_code`)."""
    bad = False
    scale_byte = 0
    top = largest_magnitude(tl.zeros((), tl.int32), C.P, C.EMAX, C.MAXF)
    if C.KIND == FP32_CODES:
        store_tile(codes_ptr + geometry.offs, x, geometry.valid, SCALAR)
        stored = x
    elif C.KIND == BF16_CODES:
        stored = store_bf16(
            codes_ptr + geometry.offs, x, rand, geometry.valid, STOCHASTIC, SCALAR, PART
        )
    else:
        u = x.to(tl.uint32, bitcast=True)
        # one reduction gives both the largest magnitude and whether any value is NaN/±Inf;
        # lanes past a row's end hold 0 (zero codes and gradients) unless their block was
        # the NaN block, whose valid lanes make the new block NaN anyway
        top = tl.max(u & 0x7FFFFFFF, axis=1)[:, None]
        bad = top >= 0x7F800000
        k = block_scale_exp(top, C.P, C.EMAX, C.MAXF, C.KMIN, C.KMAX)
        if HARDWARE:
            code, value = grid_code(
                x, u, k, bad, geometry.valid, rand, C, STOCHASTIC, KEEP_POSITIVE, NONNEGATIVE, PART
            )
            stored = value * tl.where(bad, float("nan"), pow2(k))
        else:
            bits = round_bits(
                u, k, draw_part(rand, PART), C.P, C.EMIN, C.EMAX, C.MAXF, C.SIGNED, STOCHASTIC
            )
            if KEEP_POSITIVE:
                smallest = (k + (C.EMIN - C.P + 127)).to(tl.uint32) << 23
                bits = tl.where((bits == 0) & (u > 0) & (u < 0x7F800000), smallest, bits)
            r = bits.to(tl.float32, bitcast=True)
            stored = tl.where(bad, float("nan"), r)
            if C.KIND == E4M3_CODES:  # r / 2**k is an exact E4M3 value: converted exactly
                code = e4m3_code(r * pow2(-k))
            else:
                code = encode_grid(bits, k, C.P, C.EMIN, C.SIGNED, C.BITS)
            # codes of a NaN block are 0, and a pair's padding nibble stays 0
            code = tl.where(bad | ~geometry.valid if C.KIND == FP4_CODES else bad, 0, code)
        scale_byte = tl.where(bad, 255, k + 127).to(tl.uint8)
        top = largest_magnitude(k, C.P, C.EMAX, C.MAXF)
        # stored from the [TB] slice (a max over the size-1 axis): one byte a thread, where a
        # [TB, 1] tensor holds four copies of it a thread and would store each
        store_tile(
            scales_ptr + tl.max(geometry.block_offs, axis=1),
            tl.max(scale_byte, axis=1),
            tl.max(geometry.bvalid.to(tl.int8), axis=1) != 0,
            HARDWARE,
        )
        if C.KIND == E4M3_CODES:
            store_tile(codes_ptr + geometry.offs, code.to(tl.uint8), geometry.valid, SCALAR)
        else:
            if HARDWARE:  # the pairs' bytes, from fp4_pairs
                pairs = code
            else:
                even, odd = tl.split(tl.reshape(code.to(tl.uint8), (TB, BS // 2, 2)))
                pairs = even | (odd << 4)
            half = tl.arange(0, BS // 2)[None, :]
            store_tile(codes_ptr + geometry.block_bytes + half, pairs, geometry.pair_valid, SCALAR)
    return stored, bad, scale_byte, top


@triton.jit
def largest_magnitude(k, P: tl.constexpr, EMAX: tl.constexpr, MAXF: tl.constexpr):
    """The largest finite magnitude of a format's grid under scale exponent ``k`` (0 for
    unscaled formats): ``(1 + MAXF·2**-P)·2**(EMAX + k)`` as float32."""
    bits = ((k + (EMAX + 127)).to(tl.uint32) << 23) | (MAXF << (23 - P))
    return bits.to(tl.float32, bitcast=True)


class TilePointers(NamedTuple):
    """Pointers at a tile's first parameter and gradient element, first m and v code (an FP4
    state's first byte, :func:`~srtrain.kernels.memory.codes_base`) and first m and v scale
    byte, as :func:`load_tile` reads them and :func:`adamw_tile` writes them."""

    p: tl.tensor
    g: tl.tensor
    m_codes: tl.tensor
    m_scales: tl.tensor
    v_codes: tl.tensor
    v_scales: tl.tensor


class TileInputs(NamedTuple):
    """A tile's inputs as :func:`load_tile` loads them: parameter and gradient (float32 or
    BF16 bits), and codes and scale bytes of m and v (:func:`load_state`)."""

    p: tl.tensor
    g: tl.tensor
    m_codes: tl.tensor
    m_scale: tl.tensor
    v_codes: tl.tensor
    v_scale: tl.tensor


@triton.jit
def load_tile(
    pointers,
    geometry,
    anchor,
    SHAPE: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
    FULL: tl.constexpr,
):
    """The :class:`TileInputs` of a tile (:class:`TilePointers`, :class:`TileGeometry`).
    ``ACCESS.scalar`` tiles (rows without the vectorised accesses) lay out their FP4 byte
    pairs by :func:`layout_anchor` at ``anchor`` (:func:`adamw_tile` lays out the rest).
    ``ACCESS.quad_loads`` loads a float32 parameter and gradient by :func:`load_quads`,
    ``ACCESS.run_accesses`` of a ``FULL`` tile (of ``ACCESS.scalar`` rows) by
    :func:`load_runs`."""
    TB: tl.constexpr = SHAPE.TB
    BS: tl.constexpr = SHAPE.BS
    RUNS: tl.constexpr = ACCESS.run_accesses and FULL
    p_raw = load_values(pointers.p + geometry.offs, geometry.valid, ACCESS.quad_loads, RUNS)
    g_raw = load_values(pointers.g + geometry.offs, geometry.valid, ACCESS.quad_loads, RUNS)
    m_raw, m_scale = load_state(
        pointers.m_codes, pointers.m_scales, geometry, anchor, TB, BS, M, ACCESS.scalar
    )
    v_raw, v_scale = load_state(
        pointers.v_codes, pointers.v_scales, geometry, anchor, TB, BS, V, ACCESS.scalar
    )
    return TileInputs(p_raw, g_raw, m_raw, m_scale, v_raw, v_scale)


@triton.jit
def tile_draw(key, lo, SPANS: tl.constexpr):
    """A tile's draws: :func:`draw_in_span` of span offsets ``lo`` under the span word
    ``key`` with ``SPANS``, else :func:`draw` of low index words ``lo`` under the span key."""
    if SPANS:
        rand = draw_in_span(key, lo)
    else:
        rand = draw(key, lo)
    return rand


class StepFlags(NamedTuple):
    """A step's compile-time flags, one argument of :func:`adamw_tile`: BF16 parameter and
    gradient (else float32), stochastic rounding of the parameter, m and v, whether the
    step counts the health counts (:func:`state_counts`; without, the kernel holds no trace
    of them), and whether it is gated: each shard's step table row then holds the address
    of a float32 gate, whose finite value multiplies every gradient element and whose
    non-finite value (NaN, ±Inf) skips the shard (without, the kernel holds no trace of a
    gate)."""

    P_BF16: bool
    G_BF16: bool
    P_SR: bool
    M_SR: bool
    V_SR: bool
    HEALTH: bool
    GATED: bool


class TileDraws(NamedTuple):
    """What a tile's draws are keyed by (:func:`tile_draw`): the elements' low index words
    (or, drawing through span words, their offsets in the tile's span) and the span keys
    (or span words) of the states and of the parameter."""

    lo: tl.tensor
    state_key: tl.tensor
    param_key: tl.tensor


class StepScalars(NamedTuple):
    """A shard's float32 step scalars (:class:`~srtrain.numerics.adamw.AdamWScalars`)."""

    beta1: tl.tensor
    one_minus_beta1: tl.tensor
    beta2: tl.tensor
    one_minus_beta2: tl.tensor
    inv_bc2_sqrt: tl.tensor
    eps: tl.tensor
    step_size: tl.tensor
    decay: tl.tensor


@triton.jit
def adamw_tile(
    inputs,
    pointers,
    geometry,
    draws,
    anchor,
    scalars,
    gate,
    SHAPE: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
    FULL: tl.constexpr,
):
    """One AdamW step on one [TB, BS] tile (``SHAPE``, :class:`TileShape`) whose
    :class:`TileInputs` :func:`load_tile` loaded, written through its :class:`TilePointers`
    at its :class:`TileGeometry`, drawn by its :class:`TileDraws` (under the span keys of the
    states and of the parameter, :func:`span_key`; with ``SHAPE.SPANS`` the offsets in the
    tile's span under its span words, :func:`draw_in_span`); returns its counts (m
    stalled, v stalled, param changed, non-finite grad): :func:`count_words` where
    :func:`packed_counts`, else :func:`count_sums` over runs of ``SHAPE.RUN`` lanes; with
    ``STEP.HEALTH``, a pair of those and the sums of :func:`state_counts` (m underflow,
    v underflow, m saturated, v saturated over runs of ``SHAPE.RUN`` lanes, m and v scales
    changed a block). ``ACCESS.scalar`` tiles are laid out by :func:`layout_anchor` at
    ``anchor`` and stored one element at a time, but with ``ACCESS.line_stores`` a float32
    parameter goes out through tl.store, which moves it through shared memory so that each
    warp's store covers 128 consecutive bytes, and without, ``ACCESS.run_accesses`` of a
    ``FULL`` tile stores it by :func:`store_runs`. Square roots go four at a time
    (:func:`sqrt_rn`). With ``STEP.GATED`` the float32 gradient is multiplied by ``gate``
    (a finite float32 scalar; the caller skips the tiles of a non-finite one) before
    anything else uses it, as the spec's ``grad_scale``; without, ``gate`` is unused."""
    TB: tl.constexpr = SHAPE.TB
    BS: tl.constexpr = SHAPE.BS
    RUN: tl.constexpr = SHAPE.RUN
    SPANS: tl.constexpr = SHAPE.SPANS
    SCALAR: tl.constexpr = ACCESS.scalar
    LINE_STORES: tl.constexpr = ACCESS.line_stores
    RUNS: tl.constexpr = ACCESS.run_accesses and FULL
    if STEP.P_BF16:
        p_old = bf16_bits_to_float(inputs.p)
    else:
        p_old = inputs.p
    if STEP.G_BF16:
        g = bf16_bits_to_float(inputs.g)
    else:
        g = inputs.g
    if SCALAR:
        g = (g.to(tl.uint32, bitcast=True) | layout_anchor(anchor, TB, BS).to(tl.uint32)).to(
            tl.float32, bitcast=True
        )
    if STEP.GATED:  # one float32 product, unfused (enable_fp_fusion=False), as the spec's
        g = g * gate
    m_old = state_values(inputs.m_codes, inputs.m_scale, TB, BS, M)
    v_old = state_values(inputs.v_codes, inputs.v_scale, TB, BS, V)

    m_new = m_old * scalars.beta1 + g * scalars.one_minus_beta1
    v_new = v_old * scalars.beta2 + (g * g) * scalars.one_minus_beta2
    denom = sqrt_rn(v_new) * scalars.inv_bc2_sqrt + scalars.eps
    p_new = p_old * scalars.decay - tl.math.div_rn(m_new, denom) * scalars.step_size

    rand = tile_draw(
        draws.state_key, draws.lo, SPANS
    )  # m and v split it (numerics.rounding.split_draw)
    m_stored, m_bad, m_scale_new, m_top = store_state(
        m_new,
        pointers.m_codes,
        pointers.m_scales,
        geometry,
        rand,
        TB,
        BS,
        M,
        STEP.M_SR,
        False,
        False,
        SCALAR,
        DRAW_HIGH,
    )
    v_stored, v_bad, v_scale_new, v_top = store_state(
        v_new,
        pointers.v_codes,
        pointers.v_scales,
        geometry,
        rand,
        TB,
        BS,
        V,
        STEP.V_SR,
        True,
        True,
        SCALAR,
        DRAW_LOW,
    )
    if STEP.P_BF16:
        p_stored = store_bf16(
            pointers.p + geometry.offs,
            p_new,
            tile_draw(draws.param_key, draws.lo, SPANS),
            geometry.valid,
            STEP.P_SR,
            SCALAR,
            DRAW_WHOLE,
        )
    else:
        if RUNS and not LINE_STORES:
            store_runs(pointers.p + geometry.offs, p_new)
        else:
            store_tile(
                pointers.p + geometry.offs, p_new, geometry.valid, SCALAR and not LINE_STORES
            )
        p_stored = p_new

    if packed_counts(M.KIND, V.KIND):
        counts = count_words(m_stored, m_old, v_stored, v_old, p_stored, p_old, g, geometry.valid)
    else:
        # a non-finite gradient makes both new moments non-finite: its block is bad
        bad = v_bad if V.KIND >= 2 else m_bad
        counts = count_sums(
            m_stored, m_old, v_stored, v_old, p_stored, p_old, g, geometry.valid, bad, TB, BS, RUN
        )
    if STEP.HEALTH:
        m_extra = state_counts(
            m_new,
            m_stored,
            m_top,
            inputs.m_scale,
            m_scale_new,
            geometry.valid,
            geometry.bvalid,
            TB,
            BS,
            M,
            RUN,
        )
        v_extra = state_counts(
            v_new,
            v_stored,
            v_top,
            inputs.v_scale,
            v_scale_new,
            geometry.valid,
            geometry.bvalid,
            TB,
            BS,
            V,
            RUN,
        )
        extra = (m_extra[0], v_extra[0], m_extra[1], v_extra[1], m_extra[2], v_extra[2])
        counts = counts, extra
    return counts


@triton.constexpr_function
def packed_counts(m_kind: int, v_kind: int) -> bool:
    """Whether a step counts in per-lane words (:func:`count_words`) rather than per-thread
    sums (:func:`count_sums`): unscaled states (code families under 2) do."""
    return not (m_kind >= 2 or v_kind >= 2)  # E4M3 and FP4 codes are block-scaled


@triton.jit
def count_words(m_stored, m_old, v_stored, v_old, p_stored, p_old, g, valid):
    """Two packed count words per element (uint32): m stalled + v stalled << 16, and param
    changed + non-finite grad << 16, over valid lanes."""
    g_bits = g.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    mv = (valid & (m_stored == m_old)).to(tl.uint32) | (
        (valid & (v_stored == v_old)).to(tl.uint32) << 16
    )
    pg = (valid & (p_stored != p_old)).to(tl.uint32) | (
        (valid & (g_bits >= 0x7F800000)).to(tl.uint32) << 16
    )
    return mv, pg


# Lane tests of :func:`lane_count`: each row is the PTX registers it needs beyond the count's
# and a lane's PTX, which sets predicate p from the lane's operands a, b (f32) and valid
# (b32). Comparisons of a and b: equal, unequal, not below. Underflow: a (the proposal) not
# zero (or NaN) and b (the stored value) ±0. Saturated: |a| (the stored value) equal to b
# (the largest magnitude).
LANE_TESTS = (
    ("", "setp.ne.b32 v, {valid}, 0; setp.eq.and.f32 p, {a}, {b}, v; "),
    ("", "setp.ne.b32 v, {valid}, 0; setp.neu.and.f32 p, {a}, {b}, v; "),
    ("", "setp.ne.b32 v, {valid}, 0; setp.geu.and.f32 p, {a}, {b}, v; "),
    (
        ".reg .pred q; ",
        "setp.ne.b32 v, {valid}, 0; setp.neu.and.f32 q, {a}, 0f00000000, v; "
        "setp.eq.and.f32 p, {b}, 0f00000000, q; ",
    ),
    (".reg .f32 t; ", "setp.ne.b32 v, {valid}, 0; abs.f32 t, {a}; setp.eq.and.f32 p, t, {b}, v; "),
)
EQUAL, UNEQUAL, NOT_BELOW, UNDERFLOW, SATURATED = (tl.constexpr(i) for i in range(5))


@triton.constexpr_function
def run_count_constraints(run: int) -> str:
    """Operand constraints of :func:`lane_count_ptx`."""
    return ",".join(["=r"] * run + ["r"] * (3 * run))


@triton.constexpr_function
def lane_count_ptx(test: int, run: int) -> str:
    """PTX counting the lanes of a run of ``run`` that pass the lane test ``test`` (a row of
    :data:`LANE_TESTS`): the test and a predicated add a lane. The count lands in the run's
    first output, the others are 0. Operands: outputs, then ``a``, ``b`` and ``valid`` of
    each lane."""
    registers, lane = LANE_TESTS[test]
    lanes = "".join(
        lane.format(a=f"${run + i}", b=f"${2 * run + i}", valid=f"${3 * run + i}")
        + "@p add.u32 $0, $0, 1; "
        for i in range(run)
    )
    zeros = "".join(f"mov.b32 ${i}, 0; " for i in range(1, run))
    return "{ .reg .pred p, v; " + registers + "mov.b32 $0, 0; " + lanes + zeros + "}"


@triton.constexpr_function
def nonfinite_count_ptx(run: int) -> str:
    """PTX counting the valid lanes of a run of ``run`` whose gradient is NaN or ±Inf, which
    it skips (the count is 0) where no lane's block is bad. The count lands in the run's
    first output, the others are 0. Operands: outputs, then the gradient, ``valid`` and
    ``bad`` of each lane."""
    any_bad = "".join(f"or.b32 t, t, ${3 * run + i}; " for i in range(1, run))
    lanes = "".join(
        f"setp.ne.b32 v, ${2 * run + i}, 0; abs.f32 a, ${run + i}; "
        f"setp.geu.and.f32 p, a, 0f7F800000, v; @p add.u32 $0, $0, 1; "
        for i in range(run)
    )
    zeros = "".join(f"mov.b32 ${i}, 0; " for i in range(1, run))
    return (
        "{ .reg .pred p, v; .reg .b32 t; .reg .f32 a; mov.b32 $0, 0; "
        + zeros
        + f"mov.b32 t, ${3 * run}; "
        + any_bad
        + "setp.eq.b32 p, t, 0; "
        "@p bra NONFINITE_DONE_${:uid}; " + lanes + "NONFINITE_DONE_${:uid}: }"
    )


@triton.jit
def run_sums(flags, TB: tl.constexpr, BS: tl.constexpr, RUN: tl.constexpr):
    """Sums [TB, BS // RUN] of ``flags`` [TB, BS] over runs of ``RUN`` neighbouring
    elements: the elements one thread holds, so the sums need no other thread."""
    return tl.sum(tl.reshape(flags, (TB, BS // RUN, RUN)), axis=2)


@triton.jit
def lane_count(
    a, b, valid, TEST: tl.constexpr, TB: tl.constexpr, BS: tl.constexpr, RUN: tl.constexpr
):
    """How many valid lanes of each run of ``RUN`` pass the lane test ``TEST`` of ``a`` and
    ``b`` ([TB, BS // RUN] int32; :data:`LANE_TESTS`)."""
    if HARDWARE:
        flags = tl.inline_asm_elementwise(
            lane_count_ptx(TEST, RUN),
            run_count_constraints(RUN),
            [a, b, valid.to(tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=RUN,
        )
    else:
        if TEST == EQUAL:
            flag = a == b
        elif TEST == UNEQUAL:
            flag = a != b
        elif TEST == NOT_BELOW:
            flag = ~(a < b)
        elif TEST == UNDERFLOW:
            flag = (a != 0.0) & (b == 0.0)
        else:
            flag = tl.abs(a) == b
        flags = (valid & flag).to(tl.int32)
    return run_sums(flags, TB, BS, RUN)


@triton.jit
def nonfinite_count(g, valid, bad, TB: tl.constexpr, BS: tl.constexpr, RUN: tl.constexpr):
    """How many valid lanes of each run of ``RUN`` hold a NaN or ±Inf gradient ([TB, BS // RUN]
    int32). On the GPU a run none of whose lanes lies in a ``bad`` block ([TB, 1]) skips
    the test: a non-finite gradient makes its block bad."""
    if HARDWARE:
        flags = tl.inline_asm_elementwise(
            nonfinite_count_ptx(RUN),
            run_count_constraints(RUN),
            [g, valid.to(tl.int32), tl.broadcast_to(bad, g.shape).to(tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=RUN,
        )
        counts = run_sums(flags, TB, BS, RUN)
    else:
        counts = lane_count(
            tl.abs(g), tl.full(g.shape, float("inf"), tl.float32), valid, NOT_BELOW, TB, BS, RUN
        )
    return counts


@triton.jit
def count_sums(
    m_stored,
    m_old,
    v_stored,
    v_old,
    p_stored,
    p_old,
    g,
    valid,
    bad,
    TB: tl.constexpr,
    BS: tl.constexpr,
    RUN: tl.constexpr,
):
    """The tile's counts over runs of ``RUN`` elements ([TB, BS // RUN] int32 each): m
    stalled, v stalled, param changed, non-finite gradient (:func:`nonfinite_count`, given
    the blocks of a scaled state that are ``bad``).

    Each thread counts the lanes it holds with a compare and a predicated add a lane into
    one register a count (per-lane count words take a register a lane and a select and an
    add to pack each flag). Whichever lanes the compiler groups, every lane's flag lands in
    exactly one sum, so the totals do not depend on the layout.
    """
    return (
        lane_count(m_stored, m_old, valid, EQUAL, TB, BS, RUN),
        lane_count(v_stored, v_old, valid, EQUAL, TB, BS, RUN),
        lane_count(p_stored, p_old, valid, UNEQUAL, TB, BS, RUN),
        nonfinite_count(g, valid, bad, TB, BS, RUN),
    )


@triton.jit
def state_counts(
    proposal,
    stored,
    top,
    old_scale,
    new_scale,
    valid,
    bvalid,
    TB: tl.constexpr,
    BS: tl.constexpr,
    C: tl.constexpr,
    RUN: tl.constexpr,
):
    """A state's underflow and saturation counts over runs of ``RUN`` lanes ([TB, BS // RUN]
    int32; :func:`lane_count`) and its changed scale bytes a block ([TB, 1] int32; zeros
    unscaled), as :func:`srtrain.numerics.adamw.adamw_step_reference` counts them.
    ``proposal``: the values before rounding; ``top``: the largest magnitude of the
    stored values' codes; ``old_scale``, ``new_scale``: the blocks' scale bytes before and
    after the step. A float32 state stores its proposal: it never underflows."""
    if C.KIND == FP32_CODES:
        underflow = tl.zeros((TB, BS // RUN), tl.int32)
    else:
        underflow = lane_count(proposal, stored, valid, UNDERFLOW, TB, BS, RUN)
    saturated = lane_count(
        stored, tl.broadcast_to(top, stored.shape), valid, SATURATED, TB, BS, RUN
    )
    if C.KIND >= 2:  # block-scaled
        changed = (bvalid & (old_scale != new_scale)).to(tl.int32)
    else:
        changed = tl.zeros((TB, 1), tl.int32)
    return underflow, saturated, changed
