"""Where a shard's elements fall in the fused step's tiles, on the host.

A shard is laid out as rows of scale blocks (block-scaled states) or as one flat row
(:func:`tile_layout`); a tile of ``tb`` blocks holds ``2**slot_bits`` consecutive blocks of
each of ``tb >> slot_bits`` rows (:func:`row_slots`). These functions size the launch
tables of :mod:`srtrain.kernels.launch`; the device side of the same geometry is
:func:`srtrain.kernels.tile.shard_tile`.
"""

from __future__ import annotations

import torch
import triton

from srtrain.numerics.formats import Format, row_layout
from srtrain.numerics.rounding import StoredState

UNSCALED_TILE_WIDTH = 256  # elements a tile row of unscaled states
ALIGNMENT = 16  # bytes; aligned shards get vectorised loads


def tile_layout(
    shape: tuple[int, ...], fmts: tuple[Format, ...], block_size: int
) -> tuple[int, int, int]:
    """(rows, cols, BS) of a shard: rows of scale blocks of BS elements, or one flat row
    cut into tiles BS wide."""
    if any(f.scaled for f in fmts):
        rows, cols = row_layout(shape)
        return rows, cols, block_size
    numel = 1
    for d in shape:
        numel *= d
    return 1, numel, UNSCALED_TILE_WIDTH


def row_slots(cols: int, bs: int, tb: int) -> tuple[int, int]:
    """(slot_bits, tiles_per_row) of a scaled shard under tiles of ``tb`` blocks: each tile
    row holds ``2**slot_bits`` blocks, all of a narrow row or a part of a wide one."""
    blocks = max(-(-cols // bs), 1)
    slots = min(tb, triton.next_power_of_2(blocks))
    return slots.bit_length() - 1, -(-blocks // slots)


def tiles_of(rows: int, cols: int, bs: int, tb: int, flat: bool) -> int:
    """Tiles of ``tb`` blocks that cover a shard of ``rows`` × ``cols``."""
    if flat:
        return -(-cols // (tb * bs))
    slot_bits, tiles_per_row = row_slots(cols, bs, tb)
    return -(-rows // (tb >> slot_bits)) * tiles_per_row


def tile_span(rows: int, cols: int, bs: int, tb: int, flat: bool) -> int:
    """The least power of two ``P`` above every element's offset in its tile, when every
    tile of a shard of ``rows`` × ``cols`` (:func:`tile_layout`) starts a multiple of ``P``
    from the shard's start and ``P`` <= 2**16; else 0. A shard whose global offset is a
    multiple of ``P`` draws through span words (:func:`draw_in_span`)."""
    if flat:
        extent, steps = min(cols, tb * bs), [tb * bs] if cols > tb * bs else []
    else:
        slot_bits, tiles_per_row = row_slots(cols, bs, tb)
        rows_per_tile, width = tb >> slot_bits, bs << slot_bits
        extent = (min(rows_per_tile, rows) - 1) * cols + min(width, cols)
        steps = ([rows_per_tile * cols] if rows > rows_per_tile else []) + (
            [width] if tiles_per_row > 1 else []
        )
    span = 1 << max(extent - 1, 0).bit_length()
    if span > 1 << 16 or any(step % span for step in steps):
        return 0
    return span


def fills_tile(slot_bits: int, tb: int) -> bool:
    """Whether a tile of ``tb`` blocks gives all its ``2**slot_bits``-block slots to one row."""
    return slot_bits == tb.bit_length() - 1


def is_aligned(address: int) -> bool:
    """Whether an address allows the launch's vectorised (16-byte) accesses."""
    return int(address) % ALIGNMENT == 0


def aligned_shard(param: torch.Tensor, m: StoredState, v: StoredState) -> bool:
    """Whether a shard allows the launch's vectorised accesses: its tile rows (scaled
    states) or its length (unscaled) a multiple of 16 elements, and parameter and codes at
    16-byte addresses. One shard that does not takes the vectorisation from its launch."""
    _, cols, _ = tile_layout(tuple(param.shape), (m.fmt, v.fmt), m.block_size)
    return cols % 16 == 0 and all(is_aligned(t.data_ptr()) for t in (param, m.codes, v.codes))
