"""Instruction counts of the fused step compiled for sm_90, without a GPU.

Triton compiles the kernel ahead of time for an H100/H200 target, as the optimizer
launches it (default tile, 8 warps, the register cap), and ``cuobjdump`` (shipped with
Triton) lists its machine code. The tile loop is the innermost backward branch; its
instructions divided by the elements each thread holds give the instructions one element
costs, per-tile work included (the branches around the rare slow paths of division and
square root count, their bodies do not). Launches run full tiles without masks, apart
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

H200_SMS = 132
H200_CLOCK_HZ = 1.98e9
ISSUE_PER_SM_PER_CLOCK = 4 * 32  # four schedulers, one warp instruction each per clock


def _compile(m_format: str, v_format: str, stochastic: bool, aligned: bool = True,
             bf16_params: bool = False, **launch):
    """The fused step compiled for sm_90 as :class:`MultiStep` launches it over one shard of
    4096 columns (``aligned``) or of 5461 (rows without the vectorised accesses), FP32 or
    BF16 parameters and gradients; ``launch`` takes MultiStep's tuning arguments (``tile``,
    ``num_warps``, ``max_registers``, ``full_tiles``, ``l2_ahead``, ``l2_every_thread``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from srtrain.kernels.multi_adamw import MultiStep, Shard, multi_adamw_kernel
    from srtrain.numerics.rounding import empty_state

    dtype = torch.bfloat16 if bf16_params else torch.float32
    shape = (4, 4096 if aligned else 5461)
    shard = Shard(torch.zeros(shape, dtype=dtype), empty_state(m_format, shape, 32, "cpu"),
                  empty_state(v_format, shape, 32, "cpu"), 0, 0)
    step = MultiStep([shard], dtype, stochastic, stochastic, stochastic, **launch)
    constants = step.kernel_constexprs(step.static_aligned)
    signature = {"static": "*i64", "dynamic": "*i32", "counts": "*i64", "tile_shard": "*i32",
                 "total_tiles": "i32", "tiles_per_program": "i32"}
    signature.update({k: "constexpr" for k in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = ASTSource(multi_adamw_kernel, signature, constants, attrs)
    shape = step.launch_shape()
    options = {"num_warps": shape.num_warps, "enable_fp_fusion": False}
    if shape.max_registers is not None:
        options["maxnreg"] = shape.max_registers
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _machine_code(kernel) -> tuple[int, list[tuple[int, str, int | None]]]:
    """(registers per thread, [(address, opcode, branch target or None)]) of a kernel."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    listing = []
    for line in sass.splitlines():
        instruction = re.match(
            r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", line)
        if instruction:
            target = re.search(r"(0x[0-9a-f]+)", instruction.group(3))
            branch = instruction.group(2) == "BRA" and target is not None
            listing.append((int(instruction.group(1), 16), instruction.group(2),
                            int(target.group(1), 16) if branch else None))
    return registers, listing


def loop_range(listing: list[tuple[int, str, int | None]]) -> tuple[int, int]:
    """First and last address of the innermost loop (the shortest backward branch's body;
    the branch to itself that ends the code is none)."""
    loops = [(address - target, target, address) for address, _, target in listing
             if target is not None and target < address]
    if not loops:
        raise RuntimeError("no loop found in the fused step's machine code")
    _, first, last = min(loops)
    return first, last


def tile_loop(listing: list[tuple[int, str, int | None]]) -> Counter:
    """Opcodes of the innermost loop (:func:`loop_range`)."""
    first, last = loop_range(listing)
    return Counter(op for address, op, _ in listing if first <= address <= last)


def _elements_per_thread(kernel, scaled: bool, tile: int | None = None) -> int:
    """Elements each thread of a compiled step holds (tiles of ``tile`` elements; None: the
    default tile)."""
    from srtrain.kernels.launch_shape import default_tile

    return (tile or default_tile(scaled)) // (32 * kernel.metadata.num_warps)


def instruction_budget(bytes_per_element: float, bandwidth: float = 4.19e12) -> float:
    """Thread-instructions per element an H200 can issue while moving data at ``bandwidth``."""
    elements_per_s = bandwidth / bytes_per_element
    return H200_SMS * H200_CLOCK_HZ * ISSUE_PER_SM_PER_CLOCK / elements_per_s


def _loop_counts(m_format: str, v_format: str, stochastic: bool, **launch) -> dict:
    """Registers (used, and the cap), warps, tile-loop opcodes and instructions per element
    of full and of masked tiles of the step compiled with ``launch`` (:func:`_compile`'s
    options)."""
    from srtrain.numerics.formats import get_format

    scaled = get_format(m_format).scaled or get_format(v_format).scaled
    kernel = _compile(m_format, v_format, stochastic, **launch)
    per_thread = _elements_per_thread(kernel, scaled, launch.get("tile"))
    registers, listing = _machine_code(kernel)
    loop = tile_loop(listing)
    masked_loop = tile_loop(_machine_code(_compile(
        m_format, v_format, stochastic, **{**launch, "full_tiles": False}))[1])
    masked = sum(masked_loop.values()) / per_thread
    # the loop holds both tile paths; a full tile's opcodes are the difference, per opcode
    full_opcodes = {op: loop[op] - masked_loop[op] for op in sorted(loop | masked_loop)
                    if loop[op] != masked_loop[op]}
    return {"registers": registers, "register_cap": kernel.metadata.maxnreg,
            "num_warps": kernel.metadata.num_warps, "loop": loop,
            "full": sum(loop.values()) / per_thread - masked, "masked": masked,
            "per_thread": per_thread, "full_opcodes": full_opcodes}


def _loop_lines(kernel) -> Counter:
    """Tile-loop instructions of a kernel by the source line they were compiled from
    (``file:line``, from ``nvdisasm``'s line information; ``?`` where it names none)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-g", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    first, last = loop_range(_machine_code(kernel)[1])
    where, counts = "?", Counter()
    for line in sass.splitlines():
        source = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if source:
            where = f"{source.group(1)}:{source.group(2)}"
            continue
        instruction = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+[^;]*;", line)
        if instruction and first <= int(instruction.group(1), 16) <= last:
            counts[where] += 1
    return counts


def _source_text(where: str) -> str:
    """The source line at ``file:line``, or "" where the file is not at hand."""
    path, _, number = where.rpartition(":")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()[int(number) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""


def line_report(pairs: list[tuple[str, str]]) -> list[dict]:
    """Instructions per element of a full tile by source line, for each state pair with
    FP32 parameters on aligned rows, nearest and stochastic: the loop's instructions of
    each line less those of the kernel compiled with masked tiles alone (as
    :func:`instruction_report` counts a full tile), most first. The lines add up to the
    report's ``instructions_per_element``."""
    _check_compiled()
    from srtrain.numerics.formats import get_format

    rows = []
    for m_fmt, v_fmt in pairs:
        scaled = get_format(m_fmt).scaled or get_format(v_fmt).scaled
        for stochastic in (False, True):
            kernel = _compile(m_fmt, v_fmt, stochastic)
            per_thread = _elements_per_thread(kernel, scaled)
            full = _loop_lines(kernel)
            masked = _loop_lines(_compile(m_fmt, v_fmt, stochastic, full_tiles=False))
            cost = {where: (full[where] - masked[where]) / per_thread
                    for where in full | masked if full[where] != masked[where]}
            for where, per_element in sorted(cost.items(), key=lambda item: -item[1]):
                rows.append({"name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'} "
                                     f"{os.path.basename(where)}",
                             "instructions_per_element": per_element,
                             "source": _source_text(where)})
    return rows


def _check_compiled() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the instruction report compiles kernels; unset TRITON_INTERPRET")


def instruction_report() -> list[dict]:
    """Registers and tile-loop instructions per element of the fused step per state format."""
    _check_compiled()
    import torch

    from srtrain.bench.kernels import STATE_PAIRS, bench_shape, step_bytes

    rows = []
    variants = [(m, v, True, False) for m, v in (("fp32", "fp32"), *STATE_PAIRS)]
    variants += [(m, v, False, False) for m, v in STATE_PAIRS[1:]]  # rows of odd length
    variants += [(m, v, True, True) for m, v in STATE_PAIRS]  # BF16 parameters and gradients
    for m_fmt, v_fmt, aligned, bf16_params in variants:
        dtype = torch.bfloat16 if bf16_params else torch.float32
        per_element = step_bytes(bench_shape(2**20), m_fmt, v_fmt, dtype, dtype, 32) / 2**20
        for stochastic in (False, True):
            shape = dict(aligned=aligned, bf16_params=bf16_params)
            counts = _loop_counts(m_fmt, v_fmt, stochastic, **shape)
            loop = counts["loop"]
            rows.append({
                "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}"
                        + ("" if aligned else ", unaligned rows")
                        + (", BF16 params" if bf16_params else ""),
                "num_warps": counts["num_warps"],
                "registers": counts["registers"],
                "register_cap": counts["register_cap"],
                "registers_without_cap": _machine_code(
                    _compile(m_fmt, v_fmt, stochastic, max_registers=None, **shape))[0],
                "instructions_per_element": counts["full"],
                "masked_tile_instructions_per_element": counts["masked"],
                "spill_instructions_in_loop": loop["LDL"] + loop["STL"],
                "shared_memory_instructions_in_loop": loop["LDS"] + loop["STS"],
                "barriers_in_loop": loop["BAR"],
                "budget_at_copy_bandwidth": instruction_budget(per_element),
                "bytes_per_element": per_element,
                "elements_per_thread": counts["per_thread"],
                "full_tile_opcodes": counts["full_opcodes"],
            })
    return rows


def launch_shape_report(pairs=None, shapes=None) -> list[dict]:
    """Instructions per element and spills of the block-scaled steps (FP32 parameters,
    aligned rows) at each launch shape of the GPU sweep (``bench.kernels.SWEEP_SHAPES``:
    tile, warps, registers), so the sweep's timings can be read against them."""
    _check_compiled()
    from srtrain.bench.kernels import STATE_PAIRS, SWEEP_SHAPES

    rows = []
    for m_fmt, v_fmt in pairs or STATE_PAIRS[1:]:
        for stochastic in (False, True):
            for tile, warps, cap in shapes or SWEEP_SHAPES:
                counts = _loop_counts(m_fmt, v_fmt, stochastic, tile=tile, num_warps=warps,
                                      max_registers=cap)
                loop = counts["loop"]
                rows.append({
                    "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}",
                    "tile": tile, "num_warps": warps, "max_registers": cap,
                    "registers": counts["registers"],
                    "elements_per_thread": tile // (32 * warps),
                    "instructions_per_element": counts["full"],
                    "masked_tile_instructions_per_element": counts["masked"],
                    "spill_instructions_in_loop": loop["LDL"] + loop["STL"],
                })
    return rows
