"""How a fused-step launch runs: tile, warps, registers, L2 prefetch and memory accesses.

:func:`launch_plan` is the one place these choices are made, for a shard layout and a
state format pair. They tune speed only: every plan computes the same bits. The
measurements behind each choice are in docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from srtrain.kernels.layout import fills_tile, row_slots, tile_layout
from srtrain.kernels.triton_numerics import interpreted
from srtrain.numerics.formats import Format

MAX_REGISTERS = 80  # per thread, unscaled states: three programs of 8 warps a multiprocessor
WIDE_MAX_REGISTERS = 128  # per thread, block-scaled states: eight elements a thread
NUM_WARPS = 8  # per program, unscaled states
SCALED_NUM_WARPS = 2  # per program, block-scaled states
SCALED_TILE = 512  # elements per tile of block-scaled states
TILE = 1024  # elements per tile of unscaled states
INTERPRETED_TILE = 16384  # elements per tile in the interpreter


class Access(NamedTuple):
    """How a launch reads and writes rows with the vectorised accesses or without; the fused
    step's kernel takes it as one compile-time argument
    (:func:`~srtrain.kernels.step_kernel.multi_adamw_kernel`).

    ``scalar``: one element at a time in the layout of aligned rows; ``keep_table``: each
    shard's table values may stay in registers across its tiles; ``l2_ahead`` (0 or 1):
    tiles ahead that each tile asks L2 for, in its program's run; ``quad_loads``: a float32
    parameter and gradient load four elements at a time in PTX; ``line_stores``: a float32
    parameter is stored through tl.store, a warp's store covering 128 consecutive bytes;
    ``run_accesses``: full tiles load a float32 parameter and gradient (and store the
    parameter where ``line_stores`` does not) eight elements a thread in 8-byte pieces.
    """

    scalar: bool
    keep_table: bool
    l2_ahead: int
    quad_loads: bool
    line_stores: bool
    run_accesses: bool


@dataclass(frozen=True)
class LaunchPlan:
    """A launch's shape and accesses: ``tile`` elements per tile, ``num_warps`` per program,
    ``max_registers`` per thread (None: as many as the compiler wants), whether every
    thread issues the L2 prefetches (else one thread per array), and the :class:`Access`
    of rows with the vectorised accesses (``aligned``) and without (``unaligned``)."""

    tile: int
    num_warps: int
    max_registers: int | None
    l2_every_thread: bool
    aligned: Access
    unaligned: Access

    def access(self, aligned: bool) -> Access:
        """The accesses of a launch on aligned rows or on others."""
        return self.aligned if aligned else self.unaligned


# choices a caller may make in place of launch_plan's own, with what each accepts
CHOICES = {
    "num_warps": ("a positive int", lambda x: type(x) is int and x > 0),
    "max_registers": ("None or a positive int", lambda x: x is None or (type(x) is int and x > 0)),
    "l2_ahead": ("0 or 1", lambda x: type(x) is int and x in (0, 1)),
    "l2_every_thread": ("a bool", lambda x: isinstance(x, bool)),
    "quad_loads": ("a bool", lambda x: isinstance(x, bool)),
    "line_stores": ("a bool", lambda x: isinstance(x, bool)),
    "run_accesses": ("a bool", lambda x: isinstance(x, bool)),
}


def check_tile(tile: int | None) -> None:
    """Raise unless ``tile`` is None or a power of two."""
    if not (tile is None or (type(tile) is int and tile > 0 and tile & (tile - 1) == 0)):
        raise ValueError(f"tile must be None or a power of two, not {tile!r}")


def check_choices(choices: dict) -> None:
    """Raise, naming the choice and what it accepts, unless every one of ``choices`` is a
    known choice (:data:`CHOICES`) with a value it accepts."""
    for name, value in choices.items():
        if name not in CHOICES:
            raise ValueError(
                f"unknown launch choice {name!r}; choose from {', '.join(['tile', *CHOICES])}"
            )
        what, accepts = CHOICES[name]
        if not accepts(value):
            raise ValueError(f"{name} must be {what}, not {value!r}")


def default_tile(scaled: bool, hardware: bool | None = None) -> int:
    """Elements per tile on the GPU (``hardware``; None: unless Triton runs its
    interpreter): :data:`SCALED_TILE` for block-scaled states, else :data:`TILE`; in the
    interpreter :data:`INTERPRETED_TILE` (its cost is per tile)."""
    if hardware is None:
        hardware = not interpreted()
    if not hardware:
        return INTERPRETED_TILE
    return SCALED_TILE if scaled else TILE


def run_length(tb: int, bs: int, num_warps: int) -> int:
    """Elements a thread holds along a row of a [tb, bs] tile of ``num_warps`` warps, whose
    counts it sums alone (:func:`~srtrain.kernels.tile.count_sums`)."""
    return max(1, min(bs, tb * bs // (32 * num_warps)))


def keeps_table(
    scaled: bool, stochastic: bool, registers: int | None, four_bit: bool, aligned: bool
) -> bool:
    """Whether a launch keeps each shard's table values in registers across its tiles:
    flat launches; stochastic ones with room (80 registers or more); nearest ones on
    aligned rows without a 4-bit state at 128 registers or more."""
    if not scaled:
        return True
    if stochastic:
        return registers is None or registers >= MAX_REGISTERS
    return aligned and not four_bit and (registers is None or registers >= WIDE_MAX_REGISTERS)


def tile_blocks(tile: int | None, scaled: bool, bs: int, hardware: bool | None = None) -> int:
    """Blocks of ``bs`` elements in a tile of ``tile`` elements (None: the default tile)."""
    return max(1, (tile or default_tile(scaled, hardware)) // bs)


def launch_plan(
    shapes: Sequence[tuple[int, ...]],
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    m_fmt: Format,
    v_fmt: Format,
    block_size: int,
    stochastic: bool,
    *,
    tile: int | None = None,
    hardware: bool | None = None,
    **choices,
) -> LaunchPlan:
    """The plan of a launch over shards of ``shapes`` (non-empty) whose states round
    stochastically or not, compiled for the GPU (``hardware``; None: unless Triton runs its
    interpreter). ``tile`` (a power of two; None: the default) and ``choices``
    (:data:`CHOICES`) take the place of the plan's own; an access a launch cannot make
    (quad loads on unaligned rows, or of no float32 values; L2 prefetches where a shard's
    tiles are not contiguous) stays off whatever is asked.

    Block-scaled states run 512-element tiles with 2 warps at 128 registers, unscaled ones
    1024-element tiles with 8 warps at 80 registers. L2 prefetches go to block-scaled states
    of float32 parameters, on aligned rows and, with nearest rounding, on others; from every
    thread where states round stochastically and one is 4-bit. Aligned block-scaled rows of
    float32 parameters load them by quads; other block-scaled rows store a float32 parameter
    by lines with nearest rounding, and access full tiles by runs unless a 4-bit state
    rounds stochastically."""
    check_tile(tile)
    check_choices(choices)
    if hardware is None:
        hardware = not interpreted()
    scaled = m_fmt.scaled or v_fmt.scaled
    four_bit = "fp4" in (m_fmt.family, v_fmt.family)
    fp32_param = param_dtype == torch.float32
    float32_values = torch.float32 in (param_dtype, grad_dtype)
    tile = tile or default_tile(scaled, hardware)
    if scaled:
        num_warps, registers = SCALED_NUM_WARPS, WIDE_MAX_REGISTERS
    else:
        num_warps, registers = NUM_WARPS, MAX_REGISTERS
    num_warps = choices.get("num_warps", num_warps)
    registers = choices.get("max_registers", registers)
    # L2 prefetches cover a tile as one range: flat shards, or rows a tile wide or more
    contiguous = hardware and (
        not scaled
        or all(
            fills_tile(row_slots(cols, bs, max(1, tile // bs))[0], max(1, tile // bs))
            for _, cols, bs in (tile_layout(tuple(s), (m_fmt, v_fmt), block_size) for s in shapes)
        )
    )
    vectorised = hardware and scaled  # the PTX accesses of block-scaled rows

    def access(aligned: bool) -> Access:
        l2_ahead = choices.get(
            "l2_ahead", int(scaled and fp32_param and (aligned or not stochastic))
        )
        quads = choices.get("quad_loads", scaled and fp32_param)
        lines = choices.get("line_stores", not stochastic)
        runs = choices.get("run_accesses", not (stochastic and four_bit))
        return Access(
            scalar=vectorised and not aligned,
            keep_table=keeps_table(scaled, stochastic, registers, four_bit, aligned),
            l2_ahead=int(contiguous and l2_ahead),
            quad_loads=vectorised and aligned and float32_values and quads,
            line_stores=vectorised and not aligned and fp32_param and lines,
            run_accesses=vectorised and not aligned and float32_values and runs,
        )

    every_thread = choices.get("l2_every_thread", stochastic and four_bit)
    return LaunchPlan(tile, num_warps, registers, every_thread, access(True), access(False))


def without(plan: LaunchPlan, aligned: bool, access: str) -> LaunchPlan:
    """``plan`` with ``access`` (a field of :class:`Access`) off on aligned rows or others."""
    if aligned:
        return replace(plan, aligned=plan.aligned._replace(**{access: False}))
    return replace(plan, unaligned=plan.unaligned._replace(**{access: False}))
