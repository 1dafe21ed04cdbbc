"""L2 prefetch of the tile ahead: each tile of a launch asks L2 for the next tile of its
program's run, so that the tile's own loads find their lines there. Where the launch asks,
and the PTX it issues; the launch's pointers of the tile ahead come from
:mod:`srtrain.kernels.multi_adamw`."""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

from srtrain.numerics.formats import Format


def l2_prefetch_ptx(sizes: Sequence[int], aligned: Sequence[bool],
                    every_thread: bool = False) -> str:
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
            parts.append(f"{guard}prefetch.global.L2 [{address}]; "
                         f"{guard}prefetch.global.L2 [{address}+{size - 1}]; ")
        elif is_aligned and size % 16 == 0:
            parts.append(f"{guard}cp.async.bulk.prefetch.L2.global [{address}], {size}; ")
        else:
            parts.append(f"and.b64 a, {address}, -16; cvt.u32.u64 o, {address}; "
                         f"and.b32 o, o, 15; add.u32 s, o, {size + 15}; and.b32 s, s, -16; "
                         f"{guard}cp.async.bulk.prefetch.L2.global [a], s; ")
    parts.append("mov.u32 $0, 0; }")
    return "".join(parts)


@triton.constexpr_function
def tile_bytes(tb: int, bs: int, param_bits: int, grad_bits: int, m_bits: int, m_scaled: bool,
               v_bits: int, v_scaled: bool) -> tuple[int, ...]:
    """Bytes of a contiguous tile of ``tb`` blocks of ``bs`` elements in each array a
    prefetch covers: parameter, gradient, m codes, m scales, v codes, v scales (0: none)."""
    elements = tb * bs
    return (elements * param_bits // 8, elements * grad_bits // 8, elements * m_bits // 8,
            tb if m_scaled else 0, elements * v_bits // 8, tb if v_scaled else 0)


def tile_prefetch_ptx(tb: int, bs: int, param_size: int, grad_size: int, m_fmt: Format,
                      v_fmt: Format, aligned: bool, every_thread: bool = False) -> str:
    """:func:`l2_prefetch_ptx` for a contiguous tile (:func:`tile_bytes`; parameter and
    gradient elements of ``param_size`` and ``grad_size`` bytes); in an aligned launch
    parameter, gradient and codes of 8 bits or more start 16-byte aligned."""
    sizes = tile_bytes(tb, bs, 8 * param_size, 8 * grad_size, m_fmt.bits, m_fmt.scaled,
                       v_fmt.bits, v_fmt.scaled)
    flags = ((True, True, m_fmt.bits >= 8, False, v_fmt.bits >= 8, False) if aligned
             else (False,) * 6)
    return l2_prefetch_ptx(sizes, flags, every_thread)


@triton.jit
def l2_row_steps(table, tiles_per_row, TB: tl.constexpr, BS: tl.constexpr,
                  P_T: tl.constexpr, G_T: tl.constexpr, M_BITS: tl.constexpr,
                  V_BITS: tl.constexpr):
    """Bytes from the last tile of a row to the first of the next, per array of
    :func:`_l2_pointers` (rows a tile wide or more; flat shards have one row)."""
    _, _, _, _, _, _, _, cols, blocks_per_row, _, _, row_bytes = table
    back = (tiles_per_row - 1).to(tl.int64)
    cols = cols.to(tl.int64) - back * (TB * BS)
    if M_BITS == 4:
        m_codes = row_bytes - back * (TB * BS // 2)
    else:
        m_codes = cols * (M_BITS // 8)
    if V_BITS == 4:
        v_codes = row_bytes - back * (TB * BS // 2)
    else:
        v_codes = cols * (V_BITS // 8)
    blocks = blocks_per_row - back * TB
    return (cols * (P_T.primitive_bitwidth // 8), cols * (G_T.primitive_bitwidth // 8),
            m_codes, blocks, v_codes, blocks)


@triton.jit
def l2_next(pointers, wrap, row_steps, P_T: tl.constexpr, G_T: tl.constexpr,
            TB: tl.constexpr, BS: tl.constexpr, M_KIND: tl.constexpr, M_BITS: tl.constexpr,
            V_KIND: tl.constexpr, V_BITS: tl.constexpr):
    """:func:`_l2_pointers` of the next tile: of the same row (:func:`tile_bytes` on), or
    with ``wrap`` the first of the next (``row_steps`` of :func:`l2_row_steps`)."""
    STEP: tl.constexpr = tile_bytes(TB, BS, P_T.primitive_bitwidth, G_T.primitive_bitwidth,
                                    M_BITS, M_KIND >= 2, V_BITS, V_KIND >= 2)
    p, g, mc, ms, vc, vs = pointers
    row_p, row_g, row_mc, row_ms, row_vc, row_vs = row_steps
    return (p + tl.where(wrap, row_p, STEP[0]), g + tl.where(wrap, row_g, STEP[1]),
            mc + tl.where(wrap, row_mc, STEP[2]), ms + tl.where(wrap, row_ms, STEP[3]),
            vc + tl.where(wrap, row_vc, STEP[4]), vs + tl.where(wrap, row_vs, STEP[5]))


@triton.jit
def prefetch_l2(pointers, PTX: tl.constexpr):
    """Ask L2 for a tile's bytes by the :func:`l2_prefetch_ptx` ``PTX``: for each array, the
    tile-long range from the tile's :func:`_l2_pointers`. It is the tile's own where the
    shard's tiles are contiguous (flat, or rows at least a tile wide); at the end of a row
    it runs on into the next, so the shard's last tile is not asked for."""
    p, g, mc, ms, vc, vs = pointers
    tl.inline_asm_elementwise(PTX, "=r,l,l,l,l,l,l", [p, g, mc, ms, vc, vs], dtype=tl.int32,
                              is_pure=False, pack=1)
