"""Standalone rounding kernels: float32 → BF16 / FP8 / FP4 (with block scales), NR or SR.

They compute :func:`srtrain.numerics.rounding.quantize` bit for bit; the stochastic
FP32 → BF16 cast is :func:`sr_cast_bf16_triton`. Scaled formats round [blocks, block
size] tiles (the step's layout); BF16 rounds flat 1-D tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srtrain.kernels.layout import row_slots, tile_layout, tiles_of
from srtrain.kernels.memory import codes_base, int_view
from srtrain.kernels.state_codes import check_formats, state_code
from srtrain.kernels.tile import RowLayout, shard_tile, store_bf16, store_state
from srtrain.kernels.triton_numerics import (
    DRAW_WHOLE,
    draw,
    flat_index_words,
    interpreted,
    span_key,
    tile_index_words,
)
from srtrain.numerics.formats import BF16, FP32, Format, check_block_size, get_format
from srtrain.numerics.rounding import StoredState, check_rounding, empty_state

# Elements per program of the BF16 cast on the GPU, in 8 warps: a 1-D tile of a length that is
# a multiple of 16 gives 16-byte accesses that each warp makes contiguous.
FLAT_TILE = 4096
VECTOR_ELEMENTS = 16  # the BF16 cast's first launch covers a multiple of this many elements


def tile_elements() -> int:
    """Elements per tile: large in the interpreter (its cost is per tile)."""
    return 16384 if interpreted() else 1024


def signed32(word: int) -> int:
    """A 32-bit key word as a signed int32 kernel argument."""
    return word - (1 << 32) if word >= 1 << 31 else word


@triton.jit(do_not_specialize=["offset", "k0", "k1"])
def bf16_cast_kernel(
    x_ptr,
    out_ptr,
    numel,
    offset,
    k0,
    k1,
    BLOCK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CARRY: tl.constexpr,
):
    """Round ``BLOCK`` float32 values to BF16 bits (int16), global indices from ``offset``.
    Without ``CARRY`` the indices stay under one multiple of 2**32 (one span key a tile)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    valid = offs < numel - start
    x = tl.load(x_ptr + start + offs, mask=valid, other=0.0)
    if CARRY:
        lo, hi = flat_index_words(offset.to(tl.int64) + start, offs)
    else:
        lo, hi = tile_index_words(offset.to(tl.int64) + start, offs)
    rand = draw(span_key(k0.to(tl.uint32, bitcast=True), k1.to(tl.uint32, bitcast=True), hi), lo)
    store_bf16(out_ptr + start + offs, x, rand, valid, STOCHASTIC, False, DRAW_WHOLE)


@triton.jit(do_not_specialize=["offset", "k0", "k1"])
def quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    rows,
    cols,
    tiles_per_row,
    slot_bits,
    offset,
    k0,
    k1,
    TB: tl.constexpr,
    BS: tl.constexpr,
    ALIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    KEEP_POSITIVE: tl.constexpr,
    CARRY: tl.constexpr,
    F: tl.constexpr,
):
    """Round a [TB, BS] tile of float32 values into the block-scaled format whose
    :class:`~srtrain.kernels.state_codes.StateCode` is ``F``. Without ``CARRY``
    the global indices ``offset ..`` stay under one multiple of 2**32 (one span key a tile)."""
    group = tl.program_id(0) // tiles_per_row
    start, start_bytes, first_block, geometry = shard_tile(
        group,
        tl.program_id(0) - group * tiles_per_row,
        RowLayout(rows, cols, slot_bits, tl.cdiv(cols, BS), (cols + 1) // 2),
        TB,
        BS,
        False,
        ALIGNED,
        False,
        False,
    )
    codes_ptr = codes_base(codes_ptr, start, start_bytes, F.BITS)
    scales_ptr += first_block
    if CARRY:
        lo, hi = flat_index_words(offset.to(tl.int64) + start, geometry.offs)
    else:
        lo, hi = tile_index_words(offset.to(tl.int64) + start, geometry.offs)
    x = tl.load(x_ptr + start + geometry.offs, mask=geometry.valid, other=0.0)
    rand = draw(span_key(k0.to(tl.uint32, bitcast=True), k1.to(tl.uint32, bitcast=True), hi), lo)
    store_state(
        x,
        codes_ptr,
        scales_ptr,
        geometry,
        rand,
        TB,
        BS,
        F,
        STOCHASTIC,
        KEEP_POSITIVE,
        False,
        False,
        DRAW_WHOLE,
    )


def unfilled_state(
    fmt: Format, shape: tuple[int, ...], block_size: int, device: torch.device
) -> StoredState:
    """The output state of :func:`quantize_triton`, left unwritten: the kernels write every
    code byte (an odd row's last FP4 byte with its padding nibble) and every scale byte, so
    a fill would only add a pass over memory."""
    return empty_state(fmt, shape, block_size, device, zeroed=False)


def quantize_triton(
    x: torch.Tensor,
    fmt,
    block_size: int = 32,
    mode: str = "nearest",
    key: tuple[int, int] | None = None,
    offset: int = 0,
    keep_positive: bool = False,
    tile: int | None = None,
) -> StoredState:
    """Triton twin of :func:`srtrain.numerics.rounding.quantize` (same arguments); ``tile``
    (elements per tile) tunes the launch only."""
    fmt = get_format(fmt)
    check_formats(fmt)
    check_block_size(block_size)
    check_rounding(mode)
    if x.dtype != torch.float32:
        raise TypeError(f"quantize_triton takes float32 input, got {x.dtype}")
    if mode == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs a key (see rng_key)")
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be a power of two of at least 16 elements, not {tile}")
    x = x.contiguous()
    out = unfilled_state(fmt, tuple(x.shape), block_size, x.device)
    if fmt is FP32:
        out.codes.copy_(x)
        return out
    if x.numel() == 0:
        return out
    k0, k1 = key if key is not None else (0, 0)
    carry = offset >> 32 != (offset + x.numel() - 1) >> 32
    if fmt is BF16:
        _cast_bf16(
            x.view(-1),
            int_view(out.codes).view(-1),
            offset,
            signed32(k0),
            signed32(k1),
            mode == "stochastic",
            carry,
            tile,
        )
        return out
    rows, cols, bs = tile_layout(tuple(x.shape), (fmt,), block_size)
    tb = max(1, (tile or tile_elements()) // bs)
    slot_bits, tiles_per_row = row_slots(cols, bs, tb)
    quantize_kernel[(tiles_of(rows, cols, bs, tb, False),)](
        x,
        out.codes,
        out.scales,
        rows,
        cols,
        tiles_per_row,
        slot_bits,
        offset,
        signed32(k0),
        signed32(k1),
        TB=tb,
        BS=bs,
        ALIGNED=cols % 16 == 0,
        STOCHASTIC=mode == "stochastic",
        KEEP_POSITIVE=keep_positive,
        CARRY=carry,
        F=state_code(fmt),
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


def _cast_bf16(
    x: torch.Tensor,
    out: torch.Tensor,
    offset: int,
    k0: int,
    k1: int,
    stochastic: bool,
    carry: bool,
    tile: int | None,
) -> None:
    """Launch the BF16 cast over flat ``x`` into ``out`` (int16): the elements up to a multiple
    of 16, then the rest (fewer than 16) in a launch of its own, so that the first launch's
    length is a multiple of 16 and its accesses are vectors."""
    block = tile or (tile_elements() if interpreted() else FLAT_TILE)
    bulk = x.numel() - x.numel() % VECTOR_ELEMENTS
    for start, count in ((0, bulk), (bulk, x.numel() - bulk)):
        if count:
            bf16_cast_kernel[(triton.cdiv(count, block),)](
                x[start:],
                out[start:],
                count,
                offset + start,
                k0,
                k1,
                BLOCK=block,
                STOCHASTIC=stochastic,
                CARRY=carry,
                num_warps=8,
            )


def sr_cast_bf16_triton(
    x: torch.Tensor, key: tuple[int, int], offset: int = 0, tile: int | None = None
) -> torch.Tensor:
    """Stochastically rounded float32 → bfloat16 cast (spec: rounding.sr_cast_bf16);
    ``tile`` (elements per program) tunes the launch only."""
    return quantize_triton(x, BF16, 32, "stochastic", key, offset, tile=tile).codes
