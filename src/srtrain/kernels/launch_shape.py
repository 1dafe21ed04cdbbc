"""How a fused-step launch is shaped: elements per tile, warps per program, registers per
thread, and whether each shard's table stays in registers. These choices tune speed only;
results never depend on them."""

from __future__ import annotations

from dataclasses import dataclass

from srtrain.kernels.fused_adamw import interpreted, tile_elements

# Launch shapes (bench results in src/srtrain/bench/results/, share of copy bandwidth on the
# H200). Registers per thread: 80 lets three programs of 8 warps share a multiprocessor;
# uncapped, most variants need 95-124 and fit two (`registers_without_cap` of `--sass`), and
# the capped step was the faster (2026-11-30-h200-ab-register-cap.json). Unscaled states run
# 8 warps on 1024-element tiles at 80 registers: tiles of 512 with 4 warps lose 1 point on
# BF16 states (2026-11-30-h200-flat-tile-512-d670b02.json). Block-scaled states run tiles of
# 512 elements with 2 warps at 128 registers, eight elements a thread, which spreads the
# per-tile and per-block work over twice the elements (sm_90 FP8 nearest 100 -> 88
# instructions per element). Against the former 8-warp shapes of four elements a thread
# (`python -m srtrain.bench --sweep`, 2026-11-30-h200-launch-sweep-7985954.json, then
# 2026-11-30-h200-launch-shapes-d670b02.json): FP8 nearest 68.3 -> 78.5%, stochastic
# 60.7 -> 65.7%; FP4 nearest 55.7 -> 63.7%; FP8 m with FP4 v stochastic 56.3 -> 61.4%; BF16
# parameters FP8 nearest 47.0 -> 49.7%, stochastic 35.4 -> 36.2%, FP4 nearest 32.1 -> 35.7%;
# stochastic FP4 of FP32 parameters 50.6 -> 50.5%. Tiles of 512 sped up unaligned rows
# (scalar accesses) too (5461 columns, four elements a thread: FP8 stochastic 47.1 -> 51.4%,
# FP4 40.6 -> 44.7%, BF16 parameters FP8 27.8 -> 30.3%; nearest at eight elements a thread
# FP8 54.3 -> 59.5%, FP4 44.3 -> 50.6%); a row of 5461 is 5 full tiles of 1024 and one a third
# full, or 10 of 512 and one two-thirds full (not profiled). Stochastic rounding on those rows
# ran four elements a thread (4 warps at 80) until the per-thread counts freed registers: it
# had slowed at eight (FP8 47.1 -> 43.9%, 2026-11-30-h200-unaligned-launch-shape-c6e9fb7.json)
# and now gains there (FP8 51.3 -> 53.6%, FP4 44.8 -> 45.5%, BF16 parameters FP8 30.3 ->
# 30.5%, 2026-11-30-h200-unaligned-stochastic-7483677.json).
MAX_REGISTERS = 80
WIDE_MAX_REGISTERS = 128
NUM_WARPS = 8  # per program
SCALED_TILE = 512  # elements per tile of block-scaled states


@dataclass(frozen=True)
class LaunchShape:
    """Warps per program and registers per thread (None: as many as the compiler wants)."""

    num_warps: int
    max_registers: int | None


def default_tile(scaled: bool) -> int:
    """Elements per tile of a launch: :data:`SCALED_TILE` for block-scaled states on the GPU,
    else :func:`~srtrain.kernels.fused_adamw.tile_elements`."""
    return SCALED_TILE if scaled and not interpreted() else tile_elements()


def default_launch_shape(scaled: bool) -> LaunchShape:
    """Warps and register cap of a launch of :func:`default_tile` tiles: block-scaled states
    run 2 warps at 128 registers (eight elements a thread), unscaled states 8 warps at 80."""
    if not scaled:
        return LaunchShape(NUM_WARPS, MAX_REGISTERS)
    return LaunchShape(2, WIDE_MAX_REGISTERS)


def launch_shape(scaled: bool, num_warps: int | str = "auto",
                 max_registers: int | str | None = "auto") -> LaunchShape:
    """:func:`default_launch_shape` with ``num_warps`` and ``max_registers`` in place of its
    own where they are not "auto"."""
    default = default_launch_shape(scaled)
    return LaunchShape(default.num_warps if num_warps == "auto" else num_warps,
                       default.max_registers if max_registers == "auto" else max_registers)


def run_length(tb: int, bs: int, num_warps: int) -> int:
    """Elements a thread holds along a row of a [tb, bs] tile of ``num_warps`` warps, whose
    counts it sums alone (:func:`~srtrain.kernels.fused_adamw.count_sums`)."""
    return max(1, min(bs, tb * bs // (32 * num_warps)))


def keeps_table(scaled: bool, stochastic: bool, registers: int | None, four_bit: bool,
                aligned: bool) -> bool:
    """Whether a launch keeps each shard's table values in registers across its tiles: flat
    launches; stochastic ones with room (80 registers or more); nearest ones on aligned
    rows without a 4-bit state at 128 registers or more. On sm_90 keeping saves stochastic
    FP8 4 instructions an element and FP4 1.5 (H200: FP8 59.7 -> 61.0% of copy, BF16
    parameters 34.2 -> 35.3%, 2026-11-30-h200-ab-flags-keep-cap64-2ec206b.json). At eight
    elements a thread and 128 registers nearest FP8 gains too (79.5 -> 81.2%), while nearest
    FP4, which then spills, loses (63.8 -> 62.4%, 2026-11-30-h200-ab-count-sums.json), and
    so does nearest FP8 on rows of 5461 columns (57.5 -> 57.2%, BF16 parameters 42.7 ->
    42.2%, 2026-11-30-h200-ab-keep-nearest.json)."""
    if not scaled:
        return True
    if stochastic:
        return registers is None or registers >= MAX_REGISTERS
    return (aligned and not four_bit
            and (registers is None or registers >= WIDE_MAX_REGISTERS))


def default_quad_loads(scaled: bool, fp32_params: bool) -> bool:
    """Whether a launch on aligned block-scaled rows on the GPU loads a float32 parameter
    and gradient four elements at a time in PTX
    (:func:`~srtrain.kernels.fused_adamw.load_quads`): all of them. The byte pairs of a
    4-bit state lay the tile out with eight elements a thread; tl.load of float32 asks for
    four, and the compiler converts the new moments, the parameter and the counts between
    the two through shared memory (sm_90, a full tile of stochastic FP4: 12 layout
    conversions, 24 barriers and 9 spill loads in the tile loop without, 2, 4 and 0 with).
    FP8 steps gain too since their non-finite gradient count no longer lays the gradient
    out one element a thread (H200, stochastic 76.7 -> 78.2% of copy, nearest unchanged,
    2026-12-01-h200-compare-quad-loads-fp8-6704cfc.json). A compiled kernel whose layout
    :func:`~srtrain.kernels.multi_adamw.quads_in_order` refuses launches with tl.load."""
    return scaled and fp32_params


def default_line_stores(stochastic: bool) -> bool:
    """Whether a launch on block-scaled rows without the vectorised accesses stores a float32
    parameter through tl.store (its layout converted through shared memory, so that a
    warp's store covers 128 consecutive bytes, one or two lines) rather than one element at a
    time from the tile's layout (eight elements a thread: a warp's store touches eight
    lines): for nearest rounding. Side by side on the H200, rows of 5461, share of copy
    (2026-12-01-h200-trees-param-stores-rows-5461-105cad2.json, then
    …-param-stores-keep-rows-5461-105cad2.json): FP8 nearest 58.7 -> 67.0% and 59.1 ->
    67.1%, FP4 nearest 58.3 -> 59.5% and 58.3 -> 59.5%; stochastic FP4 held (54.6 -> 54.9%
    and 54.6 -> 54.8%), and stochastic FP8, which spilled at 128 registers with the
    conversion, lost (59.2 -> 54.6% and 59.3 -> 54.7%; without its table kept in
    registers, 59.3 -> 58.1%)."""
    return not stochastic


def default_run_accesses(stochastic: bool, four_bit: bool) -> bool:
    """Whether full tiles of block-scaled rows without the vectorised accesses load a float32
    parameter and gradient (and store the parameter where :func:`default_line_stores` does
    not) eight elements a thread in 8-byte pieces where the elements allow
    (:func:`~srtrain.kernels.fused_adamw.load_runs`) rather than one element at a time: all
    but stochastic steps of a 4-bit state. Side by side on the H200, rows of 5461, share of
    copy (2026-12-01-h200-trees-run-accesses-rows-5461-113a609.json): FP8 nearest 70.8 ->
    72.0%, stochastic 59.2 -> 60.7%, FP4 nearest 62.4 -> 64.0%, stochastic FP4 54.6 ->
    54.4% (it issues what its budget allows, and the runs issue more). Runs split into
    16-byte pieces by a branch on their place in a 16-byte window lost everywhere (FP8
    nearest 70.7 -> 67.3%, stochastic FP4 54.7 -> 46.4%;
    2026-12-01-h200-compare-run-accesses-16-byte-rows-5461-113a609.json): ptxas compiled the
    branch to a jump table and moved registers between the pieces' layouts."""
    return not (stochastic and four_bit)
