"""Memory accesses of the fused step: predicated stores, 16-byte quad loads and 8-byte run
accesses of float32 values, the layout anchor of element-wise accesses, pointers into
packed codes, and the L2 prefetch of the tile ahead (its PTX, and the pointers of the
next tile, which the launch in :mod:`srtrain.kernels.launch` carries along)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from srtrain.numerics.formats import Format
from srtrain.numerics.rounding import StoredState


@triton.jit
def codes_base(codes_ptr, start, start_bytes, BITS: tl.constexpr):
    """Pointer to a row tile's first code (element ``start``, or FP4 byte ``start_bytes``)."""
    if BITS == 4:
        return codes_ptr + start_bytes
    return codes_ptr + start


# a predicated store of an element's low 8, 16 or 32 bits
_STORE_PTX = "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b%d [$1], $2; mov.b32 $0, 0; }"
STORE_B8, STORE_B16, STORE_B32 = (tl.constexpr(_STORE_PTX % bits) for bits in (8, 16, 32))


@triton.jit
def store_tile(pointers, values, mask, PTX: tl.constexpr):
    """tl.store of float32, int16 or uint8 ``values``, or with ``PTX`` one predicated PTX
    store per element from the thread that holds it. The tensor then keeps its layout: a
    [TB, 1] block tensor's threads store their block's byte in place, and an unaligned tile
    is not moved to one element per thread (see :func:`layout_anchor`)."""
    if PTX:
        if values.dtype == tl.float32:
            bits = values.to(tl.int32, bitcast=True)
            asm: tl.constexpr = STORE_B32
        elif values.dtype == tl.int16:
            bits = values.to(tl.int32)
            asm: tl.constexpr = STORE_B16
        else:
            bits = values.to(tl.int32)
            asm: tl.constexpr = STORE_B8
        tl.inline_asm_elementwise(
            asm,
            "=r,l,r,r",
            [pointers, bits, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(pointers, values, mask=mask)


# 16 bytes, four consecutive 32-bit elements, loaded (0 where not loaded) by the thread that
# holds them where the first element's mask is set (see load_quads)
LOAD4 = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $8, 0; mov.b32 $0, 0; mov.b32 $1, 0; "
    "mov.b32 $2, 0; mov.b32 $3, 0; @p ld.global.v4.b32 {$0, $1, $2, $3}, [$4]; }"
)


@triton.jit
def load_quads(pointers, mask):
    """float32 values at ``pointers``, 0 where not ``mask``, by one 16-byte PTX load for
    each four consecutive elements a thread holds.

    The caller promises 16-byte aligned groups of four elements whose mask is their first
    element's (aligned launches: masks hold over 16-element runs) and a layout that gives
    each thread runs of four (:func:`~srtrain.kernels.launch.quads_in_order` checks
    the compiled kernel). As inline assembly the load leaves the tile's layout to the other
    accesses: FP4 byte pairs give eight elements a thread where a tl.load of float32 asks
    for four, and the compiler converts the new moments, the parameter and the counts
    between the two through shared memory, with barriers.
    """
    return tl.inline_asm_elementwise(
        LOAD4,
        "=r,=r,=r,=r,l,l,l,l,r,r,r,r",
        [pointers, mask.to(tl.int32)],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


RUN_LOAD_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["l"] * 8))
RUN_STORE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["l"] * 8 + ["r"] * 8))


@triton.constexpr_function
def run_pieces(place: int) -> tuple[tuple[int, int], ...]:
    """How a run of eight consecutive 32-bit elements whose first byte lies ``place`` (0 or
    4) bytes into an 8-byte window splits into aligned accesses: (first element, elements)
    of each, two elements 8-byte aligned or one."""
    if place == 0:
        return ((0, 2), (2, 2), (4, 2), (6, 2))
    return ((0, 1), (1, 2), (3, 2), (5, 2), (7, 1))


@triton.constexpr_function
def run_access_ptx(store: bool) -> str:
    """PTX loading (outputs $0-$7, pointers $8-$15) or storing (outputs $0-$7 set to 0,
    pointers $8-$15, values $16-$23) a thread's run of eight consecutive 32-bit elements
    from any 4-byte aligned place in 8-byte accesses where the elements allow
    (:func:`run_pieces`). The run's place picks a branch, which ptxas turns into accesses
    predicated on it (sm_90): no branch splits a warp whose runs lie differently."""

    def access(first: int, count: int) -> str:
        width = ".v2" if count == 2 else ""
        regs = ", ".join(f"${(16 if store else 0) + first + i}" for i in range(count))
        regs = "{" + regs + "}" if count == 2 else regs
        address = f"[$8+{4 * first}]"
        return (
            f"st.global{width}.b32 {address}, {regs}; "
            if store
            else f"ld.global{width}.b32 {regs}, {address}; "
        )

    zeros = "".join(f"mov.b32 ${i}, 0; " for i in range(8)) if store else ""
    return (
        "{ .reg .pred p; .reg .b32 s; cvt.u32.u64 s, $8; and.b32 s, s, 4; "
        "setp.eq.u32 p, s, 0; @p bra RUN_EVEN_${:uid}; "
        + "".join(access(*a) for a in run_pieces(4))
        + "bra RUN_DONE_${:uid}; "
        "RUN_EVEN_${:uid}: "
        + "".join(access(*a) for a in run_pieces(0))
        + "RUN_DONE_${:uid}: "
        + zeros
        + "}"
    )


@triton.jit
def load_runs(pointers):
    """float32 values at ``pointers`` of a full tile (rows of odd length), eight consecutive
    elements a thread loaded by :func:`run_access_ptx` from any 4-byte aligned place. The
    caller promises a layout of runs of eight consecutive elements a thread, in order
    (:func:`~srtrain.kernels.launch.runs_in_order` checks the compiled kernel)."""
    return tl.inline_asm_elementwise(
        run_access_ptx(False),
        RUN_LOAD_CONSTRAINTS,
        [pointers],
        dtype=tl.float32,
        is_pure=True,
        pack=8,
    )


@triton.jit
def store_runs(pointers, values):
    """float32 ``values`` of a full tile stored at ``pointers`` the way :func:`load_runs`
    loads them."""
    tl.inline_asm_elementwise(
        run_access_ptx(True),
        RUN_STORE_CONSTRAINTS,
        [pointers, values.to(tl.int32, bitcast=True)],
        dtype=tl.int32,
        is_pure=False,
        pack=8,
    )


@triton.jit
def load_values(pointers, mask, QUAD_LOADS: tl.constexpr, RUNS: tl.constexpr):
    """Values at ``pointers``, 0 where not ``mask``: float32 ones by :func:`load_quads`
    with ``QUAD_LOADS``, by :func:`load_runs` with ``RUNS`` (full tiles), others (and all
    without) by tl.load."""
    if QUAD_LOADS and pointers.dtype.element_ty == tl.float32:
        values = load_quads(pointers, mask)
    elif RUNS and pointers.dtype.element_ty == tl.float32:
        values = load_runs(pointers)
    else:
        values = tl.load(pointers, mask=mask, other=0)
    return values


@triton.jit
def layout_anchor(base, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Zeros [ROWS, COLS] (uint8) from a load whose mask is never true, made to lay out a
    tile of unaligned rows like an aligned one.

    Triton lays a tile out by its loads and stores. Rows that are not 16-byte aligned get
    one element per thread, so every thread holds four scale blocks and repeats each
    block's work four times. A load of the tile's shape from ``base`` (16-byte aligned)
    lets the loads beside it read four consecutive elements per thread, one at a time, and
    stores through :func:`store_tile` keep that layout. The load reads nothing.
    """
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    return tl.load(base + offs, mask=offs < 0, other=0)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as int16 bits (exact in the interpreter too)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def scales_or_codes(state: StoredState) -> torch.Tensor:
    return state.scales if state.scales is not None else state.codes


def l2_prefetch_ptx(
    sizes: Sequence[int], aligned: Sequence[bool], every_thread: bool = False
) -> str:
    """Inline PTX for :func:`prefetch_l2`: thread k of a program (with ``every_thread``,
    each thread) asks L2 for ``sizes[k]`` bytes at operand k + 1 (parameter, gradient, m
    codes, m scales, v codes, v scales; none where 0). A range whose address is 16-byte
    aligned (``aligned[k]``) is one bulk prefetch; another runs from the aligned 16 bytes
    holding its first byte through those holding its last (so it stays in the pages the
    range touches); a range of 128 bytes or fewer asks for the lines of its first and last
    bytes. Every thread asking spares the thread test and predicates, and repeats the
    requests, which L2 finds pending or present."""
    parts = ["{ .reg .u32 t, o, s; .reg .pred q; .reg .b64 a; mov.u32 t, %tid.x; "]
    guard = "" if every_thread else "@q "
    for k, (size, is_aligned) in enumerate(zip(sizes, aligned, strict=True)):
        if size == 0:
            continue
        address = f"${k + 1}"
        if not every_thread:
            parts.append(f"setp.eq.u32 q, t, {k}; ")
        if size <= 128:
            parts.append(
                f"{guard}prefetch.global.L2 [{address}]; "
                f"{guard}prefetch.global.L2 [{address}+{size - 1}]; "
            )
        elif is_aligned and size % 16 == 0:
            parts.append(f"{guard}cp.async.bulk.prefetch.L2.global [{address}], {size}; ")
        else:
            parts.append(
                f"and.b64 a, {address}, -16; cvt.u32.u64 o, {address}; "
                f"and.b32 o, o, 15; add.u32 s, o, {size + 15}; and.b32 s, s, -16; "
                f"{guard}cp.async.bulk.prefetch.L2.global [a], s; "
            )
    parts.append("mov.u32 $0, 0; }")
    return "".join(parts)


@triton.constexpr_function
def tile_bytes(
    tb: int,
    bs: int,
    param_bits: int,
    grad_bits: int,
    m_bits: int,
    m_scaled: bool,
    v_bits: int,
    v_scaled: bool,
) -> tuple[int, ...]:
    """Bytes of a contiguous tile of ``tb`` blocks of ``bs`` elements in each array a
    prefetch covers: parameter, gradient, m codes, m scales, v codes, v scales (0: none)."""
    elements = tb * bs
    return (
        elements * param_bits // 8,
        elements * grad_bits // 8,
        elements * m_bits // 8,
        tb if m_scaled else 0,
        elements * v_bits // 8,
        tb if v_scaled else 0,
    )


def tile_prefetch_ptx(
    tb: int,
    bs: int,
    param_size: int,
    grad_size: int,
    m_fmt: Format,
    v_fmt: Format,
    aligned: bool,
    every_thread: bool = False,
) -> str:
    """:func:`l2_prefetch_ptx` for a contiguous tile (:func:`tile_bytes`; parameter and
    gradient elements of ``param_size`` and ``grad_size`` bytes); in an aligned launch
    parameter, gradient and codes of 8 bits or more start 16-byte aligned."""
    sizes = tile_bytes(
        tb, bs, 8 * param_size, 8 * grad_size, m_fmt.bits, m_fmt.scaled, v_fmt.bits, v_fmt.scaled
    )
    flags = (
        (True, True, m_fmt.bits >= 8, False, v_fmt.bits >= 8, False) if aligned else (False,) * 6
    )
    return l2_prefetch_ptx(sizes, flags, every_thread)


@triton.jit
def l2_row_steps(table, tiles_per_row, SHAPE: tl.constexpr, M: tl.constexpr, V: tl.constexpr):
    """Bytes from the last tile of a row to the first of the next, per array of
    :func:`~srtrain.kernels.step_kernel._l2_pointers`, for the shard whose
    :class:`~srtrain.kernels.step_kernel.ShardTable` is ``table`` (rows a tile wide or
    more; flat shards have one row) under tiles of ``SHAPE``
    (:class:`~srtrain.kernels.tile.TileShape`)."""
    TB: tl.constexpr = SHAPE.TB
    BS: tl.constexpr = SHAPE.BS
    cols, blocks_per_row = table.layout.cols, table.layout.blocks_per_row
    row_bytes = table.layout.row_bytes
    back = (tiles_per_row - 1).to(tl.int64)
    cols = cols.to(tl.int64) - back * (TB * BS)
    if M.BITS == 4:
        m_codes = row_bytes - back * (TB * BS // 2)
    else:
        m_codes = cols * (M.BITS // 8)
    if V.BITS == 4:
        v_codes = row_bytes - back * (TB * BS // 2)
    else:
        v_codes = cols * (V.BITS // 8)
    blocks = blocks_per_row - back * TB
    return (
        cols * (SHAPE.P_T.primitive_bitwidth // 8),
        cols * (SHAPE.G_T.primitive_bitwidth // 8),
        m_codes,
        blocks,
        v_codes,
        blocks,
    )


@triton.jit
def l2_next(pointers, wrap, row_steps, SHAPE: tl.constexpr, M: tl.constexpr, V: tl.constexpr):
    """:func:`~srtrain.kernels.step_kernel._l2_pointers` of the next tile: of the same row
    (:func:`tile_bytes` on), or with ``wrap`` the first of the next (``row_steps`` of
    :func:`l2_row_steps`)."""
    AHEAD: tl.constexpr = tile_bytes(
        SHAPE.TB,
        SHAPE.BS,
        SHAPE.P_T.primitive_bitwidth,
        SHAPE.G_T.primitive_bitwidth,
        M.BITS,
        M.KIND >= 2,
        V.BITS,
        V.KIND >= 2,
    )
    p, g, mc, ms, vc, vs = pointers
    row_p, row_g, row_mc, row_ms, row_vc, row_vs = row_steps
    return (
        p + tl.where(wrap, row_p, AHEAD[0]),
        g + tl.where(wrap, row_g, AHEAD[1]),
        mc + tl.where(wrap, row_mc, AHEAD[2]),
        ms + tl.where(wrap, row_ms, AHEAD[3]),
        vc + tl.where(wrap, row_vc, AHEAD[4]),
        vs + tl.where(wrap, row_vs, AHEAD[5]),
    )


@triton.jit
def prefetch_l2(pointers, PTX: tl.constexpr):
    """Ask L2 for a tile's bytes by the :func:`l2_prefetch_ptx` ``PTX``: for each array, the
    tile-long range from the tile's :func:`~srtrain.kernels.step_kernel._l2_pointers`. It
    is the tile's own where the shard's tiles are contiguous (flat, or rows at least a tile
    wide); at the end of a row it runs on into the next, so the shard's last tile is not
    asked for."""
    p, g, mc, ms, vc, vs = pointers
    tl.inline_asm_elementwise(
        PTX, "=r,l,l,l,l,l,l", [p, g, mc, ms, vc, vs], dtype=tl.int32, is_pure=False, pack=1
    )
