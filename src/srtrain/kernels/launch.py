"""The fused AdamW launch: one kernel over every shard that shares dtypes, formats and rounding.

A :class:`MultiStep` holds what does not change between steps for a list of shards
(addresses of parameters and states, sizes, the tile → shard table) in device tables
built once; each step adds one small table of gradient addresses, keys and scalars
and launches once. Programs walk contiguous runs of tiles shard by shard: a shard's
table rows are read once, its tiles follow in row-group order, and each thread's counts
stay in registers until they are added to the shard's row of the counts buffer.
Each tile computes exactly what :func:`srtrain.numerics.adamw.adamw_step_reference`
computes for its shard, bit for bit.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from srtrain.kernels.launch_plan import (
    LaunchPlan,
    check_tile,
    fills_tile,
    launch_plan,
    run_length,
    tile_blocks,
    without,
)
from srtrain.kernels.memory import (
    LOAD4,
    codes_base,
    int_view,
    l2_next,
    l2_row_steps,
    prefetch_l2,
    run_access_ptx,
    scales_or_codes,
    tile_prefetch_ptx,
)
from srtrain.kernels.state_codes import check_formats, state_code
from srtrain.kernels.tile import (
    StepFlags,
    adamw_tile,
    load_tile,
    packed_counts,
    row_slots,
    shard_tile,
    tile_is_full,
    tile_layout,
    tile_span,
    tiles_of,
)
from srtrain.kernels.triton_numerics import (
    HARDWARE,
    flat_index_words,
    interpreted,
    span_key,
    span_word,
    tile_index_words,
)
from srtrain.numerics.adamw import NUM_COUNTS, AdamWScalars, RoundingPlan, check_step_inputs
from srtrain.numerics.formats import Format
from srtrain.numerics.rounding import StoredState

STATIC_COLUMNS = 14  # param, m codes, m scales, v codes, v scales, offset, cols, blocks/row,
#                      tiles/row, first tile, counts row, rows, slot bits, tiles (int64)
DYNAMIC_COLUMNS = 16  # grad address (2 words), k0, k1 of the states and of the param, 1 unused,
#                       8 float32 scalars, 2 unused (int32; 64-byte rows, read 16 bytes at a time)
KEY_COLUMNS = 3  # of a step's keys as launch() takes them: k0, k1 of the states, k1 of the param
_STATIC_WIDTH = tl.constexpr(STATIC_COLUMNS)
_DYNAMIC_WIDTH = tl.constexpr(DYNAMIC_COLUMNS)
_NUM_COUNTS = tl.constexpr(NUM_COUNTS)
MAX_TILES_PER_PROGRAM = 65535  # packed count words hold 16-bit per-lane counts
ALIGNMENT = 16  # bytes; aligned shards get vectorised loads


@dataclass
class Shard:
    """What one shard contributes to every step: parameter, states, global offset, counts row."""

    param: torch.Tensor
    m: StoredState
    v: StoredState
    offset: int
    counts_row: int


@dataclass
class StepItem:
    """One shard's part of a multi-tensor step (arguments of :func:`fused_adamw_triton`)."""

    param: torch.Tensor
    grad: torch.Tensor
    m: StoredState
    v: StoredState
    scalars: AdamWScalars
    plan: RoundingPlan
    offset: int
    counts_row: int


@triton.jit
def _pair(row, column, VECTOR: tl.constexpr, KEEP: tl.constexpr):
    """Columns ``column`` and ``column + 1`` (even) of a static table row, int64; with
    ``VECTOR``, one 16-byte load (see :func:`_quad`)."""
    if VECTOR:
        return tl.inline_asm_elementwise(
            "ld.global.nc.v2.b64 {$0, $1}, [$2];",
            "=l,=l,l",
            [row + column],
            dtype=(tl.int64, tl.int64),
            is_pure=KEEP,
            pack=1,
        )
    return tl.load(row + column), tl.load(row + column + 1)


@triton.jit
def _quad(row, column, VECTOR: tl.constexpr, KEEP: tl.constexpr):
    """Columns ``column`` .. ``column + 3`` (a multiple of 4) of a step table row, int32.

    With ``VECTOR``, one 16-byte load of read-only data. With ``KEEP`` the compiler may
    move it out of the tile loop: a shard's values then stay in registers across its tiles.
    Without, it is repeated every tile and its registers are free while the tile works;
    scaled states need those registers for their blocks.
    """
    if VECTOR:
        return tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
            "=r,=r,=r,=r,l",
            [row + column],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=KEEP,
            pack=1,
        )
    return (
        tl.load(row + column),
        tl.load(row + column + 1),
        tl.load(row + column + 2),
        tl.load(row + column + 3),
    )


@triton.jit
def _pointer(address, T: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 address as a pointer to T."""
    pointer = address.to(tl.pointer_type(T))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _float(word):
    """A step table word as the float32 it holds."""
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _key(word):
    """A step table word as the uint32 key word it holds."""
    return word.to(tl.uint32, bitcast=True)


@triton.jit
def _no_counts(
    TB: tl.constexpr,
    BS: tl.constexpr,
    RUN: tl.constexpr,
    PACKED: tl.constexpr,
    HEALTH: tl.constexpr,
):
    """Zero counts of a run of tiles, the forms :func:`~srtrain.kernels.tile.adamw_tile`
    returns: with ``PACKED``, two count words a lane
    (:func:`~srtrain.kernels.tile.count_words`), else four sums a run of ``RUN``
    lanes (:func:`~srtrain.kernels.tile.count_sums`); with ``HEALTH``, a pair of those and
    four sums a run and two a block (:func:`~srtrain.kernels.tile.state_counts` of m and
    v)."""
    if PACKED:
        total = tl.zeros((TB, BS), tl.uint32), tl.zeros((TB, BS), tl.uint32)
    else:
        total = (
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
        )
    if HEALTH:
        extra = (
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, BS // RUN), tl.int32),
            tl.zeros((TB, 1), tl.int32),
            tl.zeros((TB, 1), tl.int32),
        )
        total = total, extra
    return total


@triton.jit
def _add_stall_counts(total, tile, PACKED: tl.constexpr):
    """A run's stall counts with a tile's added (the forms of :func:`_no_counts` without
    ``HEALTH``)."""
    if PACKED:
        total = total[0] + tile[0], total[1] + tile[1]
    else:
        total = total[0] + tile[0], total[1] + tile[1], total[2] + tile[2], total[3] + tile[3]
    return total


@triton.jit
def _add_counts(total, tile, PACKED: tl.constexpr, HEALTH: tl.constexpr):
    """A run's counts with a tile's added (the forms of :func:`_no_counts`)."""
    if HEALTH:
        base, extra = total
        tile_base, tile_extra = tile
        base = _add_stall_counts(base, tile_base, PACKED)
        extra = (
            extra[0] + tile_extra[0],
            extra[1] + tile_extra[1],
            extra[2] + tile_extra[2],
            extra[3] + tile_extra[3],
            extra[4] + tile_extra[4],
            extra[5] + tile_extra[5],
        )
        total = base, extra
    else:
        total = _add_stall_counts(total, tile, PACKED)
    return total


@triton.jit
def _flush(counts, row, total, PACKED: tl.constexpr, HEALTH: tl.constexpr):
    """Add a run's counts (:func:`_no_counts`) to row ``row`` of the [shards,
    :data:`~srtrain.numerics.adamw.NUM_COUNTS`] counts buffer: one atomic add a counter
    (without ``HEALTH``, the stall counts alone)."""
    base = counts + row * _NUM_COUNTS
    if HEALTH:
        words, extra = total
    else:
        words = total
    if PACKED:
        mv, pg = words
        words = (mv & 0xFFFF, mv >> 16, pg & 0xFFFF, pg >> 16)
    for i in tl.static_range(4):  # under 2**31 (MultiStep._programs)
        tl.atomic_add(base + i, tl.sum(tl.sum(words[i], axis=1), axis=0).to(tl.int64))
    if HEALTH:
        for i in tl.static_range(6):
            tl.atomic_add(base + 4 + i, tl.sum(tl.sum(extra[i], axis=1), axis=0).to(tl.int64))


@triton.jit
def _shard_table(
    row_s,
    row_d,
    TB: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    WIDE: tl.constexpr,
    KEEP: tl.constexpr,
):
    """Addresses and sizes of the shard whose table rows are ``row_s`` (static) and ``row_d``
    (this step's); ``WIDE`` promises rows at least a tile wide (a tile
    is part of one row: no slot bits to read). On the GPU the rows are read in 16-byte
    loads. With ``KEEP`` the compiler may keep their values in registers across the
    shard's tiles; without, they are read again every tile, so that their values live only
    as long as the tile's work needs them."""
    VECTOR: tl.constexpr = HARDWARE
    p_address, mc_address = _pair(row_s, 0, VECTOR, KEEP)
    ms_address, vc_address = _pair(row_s, 2, VECTOR, KEEP)
    vs_address, offset = _pair(row_s, 4, VECTOR, KEEP)
    cols, blocks_per_row = _pair(row_s, 6, VECTOR, KEEP)
    _, rows = _pair(row_s, 10, VECTOR, KEEP)
    if WIDE:
        slot_bits = TB.bit_length() - 1
    else:
        slot_bits, _ = _pair(row_s, 12, VECTOR, KEEP)
        slot_bits = slot_bits.to(tl.int32)
    g_lo, g_hi, _, _ = _quad(row_d, 0, VECTOR, KEEP)
    g_address = g_lo.to(tl.uint32, bitcast=True).to(tl.int64) | (g_hi.to(tl.int64) << 32)
    if FLAT:
        row_bytes = 0
    else:
        cols = cols.to(tl.int32)
        if ALIGNED:
            cols = tl.multiple_of(cols, 16)
            row_bytes = tl.multiple_of(cols // 2, 8)
        else:
            row_bytes = (cols + 1) // 2
    return (
        p_address,
        g_address,
        mc_address,
        ms_address,
        vc_address,
        vs_address,
        offset,
        cols,
        blocks_per_row.to(tl.int32),
        rows.to(tl.int32),
        slot_bits,
        row_bytes,
    )


@triton.jit
def _span_keys(row_d, hi):
    """Span keys (numerics.rounding.span_key) of the states and of the parameter whose step
    table row is ``row_d``, for indices with high word ``hi`` (uint32: one for a whole shard,
    or each element's)."""
    key0 = _key(tl.load(row_d + 2))
    return (
        span_key(key0, _key(tl.load(row_d + 3)), hi),
        span_key(key0, _key(tl.load(row_d + 4)), hi),
    )


@triton.jit
def _tile_at(
    table,
    group,
    col_tile,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    CARRY: tl.constexpr,
    FULL: tl.constexpr,
    SPANS: tl.constexpr,
):
    """Pointers at tile ``col_tile`` of row group ``group`` of a shard (its
    :func:`_shard_table`), the tile's coordinates (:func:`shard_tile`) and the global index
    words of its elements. No ``CARRY`` promises that no shard's global indices cross a
    multiple of 2**32 (one high index word per tile). ``SPANS`` promises tiles that start
    at multiples of their span (:func:`~srtrain.kernels.tile.tile_span`): the words
    are then the elements' offsets in the tile and the low word of its first index."""
    (
        p_address,
        g_address,
        mc_address,
        ms_address,
        vc_address,
        vs_address,
        offset,
        cols,
        blocks_per_row,
        rows,
        slot_bits,
        row_bytes,
    ) = table
    u8 = tl.pointer_type(tl.uint8)
    (start, start_bytes, first_block, offs, valid, block_offs, bvalid, block_bytes, pair_valid) = (
        shard_tile(
            group,
            col_tile,
            rows,
            cols,
            slot_bits,
            blocks_per_row,
            row_bytes,
            TB,
            BS,
            FLAT,
            ALIGNED,
            SCALAR,
            FULL,
        )
    )
    if CARRY:
        lo_word, hi_word = flat_index_words(offset + start, offs)
    elif SPANS:
        lo_word, hi_word = offs.to(tl.uint32), ((offset + start) & 0xFFFFFFFF).to(tl.uint32)
    else:
        lo_word, hi_word = tile_index_words(offset + start, offs)
    return (
        _pointer(p_address, P_T, ALIGNED) + start,
        _pointer(g_address, G_T, ALIGNED) + start,
        codes_base(_pointer(mc_address, MC_T, ALIGNED), start, start_bytes, M.BITS),
        ms_address.to(u8) + first_block,
        codes_base(_pointer(vc_address, VC_T, ALIGNED), start, start_bytes, V.BITS),
        vs_address.to(u8) + first_block,
        offs,
        valid,
        block_offs,
        bvalid,
        block_bytes,
        pair_valid,
        lo_word,
        hi_word,
    )


@triton.jit
def _full(table, group, col_tile, TB: tl.constexpr, BS: tl.constexpr, FLAT: tl.constexpr):
    """:func:`tile_is_full` of a tile of the shard whose :func:`_shard_table` is ``table``."""
    _, _, _, _, _, _, _, cols, _, rows, slot_bits, _ = table
    return tile_is_full(group, col_tile, rows, cols, slot_bits, TB, BS, FLAT)


@triton.jit
def _load_at(
    tile,
    anchor,
    TB: tl.constexpr,
    BS: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    QUAD_LOADS: tl.constexpr,
    RUNS: tl.constexpr,
):
    """:func:`load_tile` of a tile given by :func:`_tile_at`."""
    (
        p_ptr,
        g_ptr,
        mc_ptr,
        ms_ptr,
        vc_ptr,
        vs_ptr,
        offs,
        valid,
        block_offs,
        bvalid,
        block_bytes,
        pair_valid,
        _,
        _,
    ) = tile
    return load_tile(
        p_ptr,
        g_ptr,
        mc_ptr,
        ms_ptr,
        vc_ptr,
        vs_ptr,
        offs,
        valid,
        block_offs,
        bvalid,
        block_bytes,
        pair_valid,
        anchor,
        TB,
        BS,
        M,
        V,
        SCALAR,
        QUAD_LOADS,
        RUNS,
    )


@triton.jit
def _load_ahead(
    table,
    group,
    col_tile,
    anchor,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    CARRY: tl.constexpr,
    QUAD_LOADS: tl.constexpr,
    RUN_ACCESSES: tl.constexpr,
):
    """:func:`_load_at` of a tile, without masks when it is full (and with
    ``RUN_ACCESSES``, by runs)."""
    full = _full(table, group, col_tile, TB, BS, FLAT)
    if full:  # loaded in each branch: the full tile's masks stay constants
        inputs = _load_at(
            _tile_at(
                table,
                group,
                col_tile,
                P_T,
                G_T,
                MC_T,
                VC_T,
                TB,
                BS,
                FLAT,
                ALIGNED,
                M,
                V,
                SCALAR,
                CARRY,
                True,
                False,
            ),
            anchor,
            TB,
            BS,
            M,
            V,
            SCALAR,
            QUAD_LOADS,
            RUN_ACCESSES,
        )
    else:
        inputs = _load_at(
            _tile_at(
                table,
                group,
                col_tile,
                P_T,
                G_T,
                MC_T,
                VC_T,
                TB,
                BS,
                FLAT,
                ALIGNED,
                M,
                V,
                SCALAR,
                CARRY,
                False,
                False,
            ),
            anchor,
            TB,
            BS,
            M,
            V,
            SCALAR,
            QUAD_LOADS,
            False,
        )
    return inputs


@triton.jit
def _l2_pointers(
    table,
    group,
    col_tile,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
):
    """Byte pointers at a tile's first parameter, gradient, m code, m scale, v code and v
    scale (:func:`_tile_at`)."""
    tile = _tile_at(
        table,
        group,
        col_tile,
        P_T,
        G_T,
        MC_T,
        VC_T,
        TB,
        BS,
        FLAT,
        ALIGNED,
        M,
        V,
        SCALAR,
        False,
        True,
        False,
    )
    u8 = tl.pointer_type(tl.uint8)
    return (
        tile[0].to(u8),
        tile[1].to(u8),
        tile[2].to(u8),
        tile[3].to(u8),
        tile[4].to(u8),
        tile[5].to(u8),
    )


@triton.jit
def _tile_work(
    table,
    row_d,
    group,
    col_tile,
    inputs,
    anchor,
    state_key,
    param_key,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    CARRY: tl.constexpr,
    FULL: tl.constexpr,
    RUN: tl.constexpr,
    QUAD_LOADS: tl.constexpr,
    SPANS: tl.constexpr,
    LINE_STORES: tl.constexpr,
    RUN_ACCESSES: tl.constexpr,
):
    """:func:`adamw_tile` on a tile, with the ``inputs`` loaded ahead (``FLAT``) or
    loaded here; returns its counts (:func:`_no_counts`). The span keys of the shard's
    states and parameter (:func:`_span_keys`) come from the caller, or with ``CARRY`` are
    keyed here by each element's high index word; with ``SPANS`` they become the tile's
    span words."""
    VECTOR: tl.constexpr = HARDWARE
    RUNS: tl.constexpr = RUN_ACCESSES and FULL
    tile = _tile_at(
        table,
        group,
        col_tile,
        P_T,
        G_T,
        MC_T,
        VC_T,
        TB,
        BS,
        FLAT,
        ALIGNED,
        M,
        V,
        SCALAR,
        CARRY,
        FULL,
        SPANS,
    )
    if not FLAT:
        inputs = _load_at(tile, anchor, TB, BS, M, V, SCALAR, QUAD_LOADS, RUNS)
    p_raw, g_raw, m_raw, m_scale, v_raw, v_scale = inputs
    (
        p_ptr,
        _,
        mc_ptr,
        ms_ptr,
        vc_ptr,
        vs_ptr,
        offs,
        valid,
        block_offs,
        bvalid,
        block_bytes,
        pair_valid,
        lo_word,
        hi_word,
    ) = tile
    if CARRY:
        state_key, param_key = _span_keys(row_d, hi_word)
    if SPANS:  # hi_word: the low word of the tile's first index
        state_key, param_key = span_word(state_key, hi_word), span_word(param_key, hi_word)
    # step scalars are kept across tiles by flat launches only: block-scaled tiles need
    # those registers for their blocks
    _, _, beta1, one_minus_beta1 = _quad(row_d, 4, VECTOR, FLAT)
    beta2, one_minus_beta2, inv_bc2_sqrt, eps = _quad(row_d, 8, VECTOR, FLAT)
    step_size, decay, _, _ = _quad(row_d, 12, VECTOR, FLAT)
    return adamw_tile(
        p_raw,
        g_raw,
        m_raw,
        m_scale,
        v_raw,
        v_scale,
        p_ptr,
        mc_ptr,
        ms_ptr,
        vc_ptr,
        vs_ptr,
        offs,
        valid,
        block_offs,
        bvalid,
        block_bytes,
        pair_valid,
        lo_word,
        anchor,
        _float(beta1),
        _float(one_minus_beta1),
        _float(beta2),
        _float(one_minus_beta2),
        _float(inv_bc2_sqrt),
        _float(eps),
        _float(step_size),
        _float(decay),
        state_key,
        param_key,
        TB,
        BS,
        STEP,
        M,
        V,
        SCALAR,
        RUN,
        SPANS,
        LINE_STORES,
        RUNS,
    )


@triton.jit
def _tile_step(
    table,
    row_d,
    group,
    col_tile,
    next_group,
    next_col_tile,
    inputs,
    anchor,
    state_key,
    param_key,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    CARRY: tl.constexpr,
    RUN: tl.constexpr,
    QUAD_LOADS: tl.constexpr,
    SPANS: tl.constexpr,
    LINE_STORES: tl.constexpr,
    RUN_ACCESSES: tl.constexpr,
):
    """The fused step on one tile of the shard whose :func:`_shard_table` is ``table`` (and
    step table row ``row_d``); returns its counts and the inputs of the tile it loads
    ahead.

    Flat launches (``FLAT``) got the tile's ``inputs`` from the previous call, and load
    tile ``next_col_tile`` of row group ``next_group`` before they compute, so that its
    loads are in flight while the tile works; others load their own inputs and pass
    ``inputs`` on unchanged. A full tile (:func:`tile_is_full`) runs without masks."""
    ahead = inputs
    if FLAT:
        ahead = _load_ahead(
            table,
            next_group,
            next_col_tile,
            anchor,
            P_T,
            G_T,
            MC_T,
            VC_T,
            TB,
            BS,
            FLAT,
            ALIGNED,
            M,
            V,
            SCALAR,
            CARRY,
            QUAD_LOADS,
            RUN_ACCESSES,
        )
    full = _full(table, group, col_tile, TB, BS, FLAT)
    if full:
        tile_counts = _tile_work(
            table,
            row_d,
            group,
            col_tile,
            inputs,
            anchor,
            state_key,
            param_key,
            P_T,
            G_T,
            MC_T,
            VC_T,
            TB,
            BS,
            FLAT,
            ALIGNED,
            STEP,
            M,
            V,
            SCALAR,
            CARRY,
            True,
            RUN,
            QUAD_LOADS,
            SPANS,
            LINE_STORES,
            RUN_ACCESSES,
        )
    else:
        tile_counts = _tile_work(
            table,
            row_d,
            group,
            col_tile,
            inputs,
            anchor,
            state_key,
            param_key,
            P_T,
            G_T,
            MC_T,
            VC_T,
            TB,
            BS,
            FLAT,
            ALIGNED,
            STEP,
            M,
            V,
            SCALAR,
            CARRY,
            False,
            RUN,
            QUAD_LOADS,
            SPANS,
            LINE_STORES,
            RUN_ACCESSES,
        )
    return tile_counts, ahead


@triton.jit
def multi_adamw_kernel(
    static,
    dynamic,
    counts,
    tile_shard,
    total_tiles,
    tiles_per_program,
    P_T: tl.constexpr,
    G_T: tl.constexpr,
    MC_T: tl.constexpr,
    VC_T: tl.constexpr,
    TB: tl.constexpr,
    BS: tl.constexpr,
    FLAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SCALAR: tl.constexpr,
    WIDE: tl.constexpr,
    CARRY: tl.constexpr,
    KEEP: tl.constexpr,
    RUN: tl.constexpr,
    L2_AHEAD: tl.constexpr,
    L2_PTX: tl.constexpr,
    QUAD_LOADS: tl.constexpr,
    SPANS: tl.constexpr,
    LINE_STORES: tl.constexpr,
    RUN_ACCESSES: tl.constexpr,
):
    """Tiles [pid·n, (pid+1)·n) of the launch, shard by shard, each shard's tiles in
    row-group order; counts are added to a shard's counts row when its run ends (the health
    counts only with ``STEP.HEALTH``). ``SCALAR`` launches (scaled rows without the
    vectorised accesses, on the GPU) access one element at a time in the layout of aligned
    rows; the static table, 16-byte aligned, is their layout anchor. ``KEEP``: each shard's
    table values may stay in registers across its tiles. ``RUN_ACCESSES``: full tiles of
    ``SCALAR`` launches load a float32 parameter and gradient, and store the parameter where
    ``LINE_STORES`` does not, eight elements a thread in 8-byte pieces (:func:`load_runs`).
    ``L2_AHEAD`` > 0: each tile first asks L2 for the next tile in the program's run of the
    shard (:func:`prefetch_l2` with ``L2_PTX``). ``SPANS``: every shard's tiles start at
    multiples of their span (:func:`tile_span`), and draw through span words."""
    PACKED: tl.constexpr = packed_counts(M.KIND, V.KIND)
    anchor = static.to(tl.pointer_type(tl.uint8), bitcast=True)
    first = tl.program_id(0) * tiles_per_program
    last = tl.minimum(first + tiles_per_program, total_tiles)
    for t in range(tl.load(tile_shard + first), tl.load(tile_shard + last - 1) + 1):
        row_s = static + t * _STATIC_WIDTH
        tiles_per_row = tl.load(row_s + 8).to(tl.int32)
        shard_first = tl.load(row_s + 9)
        lo = (tl.maximum(first, shard_first) - shard_first).to(tl.int32)
        hi = (tl.minimum(last, shard_first + tl.load(row_s + 13)) - shard_first).to(tl.int32)
        group = lo // tiles_per_row
        col_tile = lo - group * tiles_per_row
        total = _no_counts(TB, BS, RUN, PACKED, STEP.HEALTH)
        row_d = dynamic + t * _DYNAMIC_WIDTH
        state_key = tl.zeros((), tl.uint32)  # with CARRY, each tile keys its elements
        param_key = tl.zeros((), tl.uint32)
        if not CARRY:  # every index of the shard has the high word of its offset
            state_key, param_key = _span_keys(row_d, (tl.load(row_s + 5) >> 32).to(tl.uint32))
        inputs = 0
        if FLAT:  # the run's first tile, loaded ahead
            inputs = _load_ahead(
                _shard_table(row_s, row_d, TB, FLAT, ALIGNED, WIDE, KEEP),
                group,
                col_tile,
                anchor,
                P_T,
                G_T,
                MC_T,
                VC_T,
                TB,
                BS,
                FLAT,
                ALIGNED,
                M,
                V,
                SCALAR,
                CARRY,
                QUAD_LOADS,
                RUN_ACCESSES,
            )
        if L2_AHEAD > 0:
            group_l2 = (lo + L2_AHEAD) // tiles_per_row
            col_l2 = lo + L2_AHEAD - group_l2 * tiles_per_row
            # tiles of the run but the shard's last: their tile-long ranges lie in the shard
            end_l2 = tl.minimum(hi, tl.load(row_s + 13).to(tl.int32) - 1) - L2_AHEAD
            first_table = _shard_table(row_s, row_d, TB, FLAT, ALIGNED, WIDE, KEEP)
            ahead = _l2_pointers(
                first_table,
                group_l2,
                col_l2,
                P_T,
                G_T,
                MC_T,
                VC_T,
                TB,
                BS,
                FLAT,
                ALIGNED,
                M,
                V,
                SCALAR,
            )
            row_steps = l2_row_steps(first_table, tiles_per_row, TB, BS, P_T, G_T, M, V)
        for i in range(lo, hi):
            table = _shard_table(row_s, row_d, TB, FLAT, ALIGNED, WIDE, KEEP)
            if L2_AHEAD > 0:
                if i < end_l2:
                    prefetch_l2(ahead, L2_PTX)
                col_l2 += 1
                wrap_l2 = col_l2 == tiles_per_row
                col_l2 = tl.where(wrap_l2, 0, col_l2)
                ahead = l2_next(ahead, wrap_l2, row_steps, P_T, G_T, TB, BS, M, V)
            col_next = col_tile + 1
            wrap = col_next == tiles_per_row
            group_next = tl.where(wrap, group + 1, group)
            col_next = tl.where(wrap, 0, col_next)
            more = i + 1 < hi  # else the tile loads itself again, and nothing uses it
            tile_counts, inputs = _tile_step(
                table,
                row_d,
                group,
                col_tile,
                tl.where(more, group_next, group),
                tl.where(more, col_next, col_tile),
                inputs,
                anchor,
                state_key,
                param_key,
                P_T,
                G_T,
                MC_T,
                VC_T,
                TB,
                BS,
                FLAT,
                ALIGNED,
                STEP,
                M,
                V,
                SCALAR,
                CARRY,
                RUN,
                QUAD_LOADS,
                SPANS,
                LINE_STORES,
                RUN_ACCESSES,
            )
            total = _add_counts(total, tile_counts, PACKED, STEP.HEALTH)
            group = group_next
            col_tile = col_next
        _flush(counts, tl.load(row_s + 10), total, PACKED, STEP.HEALTH)


def _element_type(dtype: torch.dtype):
    """Triton element type of a tensor as the kernel reads it (bfloat16 as int16 bits)."""
    return {
        torch.float32: tl.float32,
        torch.bfloat16: tl.int16,
        torch.uint8: tl.uint8,
        torch.int16: tl.int16,
    }[dtype]


def signature(item: StepItem) -> tuple:
    """What must agree for shards to share one launch."""
    p = item.plan
    return (
        item.param.dtype,
        item.grad.dtype,
        item.m.fmt.name,
        item.v.fmt.name,
        item.m.block_size,
        p.m_stochastic,
        p.v_stochastic,
        p.param_stochastic,
        item.param.device,
    )


def is_aligned(address: int) -> bool:
    """Whether an address allows the launch's vectorised (16-byte) accesses."""
    return int(address) % ALIGNMENT == 0


def wide_rows(
    shape: tuple[int, ...], fmts: tuple[Format, ...], block_size: int, tile: int | None = None
) -> bool:
    """Whether each tile of a block-scaled shard lies within one row (tiles of ``tile``
    elements; None: the default): rows over half a tile long, whose tiles hold a part of a
    row or one row masked past its end. A launch whose shards all have such rows
    compiles without the per-shard lookup of how many rows a tile holds. Unscaled states
    run flat: False."""
    _, cols, bs = tile_layout(shape, fmts, block_size)
    if not any(f.scaled for f in fmts):
        return False
    tb = tile_blocks(tile, True, bs)
    return fills_tile(row_slots(cols, bs, tb)[0], tb)


def aligned_shard(param: torch.Tensor, m: StoredState, v: StoredState) -> bool:
    """Whether a shard allows the launch's vectorised accesses: its tile rows (scaled
    states) or its length (unscaled) a multiple of 16 elements, and parameter and codes at
    16-byte addresses. One shard that does not takes the vectorisation from its launch."""
    _, cols, _ = tile_layout(tuple(param.shape), (m.fmt, v.fmt), m.block_size)
    return cols % 16 == 0 and all(is_aligned(t.data_ptr()) for t in (param, m.codes, v.codes))


# Programs of one launch that fit on a multiprocessor at once, per compiled kernel variant
# (from its register count), so that a persistent launch runs in a single wave.
_RESIDENT: dict[tuple, int] = {}
REGISTER_FILE = 65536  # 32-bit registers a multiprocessor holds (sm_80, sm_90)
REGISTER_UNIT = 256  # a warp's registers are allocated in units of this many
WARP_GRANULE = 4  # and warps in fours, one to each scheduler's quarter of the file
MAX_THREADS = 2048  # resident threads a multiprocessor holds
MAX_PROGRAMS = 32  # resident programs a multiprocessor holds


def resident_programs(n_regs: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps at ``n_regs`` registers a thread that one
    multiprocessor holds at once. Each scheduler owns a quarter of the register file, so
    the warps that fit are floored to a multiple of four: at 112 registers a thread, 18
    warps' worth of registers hold 16 warps (8 programs of 2), not 9 programs, and a launch
    sized for 9 would run a second wave."""
    per_warp = -(-max(n_regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps = REGISTER_FILE // per_warp // WARP_GRANULE * WARP_GRANULE
    return max(1, min(warps // num_warps, MAX_THREADS // (32 * num_warps), MAX_PROGRAMS))


class MultiStep:
    """The fused step over a fixed list of shards: device tables built once, one launch a step.

    ``grad_dtype`` and the rounding flags are fixed for the launch. Its
    :class:`~srtrain.kernels.launch_plan.LaunchPlan` is ``plan``, or that of
    :func:`~srtrain.kernels.launch_plan.launch_plan` for the shards (with ``tile``
    elements per tile, a power of two; None: the default); it tunes the launch only and
    never changes results. The launch runs as many programs as fit on the device at once.
    Successive steps reuse one device copy of the per-step table, so they must run on one
    CUDA stream (as an optimizer's steps do).
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        grad_dtype: torch.dtype,
        m_stochastic: bool,
        v_stochastic: bool,
        param_stochastic: bool,
        *,
        tile: int | None = None,
        plan: LaunchPlan | None = None,
    ) -> None:
        shards = [s for s in shards if s.param.numel()]
        check_tile(tile)
        if tile is not None and plan is not None:
            raise ValueError("a MultiStep takes a tile or a plan (whose tile it is), not both")
        if not (plan is None or isinstance(plan, LaunchPlan)):
            raise ValueError(f"plan must be a LaunchPlan, not {plan!r}")
        self.shards = shards
        self.shapes = [s.param.shape for s in shards]
        self.grad_dtype = grad_dtype
        self.stochastic_states = m_stochastic or v_stochastic
        if not shards:
            return
        first = shards[0]
        self.device = first.param.device
        self.device_index = first.param.get_device()  # -1 on the CPU
        m_fmt, v_fmt = first.m.fmt, first.v.fmt
        check_formats(m_fmt, v_fmt)
        for s in shards:
            if (s.param.dtype, s.m.fmt, s.v.fmt, s.m.block_size, s.v.block_size) != (
                first.param.dtype,
                m_fmt,
                v_fmt,
                first.m.block_size,
                first.m.block_size,
            ):
                raise ValueError(
                    "a multi-tensor step needs one param dtype, state format and "
                    "block size for all its shards; group them by signature()"
                )
            if s.param.device != self.device:
                raise ValueError("all shards of a multi-tensor step must be on one device")
        self.flat = not (m_fmt.scaled or v_fmt.scaled)
        self.asked = plan is not None  # a refused access of an asked plan warns
        self.plan = plan or launch_plan(
            [tuple(s.param.shape) for s in shards],
            first.param.dtype,
            grad_dtype,
            m_fmt,
            v_fmt,
            first.m.block_size,
            self.stochastic_states,
            tile=tile,
        )
        self.multiprocessors = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 1
        )
        layouts = [
            tile_layout(tuple(s.param.shape), (m_fmt, v_fmt), first.m.block_size) for s in shards
        ]
        bs = layouts[0][2]
        self.tb = max(1, self.plan.tile // bs)
        self._run_length = run_length(self.tb, bs, self.plan.num_warps)
        rows, ntiles, aligned, wide = [], [], True, not self.flat  # wide: as wide_rows()
        spans = True
        for s, (n_rows, cols, _) in zip(shards, layouts, strict=True):
            slot_bits, tiles_per_row = row_slots(cols, bs, self.tb)
            wide &= fills_tile(slot_bits, self.tb)
            span = tile_span(n_rows, cols, bs, self.tb, self.flat)
            spans &= span > 0 and s.offset % span == 0
            ntiles.append(tiles_of(n_rows, cols, bs, self.tb, self.flat))
            rows.append(
                [
                    int_view(s.param).data_ptr(),
                    s.m.codes.data_ptr(),
                    scales_or_codes(s.m).data_ptr(),
                    s.v.codes.data_ptr(),
                    scales_or_codes(s.v).data_ptr(),
                    s.offset,
                    cols,
                    triton.cdiv(cols, bs),
                    tiles_per_row,
                    0,
                    s.counts_row,
                    n_rows,
                    slot_bits,
                    ntiles[-1],
                ]
            )
            aligned &= aligned_shard(s.param, s.m, s.v)
        self.static_aligned = bool(aligned)
        self._l2_ptx = {
            aligned: tile_prefetch_ptx(
                self.tb,
                bs,
                first.param.element_size(),
                grad_dtype.itemsize,
                m_fmt,
                v_fmt,
                aligned,
                self.plan.l2_every_thread,
            )
            for aligned in (False, True)
        }
        carry = any(s.offset >> 32 != (s.offset + s.param.numel() - 1) >> 32 for s in shards)
        first_tile = np.cumsum([0, *ntiles[:-1]])
        for row, f in zip(rows, first_tile, strict=True):
            row[9] = int(f)
        self.total_tiles = int(sum(ntiles))
        self.static = torch.tensor(rows, dtype=torch.int64).to(self.device)
        self.tile_shard = torch.repeat_interleave(
            torch.arange(len(shards), dtype=torch.int32), torch.tensor(ntiles)
        ).to(self.device)
        # the step's flags but HEALTH, which each launch chooses (kernel_constexprs)
        self._flags = (
            first.param.dtype == torch.bfloat16,
            grad_dtype == torch.bfloat16,
            param_stochastic,
            m_stochastic,
            v_stochastic,
        )
        self.constexprs = dict(
            P_T=_element_type(first.param.dtype),
            G_T=_element_type(grad_dtype),
            MC_T=_element_type(int_view(first.m.codes).dtype),
            VC_T=_element_type(int_view(first.v.codes).dtype),
            TB=self.tb,
            BS=bs,
            FLAT=self.flat,
            WIDE=bool(wide),
            CARRY=carry,
            SPANS=spans and not carry,
            M=state_code(m_fmt),
            V=state_code(v_fmt),
        )
        cuda = self.device.type == "cuda"
        self._host_table = torch.zeros(
            (len(shards), DYNAMIC_COLUMNS), dtype=torch.int32, pin_memory=cuda
        )
        self._device_table = (
            torch.empty_like(self._host_table, device=self.device) if cuda else None
        )
        self._copied: torch.cuda.Event | None = None
        # (aligned, health, table address, counts address) → the compiled kernel's launcher
        # and its arguments; a compiled kernel is specialised on its arguments' alignment and
        # values
        self._launchers: dict[tuple[bool, bool, int, int], tuple] = {}

    def _staging(self) -> torch.Tensor:
        """The host buffer of the step's dynamic table, free to be written.

        On CUDA it is page-locked, so its upload neither waits for the queued work (as a
        copy from pageable memory does) nor blocks the host; the buffer is reused once the
        previous step's upload has finished.
        """
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_table

    def _upload(self, staging: torch.Tensor) -> torch.Tensor:
        """The dynamic table on the launch's device, copied from ``staging``."""
        if self.device.type != "cuda":  # the interpreter runs the launch before returning
            return staging
        self._device_table.copy_(staging, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return self._device_table

    def kernel_constexprs(self, aligned: bool, health: bool = True) -> dict:
        """The kernel's compile-time arguments for a launch on rows with the vectorised
        accesses (``aligned``) or without, counting the health counts or not (``health``)."""
        access = self.plan.access(aligned)
        return dict(
            STEP=StepFlags(*self._flags, health),
            ALIGNED=aligned,
            SCALAR=access.scalar,
            KEEP=access.keep_table,
            RUN=self._run_length,
            L2_AHEAD=int(access.l2_ahead),
            L2_PTX=self._l2_ptx[aligned],
            QUAD_LOADS=access.quad_loads,
            LINE_STORES=access.line_stores,
            RUN_ACCESSES=access.run_accesses,
            **self.constexprs,
        )

    def _programs(self, variant: tuple) -> int:
        total = self.total_tiles
        if interpreted() or self.device.type != "cuda":
            programs = min(total, 4)
        else:
            per_sm = _RESIDENT.get(variant, 2)
            programs = min(total, per_sm * self.multiprocessors)
        # a program's per-thread counts, summed over its threads in 32 bits, stay below 2**31
        tile_elements = self.tb * self.constexprs["BS"]
        most = min(MAX_TILES_PER_PROGRAM, (2**31 - 1) // tile_elements)
        return max(programs, triton.cdiv(total, most))

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Raise, naming the first mismatch, unless each gradient has its shard's shape and the
        launch's dtype and device."""
        shapes = [g.shape for g in grads]
        if (
            shapes == self.shapes
            and {g.dtype for g in grads} == {self.grad_dtype}
            and {g.get_device() for g in grads} == {self.device_index}
        ):
            return
        for i, (g, shape) in enumerate(zip(grads, self.shapes, strict=True)):
            if (g.dtype, g.shape, g.device) != (self.grad_dtype, shape, self.device):
                raise ValueError(
                    f"gradient {i} is {g.dtype} {tuple(g.shape)} on {g.device}; the step needs "
                    f"{self.grad_dtype} {tuple(shape)} on {self.device}"
                )

    def launch(
        self,
        grads: Sequence[torch.Tensor],
        keys: np.ndarray,
        floats: np.ndarray,
        counts: torch.Tensor,
        health: bool = True,
    ) -> None:
        """One step: ``grads`` per shard, ``keys`` [n, 3] (k0, k1 of the states, k1 of the
        param) as unsigned 32-bit words, ``floats`` [n, 8] the AdamWScalars in field order;
        counts are added to ``counts[shard.counts_row]``, the health counts only with
        ``health`` (as :func:`~srtrain.numerics.adamw.adamw_step_reference` adds them)."""
        if self.shards:
            self.run(self.stage(grads, keys, floats), counts, health)

    def stage(
        self, grads: Sequence[torch.Tensor], keys: np.ndarray, floats: np.ndarray
    ) -> StagedStep:
        """The host half of :meth:`launch`: check the gradients and upload the step's table.
        On CUDA the upload is queued on the current stream, so it can run ahead of the
        kernels still producing the gradients; stage again before the next run."""
        n = len(self.shards)
        if len(grads) != n or keys.shape != (n, KEY_COLUMNS) or floats.shape != (n, 8):
            raise ValueError(f"a step over {n} shards needs {n} gradients, keys and scalars")
        contiguous = (
            list(grads)
            if all(map(torch.Tensor.is_contiguous, grads))
            else [g if g.is_contiguous() else g.contiguous() for g in grads]
        )
        self._check_grads(contiguous)
        addresses = np.fromiter(map(torch.Tensor.data_ptr, contiguous), dtype=np.uint64, count=n)
        aligned = self.static_aligned and not (addresses % ALIGNMENT).any()
        staging = self._staging()
        table = staging.numpy()
        table[:, 0:2] = addresses.view(np.int32).reshape(n, 2)
        words = np.asarray(keys, dtype=np.uint64).astype(np.uint32)
        table[:, 2 : 2 + KEY_COLUMNS] = words.view(np.int32)
        table[:, 6:14] = np.asarray(floats, dtype=np.float32).view(np.int32)
        return StagedStep(self._upload(staging), bool(aligned), contiguous)

    def run(self, staged: StagedStep, counts: torch.Tensor, health: bool = True) -> None:
        """The kernel half of :meth:`launch`: one launch over the staged table, adding to
        ``counts[shard.counts_row]`` (the health counts only with ``health``, which selects
        one of two compiled kernels: without, the kernel holds no trace of them).

        On the GPU each launch is compiled (or found compiled) before it runs, so that a
        kernel with 16-byte PTX loads is checked first (:func:`quads_in_order`; one that
        fails launches without them, after a warning where the plan was given; small tiles
        give such layouts), and so is one with run accesses (:func:`runs_in_order`), and a
        launch whose table, counts and alignment were launched before calls the kernel that
        launch compiled with the same arguments, skipping Triton's argument binding and
        cache lookup."""
        if counts.dtype != torch.int64 or counts.dim() != 2 or counts.shape[1] != NUM_COUNTS:
            raise ValueError(f"counts must be an int64 tensor of shape [parameters, {NUM_COUNTS}]")
        dynamic, aligned = staged.table, staged.aligned
        known = (aligned, health, dynamic.data_ptr(), counts.data_ptr())
        ready = self._launchers.get(known)
        if ready is not None:
            launcher, args = ready
            launcher(*args)
            return
        plan = self.plan
        registers = plan.max_registers
        cap = {} if interpreted() or registers is None else {"maxnreg": registers}
        constexprs = self.kernel_constexprs(aligned, health)
        variant = (plan.num_warps, registers, tuple(constexprs.items()))  # one compiled kernel
        settled = variant in _RESIDENT  # the program count no longer changes
        per_program = triton.cdiv(self.total_tiles, self._programs(variant))
        grid = (triton.cdiv(self.total_tiles, per_program),)
        args = dict(
            static=self.static,
            dynamic=dynamic,
            counts=counts,
            tile_shard=self.tile_shard,
            total_tiles=self.total_tiles,
            tiles_per_program=per_program,
            **constexprs,
        )
        options = dict(num_warps=plan.num_warps, enable_fp_fusion=False, **cap)
        if self.device.type != "cuda" or interpreted():
            multi_adamw_kernel[grid](**args, **options)
            return
        compiled = multi_adamw_kernel.warmup(**args, grid=grid, **options)  # not launched
        ttgir = compiled.asm["ttgir"]
        if constexprs["QUAD_LOADS"] and not quads_in_order(ttgir):
            if self.asked:
                warnings.warn(
                    "the fused step's compiled layout does not hold its float32 "
                    "parameter in runs of four elements a thread; it launches with "
                    "quad_loads=False (tl.load)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.plan = without(plan, True, "quad_loads")
            self.run(staged, counts, health)
            return
        if constexprs["RUN_ACCESSES"] and not runs_in_order(ttgir):
            if self.asked:
                warnings.warn(
                    "the fused step's compiled layout does not hold its float32 "
                    "parameter in runs of eight elements a thread; it launches with "
                    "run_accesses=False",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.plan = without(plan, False, "run_accesses")
            self.run(staged, counts, health)
            return
        launcher = compiled[(grid[0], 1, 1)]
        positional = tuple(args[name] for name in multi_adamw_kernel.arg_names)
        launcher(*positional)
        if settled:
            self._launchers[known] = (launcher, positional)
        else:
            _RESIDENT[variant] = resident_programs(compiled.n_regs, plan.num_warps)


_BLOCKED = re.compile(
    r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
    r"threadsPerWarp = \[[\d, ]+\], warpsPerCTA = \[[\d, ]+\], "
    r"order = \[([\d, ]+)\]",
    re.MULTILINE,
)


def packs_in_order(ttgir: str, asms: tuple[str, ...], pack: int) -> bool:
    """Whether a compiled kernel's TritonGPU IR holds PTX accesses of ``asms`` and each
    packs ``pack`` consecutive elements: every tensor it takes or gives is laid out blocked,
    with its last dimension first in order and a multiple of ``pack`` elements of it a
    thread (its packed elements are then consecutive elements of one row)."""
    runs = {}
    for name, per_thread, order in _BLOCKED.findall(ttgir):
        sizes = [int(x) for x in per_thread.split(",")]
        first = int(order.split(",")[0])
        runs[name] = first == len(sizes) - 1 and sizes[-1] % pack == 0
    accesses = [
        line
        for line in ttgir.splitlines()
        if "tt.elementwise_inline_asm" in line and any(asm in line for asm in asms)
    ]
    for line in accesses:
        types = line.split(f"packed_element = {pack}")[-1].split(" loc(")[0]
        layouts = re.findall(r"tensor<[^>]*?, (#[\w.]+)", types)
        if not layouts or not all(runs.get(layout, False) for layout in layouts):
            return False
    return bool(accesses)


def quads_in_order(ttgir: str) -> bool:
    """:func:`packs_in_order` for the 16-byte loads of
    :func:`~srtrain.kernels.memory.load_quads`, four elements each."""
    return packs_in_order(ttgir, (LOAD4.value,), 4)


def runs_in_order(ttgir: str) -> bool:
    """:func:`packs_in_order` for the run accesses of
    :func:`~srtrain.kernels.memory.load_runs` and
    :func:`~srtrain.kernels.memory.store_runs`, eight elements each."""
    return packs_in_order(ttgir, (run_access_ptx(False), run_access_ptx(True)), 8)


@dataclass
class StagedStep:
    """A step's uploaded table, whether its gradients allow the vectorised accesses, and the
    gradients it points at (kept alive until the launch)."""

    table: torch.Tensor
    aligned: bool
    grads: list[torch.Tensor]


def shards_plan(
    shards: Sequence[Shard],
    grad_dtype: torch.dtype,
    stochastic: bool,
    *,
    tile: int | None = None,
    **choices,
) -> LaunchPlan:
    """:func:`~srtrain.kernels.launch_plan.launch_plan` of a launch over ``shards`` (one
    dtype, format pair and block size; states rounded stochastically or not), with
    ``tile`` and ``choices`` in place of its own."""
    shards = [s for s in shards if s.param.numel()]
    first = shards[0]
    return launch_plan(
        [tuple(s.param.shape) for s in shards],
        first.param.dtype,
        grad_dtype,
        first.m.fmt,
        first.v.fmt,
        first.m.block_size,
        stochastic,
        tile=tile,
        **choices,
    )


def step_tables(items: Sequence[StepItem]) -> tuple[np.ndarray, np.ndarray]:
    """The keys [n, 3] and scalars [n, 8] of ``items`` as :meth:`MultiStep.launch` takes them."""
    keys = np.array(
        [[i.plan.key_states[0], i.plan.key_states[1], i.plan.key_param[1]] for i in items],
        dtype=np.uint64,
    ).reshape(len(items), KEY_COLUMNS)
    floats = np.array([i.scalars.row() for i in items], dtype=np.float32)
    return keys, floats.reshape(len(items), 8)


def fused_adamw_multi_triton(
    items: Sequence[StepItem],
    counts: torch.Tensor,
    *,
    health: bool = True,
    tile: int | None = None,
    plan: LaunchPlan | None = None,
) -> None:
    """One launch of the fused step over ``items``, adding to ``counts[item.counts_row]``
    (the health counts only with ``health``), with :class:`MultiStep`'s ``tile`` or
    ``plan``."""
    items = [i for i in items if i.param.numel()]
    if not items:
        return
    first = items[0]
    if any(signature(i) != signature(first) for i in items):
        raise ValueError(
            "a multi-tensor step needs one dtype, format, block size and rounding "
            "for all its shards; group them by signature()"
        )
    if counts.dtype != torch.int64 or counts.dim() != 2 or counts.shape[1] != NUM_COUNTS:
        raise ValueError(f"counts must be an int64 tensor of shape [parameters, {NUM_COUNTS}]")
    for item in items:
        check_step_inputs(item.param, item.grad, item.m, item.v, counts[item.counts_row])
        if item.plan.key_states[0] != item.plan.key_param[0]:
            raise ValueError("the keys of one step must share their first word (see rng_key)")
    rounding = first.plan
    step = MultiStep(
        [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items],
        first.grad.dtype,
        rounding.m_stochastic,
        rounding.v_stochastic,
        rounding.param_stochastic,
        tile=tile,
        plan=plan,
    )
    step.launch([i.grad for i in items], *step_tables(items), counts, health)


def fused_adamw_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: StoredState,
    v: StoredState,
    scalars: AdamWScalars,
    plan: RoundingPlan,
    offset: int,
    counts: torch.Tensor,
    health: bool = True,
    *,
    tile: int | None = None,
    launch_plan: LaunchPlan | None = None,
) -> None:
    """Triton twin of :func:`srtrain.numerics.adamw.adamw_step_reference` (same arguments),
    with :class:`MultiStep`'s ``tile`` or plan (``launch_plan``)."""
    check_step_inputs(param, grad, m, v, counts)
    if m.block_size != v.block_size:
        raise ValueError("m and v must share one block size")
    fused_adamw_multi_triton(
        [StepItem(param, grad, m, v, scalars, plan, offset, 0)],
        counts.view(1, NUM_COUNTS),
        health=health,
        tile=tile,
        plan=launch_plan,
    )
