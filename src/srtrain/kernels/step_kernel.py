"""The fused AdamW step's kernel: one program walks contiguous runs of tiles, shard by shard.

:func:`multi_adamw_kernel` reads each shard's addresses and sizes from a static table
(:data:`STATIC_COLUMNS` int64 a row) and its gradient address, keys and scalars from the
step's table (:data:`DYNAMIC_COLUMNS` int32 a row); a shard's table rows are read once, its
tiles follow in row-group order, and each thread's counts stay in registers until they are
added to the shard's row of the counts buffer. Each tile computes exactly what
:func:`srtrain.numerics.adamw.adamw_step_reference` computes for its shard, bit for bit
(:func:`~srtrain.kernels.tile.adamw_tile`). The host side is :mod:`srtrain.kernels.launch`.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from srtrain.kernels.memory import codes_base, l2_next, l2_row_steps, prefetch_l2
from srtrain.kernels.tile import (
    RowLayout,
    StepScalars,
    TileDraws,
    TilePointers,
    adamw_tile,
    load_tile,
    packed_counts,
    shard_tile,
    tile_is_full,
)
from srtrain.kernels.triton_numerics import (
    HARDWARE,
    flat_index_words,
    is_finite,
    span_key,
    span_word,
    tile_index_words,
)
from srtrain.numerics.adamw import NUM_COUNTS

STATIC_COLUMNS = 14  # param, m codes, m scales, v codes, v scales, offset, cols, blocks/row,
#                      tiles/row, first tile, counts row, rows, slot bits, tiles (int64)
DYNAMIC_COLUMNS = 16  # grad address (2 words), k0, k1 of the states and of the param, 1 unused,
#                       8 float32 scalars, the gate's address (2 words; gated steps only, else
#                       unused) (int32; 64-byte rows, read 16 bytes at a time)
GATE_COLUMN = 14  # the first word of the gate's int64 address (little-endian, 8-byte aligned)
_STATIC_WIDTH = tl.constexpr(STATIC_COLUMNS)
_DYNAMIC_WIDTH = tl.constexpr(DYNAMIC_COLUMNS)
_NUM_COUNTS = tl.constexpr(NUM_COUNTS)
_GATE_COLUMN = tl.constexpr(GATE_COLUMN)


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


class ShardTable(NamedTuple):
    """A shard's addresses (int64) and row layout as :func:`_shard_table` reads them from its
    table rows: parameter, gradient, m codes, m scales, v codes and v scales (an unscaled
    state's scales: its codes), the global index of its first element, and its
    :class:`~srtrain.kernels.tile.RowLayout`."""

    p_address: tl.tensor
    g_address: tl.tensor
    mc_address: tl.tensor
    ms_address: tl.tensor
    vc_address: tl.tensor
    vs_address: tl.tensor
    offset: tl.tensor
    layout: RowLayout


@triton.jit
def _shard_table(row_s, row_d, SHAPE: tl.constexpr, ACCESS: tl.constexpr):
    """The :class:`ShardTable` of the shard whose table rows are ``row_s`` (static) and
    ``row_d`` (this step's); ``SHAPE.WIDE`` promises rows at least a tile wide (a tile is
    part of one row: no slot bits to read). On the GPU the rows are read in 16-byte loads.
    With ``ACCESS.keep_table`` the compiler may keep their values in registers across the
    shard's tiles; without, they are read again every tile, so that their values live only
    as long as the tile's work needs them."""
    VECTOR: tl.constexpr = HARDWARE
    KEEP: tl.constexpr = ACCESS.keep_table
    p_address, mc_address = _pair(row_s, 0, VECTOR, KEEP)
    ms_address, vc_address = _pair(row_s, 2, VECTOR, KEEP)
    vs_address, offset = _pair(row_s, 4, VECTOR, KEEP)
    cols, blocks_per_row = _pair(row_s, 6, VECTOR, KEEP)
    _, rows = _pair(row_s, 10, VECTOR, KEEP)
    if SHAPE.WIDE:
        slot_bits = SHAPE.TB.bit_length() - 1
    else:
        slot_bits, _ = _pair(row_s, 12, VECTOR, KEEP)
        slot_bits = slot_bits.to(tl.int32)
    g_lo, g_hi, _, _ = _quad(row_d, 0, VECTOR, KEEP)
    g_address = g_lo.to(tl.uint32, bitcast=True).to(tl.int64) | (g_hi.to(tl.int64) << 32)
    if SHAPE.FLAT:
        row_bytes = 0
    else:
        cols = cols.to(tl.int32)
        if SHAPE.ALIGNED:
            cols = tl.multiple_of(cols, 16)
            row_bytes = tl.multiple_of(cols // 2, 8)
        else:
            row_bytes = (cols + 1) // 2
    blocks_per_row = blocks_per_row.to(tl.int32)
    rows = rows.to(tl.int32)
    return ShardTable(
        p_address,
        g_address,
        mc_address,
        ms_address,
        vc_address,
        vs_address,
        offset,
        RowLayout(rows, cols, slot_bits, blocks_per_row, row_bytes),
    )


@triton.jit
def _step_scalars(row_d, KEEP: tl.constexpr):
    """The :class:`~srtrain.kernels.tile.StepScalars` of a shard from its step table row
    ``row_d`` (16-byte loads on the GPU; ``KEEP``: the compiler may keep them in registers
    across the shard's tiles)."""
    VECTOR: tl.constexpr = HARDWARE
    _, _, beta1, one_minus_beta1 = _quad(row_d, 4, VECTOR, KEEP)
    beta2, one_minus_beta2, inv_bc2_sqrt, eps = _quad(row_d, 8, VECTOR, KEEP)
    step_size, decay, _, _ = _quad(row_d, 12, VECTOR, KEEP)
    return StepScalars(
        _float(beta1),
        _float(one_minus_beta1),
        _float(beta2),
        _float(one_minus_beta2),
        _float(inv_bc2_sqrt),
        _float(eps),
        _float(step_size),
        _float(decay),
    )


@triton.jit
def _gate(row_d):
    """The float32 gate of a gated step's shard whose step table row is ``row_d`` (read from
    the address in its words 14-15), and whether it is finite: a non-finite gate skips the
    shard."""
    address = tl.load((row_d + _GATE_COLUMN).to(tl.pointer_type(tl.int64), bitcast=True))
    gate = tl.load(address.to(tl.pointer_type(tl.float32)))
    return gate, is_finite(gate)


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
def _index_words(index, offs, SHAPE: tl.constexpr):
    """The global index words (low, high; uint32) of a tile's elements at offsets ``offs``
    from global index ``index``. Without ``SHAPE.CARRY`` no shard's global indices cross a
    multiple of 2**32 (one high index word per tile); with ``SHAPE.SPANS`` tiles start at
    multiples of their span (:func:`~srtrain.kernels.layout.tile_span`): the words are then
    the elements' offsets in the tile and the low word of its first index."""
    if SHAPE.CARRY:
        lo_word, hi_word = flat_index_words(index, offs)
    elif SHAPE.SPANS:
        lo_word, hi_word = offs.to(tl.uint32), (index & 0xFFFFFFFF).to(tl.uint32)
    else:
        lo_word, hi_word = tile_index_words(index, offs)
    return lo_word, hi_word


@triton.jit
def _pointers(
    table, start, start_bytes, first_block, SHAPE: tl.constexpr, M: tl.constexpr, V: tl.constexpr
):
    """The :class:`~srtrain.kernels.tile.TilePointers` of a tile of the shard whose
    :class:`ShardTable` is ``table``, from its first element, first FP4 byte and first
    block."""
    u8 = tl.pointer_type(tl.uint8)
    return TilePointers(
        _pointer(table.p_address, SHAPE.P_T, SHAPE.ALIGNED) + start,
        _pointer(table.g_address, SHAPE.G_T, SHAPE.ALIGNED) + start,
        codes_base(
            _pointer(table.mc_address, SHAPE.MC_T, SHAPE.ALIGNED), start, start_bytes, M.BITS
        ),
        table.ms_address.to(u8) + first_block,
        codes_base(
            _pointer(table.vc_address, SHAPE.VC_T, SHAPE.ALIGNED), start, start_bytes, V.BITS
        ),
        table.vs_address.to(u8) + first_block,
    )


@triton.jit
def _tile_at(
    table,
    tile,
    SHAPE: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
    FULL: tl.constexpr,
):
    """The :class:`~srtrain.kernels.tile.TilePointers`, the
    :class:`~srtrain.kernels.tile.TileGeometry` (:func:`shard_tile`) and the global index
    words (:func:`_index_words`) of tile ``tile`` (row group, column tile) of the shard
    whose :class:`ShardTable` is ``table``."""
    group, col_tile = tile
    start, start_bytes, first_block, geometry = shard_tile(
        group,
        col_tile,
        table.layout,
        SHAPE.TB,
        SHAPE.BS,
        SHAPE.FLAT,
        SHAPE.ALIGNED,
        ACCESS.scalar,
        FULL,
    )
    words = _index_words(table.offset + start, geometry.offs, SHAPE)
    return _pointers(table, start, start_bytes, first_block, SHAPE, M, V), geometry, words


@triton.jit
def _full(table, tile, SHAPE: tl.constexpr):
    """:func:`tile_is_full` of tile ``tile`` (row group, column tile) of the shard whose
    :class:`ShardTable` is ``table``."""
    group, col_tile = tile
    return tile_is_full(group, col_tile, table.layout, SHAPE.TB, SHAPE.BS, SHAPE.FLAT)


@triton.jit
def _load_at(
    table,
    tile,
    anchor,
    SHAPE: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
    FULL: tl.constexpr,
):
    """:func:`load_tile` of tile ``tile`` (row group, column tile) of the shard whose
    :class:`ShardTable` is ``table``."""
    pointers, geometry, _ = _tile_at(table, tile, SHAPE, M, V, ACCESS, FULL)
    return load_tile(pointers, geometry, anchor, SHAPE, M, V, ACCESS, FULL)


@triton.jit
def _load_ahead(
    table, tile, anchor, SHAPE: tl.constexpr, M: tl.constexpr, V: tl.constexpr, ACCESS: tl.constexpr
):
    """:func:`_load_at` of a tile, without masks when it is full (and with
    ``ACCESS.run_accesses``, by runs)."""
    full = _full(table, tile, SHAPE)
    if full:  # loaded in each branch: the full tile's masks stay constants
        inputs = _load_at(table, tile, anchor, SHAPE, M, V, ACCESS, True)
    else:
        inputs = _load_at(table, tile, anchor, SHAPE, M, V, ACCESS, False)
    return inputs


@triton.jit
def _l2_pointers(
    table, tile, SHAPE: tl.constexpr, M: tl.constexpr, V: tl.constexpr, ACCESS: tl.constexpr
):
    """Byte pointers at a tile's first parameter, gradient, m code, m scale, v code and v
    scale (:func:`_pointers`)."""
    group, col_tile = tile
    start, start_bytes, first_block, _ = shard_tile(
        group,
        col_tile,
        table.layout,
        SHAPE.TB,
        SHAPE.BS,
        SHAPE.FLAT,
        SHAPE.ALIGNED,
        ACCESS.scalar,
        True,
    )
    pointers = _pointers(table, start, start_bytes, first_block, SHAPE, M, V)
    u8 = tl.pointer_type(tl.uint8)
    return (
        pointers.p.to(u8),
        pointers.g.to(u8),
        pointers.m_codes.to(u8),
        pointers.m_scales.to(u8),
        pointers.v_codes.to(u8),
        pointers.v_scales.to(u8),
    )


@triton.jit
def _tile_work(
    table,
    row_d,
    tile,
    inputs,
    anchor,
    keys,
    gate,
    SHAPE: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
    FULL: tl.constexpr,
):
    """:func:`adamw_tile` on tile ``tile`` (row group, column tile), with the ``inputs``
    loaded ahead (``SHAPE.FLAT``) or loaded here; returns its counts (:func:`_no_counts`).
    The span keys of the shard's states and parameter (``keys``, :func:`_span_keys`) come
    from the caller, or with ``SHAPE.CARRY`` are keyed here by each element's high index
    word; with ``SHAPE.SPANS`` they become the tile's span words. ``gate``: the shard's
    finite gate with ``STEP.GATED`` (:func:`_gate`), else unused."""
    pointers, geometry, words = _tile_at(table, tile, SHAPE, M, V, ACCESS, FULL)
    if not SHAPE.FLAT:
        inputs = load_tile(pointers, geometry, anchor, SHAPE, M, V, ACCESS, FULL)
    lo_word, hi_word = words
    state_key, param_key = keys
    if SHAPE.CARRY:
        state_key, param_key = _span_keys(row_d, hi_word)
    if SHAPE.SPANS:  # hi_word: the low word of the tile's first index
        state_key, param_key = span_word(state_key, hi_word), span_word(param_key, hi_word)
    # step scalars are kept across tiles by flat launches only: block-scaled tiles need
    # those registers for their blocks
    scalars = _step_scalars(row_d, SHAPE.FLAT)
    return adamw_tile(
        inputs,
        pointers,
        geometry,
        TileDraws(lo_word, state_key, param_key),
        anchor,
        scalars,
        gate,
        SHAPE,
        STEP,
        M,
        V,
        ACCESS,
        FULL,
    )


@triton.jit
def _tile_step(
    table,
    row_d,
    tile,
    next_tile,
    inputs,
    anchor,
    keys,
    gate,
    SHAPE: tl.constexpr,
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    ACCESS: tl.constexpr,
):
    """The fused step on tile ``tile`` (row group, column tile) of the shard whose
    :class:`ShardTable` is ``table`` (and step table row ``row_d``); returns its counts and
    the inputs of the tile it loads ahead.

    Flat launches (``SHAPE.FLAT``) got the tile's ``inputs`` from the previous call, and
    load tile ``next_tile`` before they compute, so that its loads are in flight while the
    tile works; others load their own inputs and pass ``inputs`` on unchanged. A full tile
    (:func:`tile_is_full`) runs without masks."""
    ahead = inputs
    if SHAPE.FLAT:
        ahead = _load_ahead(table, next_tile, anchor, SHAPE, M, V, ACCESS)
    full = _full(table, tile, SHAPE)
    if full:
        tile_counts = _tile_work(
            table, row_d, tile, inputs, anchor, keys, gate, SHAPE, STEP, M, V, ACCESS, True
        )
    else:
        tile_counts = _tile_work(
            table, row_d, tile, inputs, anchor, keys, gate, SHAPE, STEP, M, V, ACCESS, False
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
    STEP: tl.constexpr,
    M: tl.constexpr,
    V: tl.constexpr,
    SHAPE: tl.constexpr,
    ACCESS: tl.constexpr,
    L2_PTX: tl.constexpr,
):
    """Tiles [pid·n, (pid+1)·n) of the launch, shard by shard, each shard's tiles in
    row-group order; counts are added to a shard's counts row when its run ends (the health
    counts only with ``STEP.HEALTH``). With ``STEP.GATED`` each shard's gate (:func:`_gate`)
    is read once: a finite one multiplies its gradients, a non-finite one gives the shard no
    tiles (nothing is stored or counted). ``SHAPE`` is the launch's
    :class:`~srtrain.kernels.tile.TileShape`, ``ACCESS`` its
    :class:`~srtrain.kernels.launch_plan.Access`: ``scalar`` launches (scaled rows without
    the vectorised accesses, on the GPU) access one element at a time in the layout of
    aligned rows, and the static table, 16-byte aligned, is their layout anchor;
    ``keep_table``: each shard's table values may stay in registers across its tiles;
    ``run_accesses``: full tiles of ``scalar`` launches load a float32 parameter and
    gradient, and store the parameter where ``line_stores`` does not, eight elements a
    thread in 8-byte pieces (:func:`load_runs`); ``l2_ahead`` > 0: each tile first asks L2
    for the next tile in the program's run of the shard (:func:`prefetch_l2` with
    ``L2_PTX``)."""
    PACKED: tl.constexpr = packed_counts(M.KIND, V.KIND)
    L2_AHEAD: tl.constexpr = ACCESS.l2_ahead
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
        total = _no_counts(SHAPE.TB, SHAPE.BS, SHAPE.RUN, PACKED, STEP.HEALTH)
        row_d = dynamic + t * _DYNAMIC_WIDTH
        gate = 0.0
        if STEP.GATED:
            gate, finite = _gate(row_d)
            hi = tl.where(finite, hi, lo)  # a closed gate: no tiles
        state_key = tl.zeros((), tl.uint32)  # with CARRY, each tile keys its elements
        param_key = tl.zeros((), tl.uint32)
        if not SHAPE.CARRY:  # every index of the shard has the high word of its offset
            state_key, param_key = _span_keys(row_d, (tl.load(row_s + 5) >> 32).to(tl.uint32))
        inputs = 0
        if SHAPE.FLAT:  # the run's first tile, loaded ahead
            inputs = _load_ahead(
                _shard_table(row_s, row_d, SHAPE, ACCESS),
                (group, col_tile),
                anchor,
                SHAPE,
                M,
                V,
                ACCESS,
            )
        if L2_AHEAD > 0:
            group_l2 = (lo + L2_AHEAD) // tiles_per_row
            col_l2 = lo + L2_AHEAD - group_l2 * tiles_per_row
            # tiles of the run but the shard's last: their tile-long ranges lie in the shard
            end_l2 = tl.minimum(hi, tl.load(row_s + 13).to(tl.int32) - 1) - L2_AHEAD
            first_table = _shard_table(row_s, row_d, SHAPE, ACCESS)
            ahead = _l2_pointers(first_table, (group_l2, col_l2), SHAPE, M, V, ACCESS)
            row_steps = l2_row_steps(first_table, tiles_per_row, SHAPE, M, V)
        for i in range(lo, hi):
            table = _shard_table(row_s, row_d, SHAPE, ACCESS)
            if L2_AHEAD > 0:
                if i < end_l2:
                    prefetch_l2(ahead, L2_PTX)
                col_l2 += 1
                wrap_l2 = col_l2 == tiles_per_row
                col_l2 = tl.where(wrap_l2, 0, col_l2)
                ahead = l2_next(ahead, wrap_l2, row_steps, SHAPE, M, V)
            col_next = col_tile + 1
            wrap = col_next == tiles_per_row
            group_next = tl.where(wrap, group + 1, group)
            col_next = tl.where(wrap, 0, col_next)
            more = i + 1 < hi  # else the tile loads itself again, and nothing uses it
            tile_counts, inputs = _tile_step(
                table,
                row_d,
                (group, col_tile),
                (tl.where(more, group_next, group), tl.where(more, col_next, col_tile)),
                inputs,
                anchor,
                (state_key, param_key),
                gate,
                SHAPE,
                STEP,
                M,
                V,
                ACCESS,
            )
            total = _add_counts(total, tile_counts, PACKED, STEP.HEALTH)
            group = group_next
            col_tile = col_next
        _flush(counts, tl.load(row_s + 10), total, PACKED, STEP.HEALTH)
