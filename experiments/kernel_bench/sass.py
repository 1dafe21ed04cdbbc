"""Instruction counts of the fused step compiled for sm_90, without a GPU.

Triton compiles the kernel ahead of time for an H100/H200 target, as the optimizer
launches it (default tile, 8 warps, the register cap), and ``cuobjdump`` (shipped with
Triton) lists its machine code. The tile loop is the innermost backward branch; its
instructions divided by the elements each thread holds give the instructions one element
costs, per-tile work included. The loop holds the slow paths of IEEE division and square
root, which run only for operands outside the fast path's range (zero, subnormal, huge,
±Inf, NaN): the fast path's count leaves out the instructions that a predicated branch
skips to pass them (:func:`slow_paths`). Launches run full tiles without masks, apart
from the rest: the loop holds both paths, and a full tile costs the loop's instructions
less those of the same kernel compiled with masks alone. A memory-bound
step at the copy bandwidth B (bytes/s) leaves 4 schedulers × 132 SMs × clock /
(B / bytes per element) thread-instructions per element; a kernel over that budget cannot
reach B.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

H200_SMS = 132
H200_CLOCK_HZ = 1.98e9
ISSUE_PER_SM_PER_CLOCK = 4 * 32  # four schedulers, one warp instruction each per clock


@contextmanager
def _tiles_never_full():
    """Compile the fused step as if no tile were full (``_full`` false): its loop then holds
    the masked tile path alone, whose instructions the report subtracts from the loop of
    both paths. Triton keys a compiled kernel on its source and the source of what it
    calls, so the keys of the functions that call ``_full`` are reset on the way in and
    out."""
    import triton

    from srtrain.kernels import step_kernel

    @triton.jit
    def never_full(table, tile, SHAPE):
        return False

    callers = (
        step_kernel._load_ahead,
        step_kernel._tile_step,
        step_kernel.multi_adamw_kernel,
    )
    full = step_kernel._full

    def reset() -> None:
        for fn in callers:
            fn.hash = None

    step_kernel._full = never_full
    reset()
    try:
        yield
    finally:
        step_kernel._full = full
        reset()


def _compile(
    m_format: str,
    v_format: str,
    stochastic: bool,
    aligned: bool = True,
    bf16_params: bool = False,
    masked: bool = False,
    tile: int | None = None,
    health: bool = False,
    **choices,
):
    """The fused step compiled for sm_90 as :class:`MultiStep` launches it over one shard of
    4096 columns (``aligned``) or of 5461 (rows without the vectorised accesses), FP32 or
    BF16 parameters and gradients, with ``tile`` and the launch plan's ``choices``
    (:func:`~srtrain.kernels.launch_plan.launch_plan`); with ``masked``, every tile takes
    the masked path (:func:`_tiles_never_full`); with ``health``, the step of a log step,
    which counts the health counts (else the ordinary step)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from srtrain.kernels.launch import MultiStep, Shard
    from srtrain.kernels.launch_plan import launch_plan
    from srtrain.kernels.step_kernel import multi_adamw_kernel
    from srtrain.numerics.formats import get_format
    from srtrain.numerics.rounding import empty_state

    dtype = torch.bfloat16 if bf16_params else torch.float32
    shape = (4, 4096 if aligned else 5461)
    shard = Shard(
        torch.zeros(shape, dtype=dtype),
        empty_state(m_format, shape, 32, "cpu"),
        empty_state(v_format, shape, 32, "cpu"),
        0,
        0,
    )
    plan = launch_plan(
        [shape],
        dtype,
        dtype,
        get_format(m_format),
        get_format(v_format),
        32,
        stochastic,
        tile=tile,
        hardware=True,
        **choices,
    )
    step = MultiStep([shard], dtype, stochastic, stochastic, stochastic, plan=plan)
    constants = step.kernel_constexprs(step.static_aligned, health)
    signature = {
        "static": "*i64",
        "dynamic": "*i32",
        "counts": "*i64",
        "tile_shard": "*i32",
        "total_tiles": "i32",
        "tiles_per_program": "i32",
    }
    signature.update({k: "constexpr" for k in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    options = {"num_warps": plan.num_warps, "enable_fp_fusion": False}
    if plan.max_registers is not None:
        options["maxnreg"] = plan.max_registers
    with _tiles_never_full() if masked else nullcontext():
        source = ASTSource(multi_adamw_kernel, signature, constants, attrs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


class Instruction(NamedTuple):
    """One machine instruction: its address, opcode, branch target (branches only) and
    whether a predicate guards it."""

    address: int
    opcode: str
    target: int | None = None
    predicated: bool = False


# opcodes that touch memory or synchronise threads: no slow path of division or square root
# holds one
_MEMORY_OPCODES = frozenset(
    {"LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR", "ATOM", "ATOMG", "RED", "REDG"}
)


def disassemble(cubin: bytes) -> tuple[int, str]:
    """(registers per thread, the SASS listing) of a compiled kernel's cubin, by the
    ``cuobjdump`` Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tool, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), sass


def _machine_code(kernel) -> tuple[int, list[Instruction]]:
    """(registers per thread, its instructions in address order) of a kernel."""
    registers, sass = disassemble(kernel.asm["cubin"])
    listing = []
    for line in sass.splitlines():
        instruction = re.match(
            r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", line
        )
        if instruction:
            target = re.search(r"(0x[0-9a-f]+)", instruction.group(4))
            branch = instruction.group(3) == "BRA" and target is not None
            listing.append(
                Instruction(
                    int(instruction.group(1), 16),
                    instruction.group(3),
                    int(target.group(1), 16) if branch else None,
                    instruction.group(2) is not None,
                )
            )
    return registers, listing


def loop_range(listing: list[Instruction]) -> tuple[int, int]:
    """First and last address of the innermost loop (the shortest backward branch's body;
    the branch to itself that ends the code is none)."""
    loops = [
        (i.address - i.target, i.target, i.address)
        for i in listing
        if i.target is not None and i.target < i.address
    ]
    if not loops:
        raise RuntimeError("no loop found in the fused step's machine code")
    _, first, last = min(loops)
    return first, last


def slow_paths(listing: list[Instruction]) -> set[int]:
    """Addresses of the instructions that a predicated forward branch skips where those
    instructions call a subroutine and touch no memory: the slow paths of IEEE division
    and square root (the call of the full routine, and the four-value square roots'
    fallback), which the fast path passes by."""
    skipped = set()
    for branch in listing:
        if branch.predicated and branch.target is not None and branch.target > branch.address:
            body = [i for i in listing if branch.address < i.address < branch.target]
            opcodes = {i.opcode for i in body}
            if "CALL" in opcodes and not opcodes & _MEMORY_OPCODES:
                skipped.update(i.address for i in body)
    return skipped


def tile_loop(listing: list[Instruction], fast_path: bool = False) -> Counter:
    """Opcodes of the innermost loop (:func:`loop_range`); with ``fast_path``, less its
    :func:`slow_paths`."""
    first, last = loop_range(listing)
    skipped = slow_paths(listing) if fast_path else set()
    return Counter(
        i.opcode for i in listing if first <= i.address <= last and i.address not in skipped
    )


def _elements_per_thread(kernel, scaled: bool, tile: int | None = None) -> int:
    """Elements each thread of a compiled step holds (tiles of ``tile`` elements; None: the
    default tile)."""
    from srtrain.kernels.launch_plan import default_tile

    return (tile or default_tile(scaled, hardware=True)) // (32 * kernel.metadata.num_warps)


def instruction_budget(bytes_per_element: float, bandwidth: float = 4.19e12) -> float:
    """Thread-instructions per element an H200 can issue while moving data at ``bandwidth``."""
    elements_per_s = bandwidth / bytes_per_element
    return H200_SMS * H200_CLOCK_HZ * ISSUE_PER_SM_PER_CLOCK / elements_per_s


def _loop_counts(m_format: str, v_format: str, stochastic: bool, **launch) -> dict:
    """Registers (used, and the cap), warps, tile-loop opcodes and instructions per element
    of full and of masked tiles, all and on the fast path, of the step compiled with
    ``launch`` (:func:`_compile`'s options)."""
    from srtrain.numerics.formats import get_format

    scaled = get_format(m_format).scaled or get_format(v_format).scaled
    kernel = _compile(m_format, v_format, stochastic, **launch)
    per_thread = _elements_per_thread(kernel, scaled, launch.get("tile"))
    registers, listing = _machine_code(kernel)
    masked_listing = _machine_code(_compile(m_format, v_format, stochastic, masked=True, **launch))[
        1
    ]
    loop, masked_loop = tile_loop(listing), tile_loop(masked_listing)
    fast = sum(tile_loop(listing, fast_path=True).values()) / per_thread
    masked_fast = sum(tile_loop(masked_listing, fast_path=True).values()) / per_thread
    masked = sum(masked_loop.values()) / per_thread
    # the loop holds both tile paths; a full tile's opcodes are the difference, per opcode
    full_opcodes = {
        op: loop[op] - masked_loop[op]
        for op in sorted(loop | masked_loop)
        if loop[op] != masked_loop[op]
    }
    return {
        "registers": registers,
        "register_cap": kernel.metadata.maxnreg,
        "num_warps": kernel.metadata.num_warps,
        "loop": loop,
        "full": sum(loop.values()) / per_thread - masked,
        "masked": masked,
        "full_fast_path": fast - masked_fast,
        "masked_fast_path": masked_fast,
        "per_thread": per_thread,
        "full_opcodes": full_opcodes,
    }


def _loop_lines(kernel) -> Counter:
    """Tile-loop instructions of a kernel on its fast path (:func:`slow_paths` left out) by
    the source line they were compiled from (``file:line``, from ``nvdisasm``'s line
    information; ``?`` where it names none)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [tool, "-g", "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    listing = _machine_code(kernel)[1]
    first, last = loop_range(listing)
    skipped = slow_paths(listing)
    where, counts = "?", Counter()
    for line in sass.splitlines():
        source = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if source:
            where = f"{source.group(1)}:{source.group(2)}"
            continue
        instruction = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+[^;]*;", line)
        address = int(instruction.group(1), 16) if instruction else -1
        if first <= address <= last and address not in skipped:
            counts[where] += 1
    return counts


def _local_path(path: str) -> str:
    """``path``, or where it is not here, the file at the same place in the srtrain or
    Triton package imported now: Triton's cache keys a compiled kernel by its source, not
    by where that source lay, so a kernel compiled from another checkout names its files."""
    if os.path.exists(path):
        return path
    import triton

    import srtrain

    parts = path.split(os.sep)
    for package in (srtrain, triton):
        root = os.path.dirname(package.__file__)
        name = os.path.basename(root)
        if name in parts:
            inner = parts[len(parts) - parts[::-1].index(name) :]
            candidate = os.path.join(root, *inner)
            if os.path.exists(candidate):
                return candidate
    return path


def _source_text(where: str) -> str:
    """The source line at ``file:line``, or "" where the file is not at hand."""
    path, _, number = where.rpartition(":")
    try:
        with open(_local_path(path), encoding="utf-8") as f:
            return f.read().splitlines()[int(number) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""


def line_report(pairs: list[tuple[str, str]], health: bool = False) -> list[dict]:
    """Instructions per element of a full tile on its fast path by source line, for each
    state pair with FP32 parameters on aligned rows, nearest and stochastic: the loop's
    fast-path instructions of each line less those of the kernel compiled with masked
    tiles alone (as :func:`instruction_report` counts a full tile), most first. The lines
    add up to the report's ``fast_path_instructions_per_element``. ``health``: the step
    that counts the health counts (:func:`_compile`)."""
    _check_compiled()
    from srtrain.numerics.formats import get_format

    rows = []
    for m_fmt, v_fmt in pairs:
        scaled = get_format(m_fmt).scaled or get_format(v_fmt).scaled
        for stochastic in (False, True):
            kernel = _compile(m_fmt, v_fmt, stochastic, health=health)
            per_thread = _elements_per_thread(kernel, scaled)
            full = _loop_lines(kernel)
            masked = _loop_lines(_compile(m_fmt, v_fmt, stochastic, masked=True, health=health))
            cost = {
                where: (full[where] - masked[where]) / per_thread
                for where in full | masked
                if full[where] != masked[where]
            }
            for where, per_element in sorted(cost.items(), key=lambda item: -item[1]):
                rows.append(
                    {
                        "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'} "
                        f"{os.path.basename(where)}",
                        "instructions_per_element": per_element,
                        "source": _source_text(where),
                    }
                )
    return rows


def _check_compiled() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the instruction report compiles kernels; unset TRITON_INTERPRET")


def instruction_report(health: bool = False) -> list[dict]:
    """Registers and tile-loop instructions per element of the fused step per state format:
    of the ordinary step, or with ``health`` of the step that counts the health counts."""
    _check_compiled()
    import torch

    from experiments.kernel_bench.rows import STATE_PAIRS, bench_shape, step_bytes

    rows = []
    variants = [(m, v, True, False) for m, v in (("fp32", "fp32"), *STATE_PAIRS)]
    variants += [(m, v, False, False) for m, v in STATE_PAIRS[1:]]  # rows of odd length
    variants += [(m, v, True, True) for m, v in STATE_PAIRS]  # BF16 parameters and gradients
    for m_fmt, v_fmt, aligned, bf16_params in variants:
        dtype = torch.bfloat16 if bf16_params else torch.float32
        per_element = step_bytes(bench_shape(2**20), m_fmt, v_fmt, dtype, dtype, 32) / 2**20
        for stochastic in (False, True):
            shape = dict(aligned=aligned, bf16_params=bf16_params, health=health)
            counts = _loop_counts(m_fmt, v_fmt, stochastic, **shape)
            loop = counts["loop"]
            rows.append(
                {
                    "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}"
                    + ("" if aligned else ", unaligned rows")
                    + (", BF16 params" if bf16_params else ""),
                    "num_warps": counts["num_warps"],
                    "registers": counts["registers"],
                    "register_cap": counts["register_cap"],
                    "registers_without_cap": _machine_code(
                        _compile(m_fmt, v_fmt, stochastic, max_registers=None, **shape)
                    )[0],
                    "instructions_per_element": counts["full"],
                    "masked_tile_instructions_per_element": counts["masked"],
                    "fast_path_instructions_per_element": counts["full_fast_path"],
                    "masked_tile_fast_path_instructions_per_element": counts["masked_fast_path"],
                    "spill_instructions_in_loop": loop["LDL"] + loop["STL"],
                    "shared_memory_instructions_in_loop": loop["LDS"] + loop["STS"],
                    "barriers_in_loop": loop["BAR"],
                    "budget_at_copy_bandwidth": instruction_budget(per_element),
                    "bytes_per_element": per_element,
                    "elements_per_thread": counts["per_thread"],
                    "full_tile_opcodes": counts["full_opcodes"],
                }
            )
    return rows


def launch_shape_report(pairs=None, shapes=None) -> list[dict]:
    """Instructions per element and spills of the block-scaled steps (FP32 parameters,
    aligned rows) at each launch shape of the GPU sweep (``bench.kernels.SWEEP_SHAPES``:
    tile, warps, registers), so the sweep's timings can be read against them."""
    _check_compiled()
    from experiments.kernel_bench.rows import STATE_PAIRS, SWEEP_SHAPES

    rows = []
    for m_fmt, v_fmt in pairs or STATE_PAIRS[1:]:
        for stochastic in (False, True):
            for tile, warps, cap in shapes or SWEEP_SHAPES:
                counts = _loop_counts(
                    m_fmt, v_fmt, stochastic, tile=tile, num_warps=warps, max_registers=cap
                )
                loop = counts["loop"]
                rows.append(
                    {
                        "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}",
                        "tile": tile,
                        "num_warps": warps,
                        "max_registers": cap,
                        "registers": counts["registers"],
                        "elements_per_thread": tile // (32 * warps),
                        "instructions_per_element": counts["full"],
                        "masked_tile_instructions_per_element": counts["masked"],
                        "fast_path_instructions_per_element": counts["full_fast_path"],
                        "spill_instructions_in_loop": loop["LDL"] + loop["STL"],
                    }
                )
    return rows
