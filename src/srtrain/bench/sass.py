"""Instruction counts of the fused step compiled for sm_90, without a GPU.

Triton compiles the kernel ahead of time for an H100/H200 target and ``cuobjdump`` (shipped
with Triton) lists its machine code. Compiling each variant with tiles of 1024 and 2048
elements (4 and 8 per thread at 8 warps) and dividing the difference in instructions by
the 4 extra elements per thread gives the instructions each element costs. A memory-bound
step at the copy bandwidth B (bytes/s) leaves 4 schedulers × 132 SMs × clock / (B / bytes
per element) thread-instructions per element; a kernel over that budget cannot reach B.
The difference also carries whatever layout conversions change between the two tile sizes,
so the report lists the shared-memory instructions and barriers of the 1024-element
kernel (the default) as they stand.
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


def _compile(m_format: str, v_format: str, stochastic: bool, tile: int, num_warps: int):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from srtrain.kernels.multi_adamw import multi_adamw_kernel
    from srtrain.kernels.triton_numerics import format_constexprs
    from srtrain.numerics.formats import get_format

    fm, fv = get_format(m_format), get_format(v_format)
    scaled = fm.scaled or fv.scaled
    bs = 32 if scaled else 256
    codes = {"fp32": tl.float32, "bf16": tl.int16}
    signature = {"static": "*i64", "dynamic": "*i32", "counts": "*i64", "tile_shard": "*i32",
                 "total_tiles": "i32", "tiles_per_program": "i32"}
    constants = dict(P_T=tl.float32, G_T=tl.float32, MC_T=codes.get(fm.name, tl.uint8),
                     VC_T=codes.get(fv.name, tl.uint8), TB=tile // bs, BS=bs, FLAT=not scaled,
                     ALIGNED=True, P_BF16=False, G_BF16=False, P_SR=stochastic,
                     M_SR=stochastic, V_SR=stochastic, **format_constexprs("M_", fm),
                     **format_constexprs("V_", fv))
    signature.update({k: "constexpr" for k in constants})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = ASTSource(multi_adamw_kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def _machine_code(kernel) -> tuple[int, Counter]:
    """(registers per thread, instructions by opcode) of a compiled kernel."""
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
    opcodes = Counter()
    for line in sass.splitlines():
        instruction = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if instruction:
            opcodes[instruction.group(1)] += 1
    return registers, opcodes


def instruction_budget(bytes_per_element: float, bandwidth: float = 4.19e12) -> float:
    """Thread-instructions per element an H200 can issue while moving data at ``bandwidth``."""
    elements_per_s = bandwidth / bytes_per_element
    return H200_SMS * H200_CLOCK_HZ * ISSUE_PER_SM_PER_CLOCK / elements_per_s


def instruction_report(num_warps: int = 8) -> list[dict]:
    """Registers and instructions per element of the fused step for every state format."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the instruction report compiles kernels; unset TRITON_INTERPRET")
    import torch

    from srtrain.bench.kernels import bench_shape, step_bytes

    rows = []
    for m_fmt, v_fmt in (("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "fp8"),
                         ("fp4_e2m1", "fp4_e2m2")):
        per_element = step_bytes(bench_shape(2**20), m_fmt, v_fmt, torch.float32,
                                 torch.float32, 32) / 2**20
        for stochastic in (False, True):
            regs, small = _machine_code(_compile(m_fmt, v_fmt, stochastic, 1024, num_warps))
            _, large = _machine_code(_compile(m_fmt, v_fmt, stochastic, 2048, num_warps))
            per_thread = 1024 // (32 * num_warps)
            extra = {op: (large[op] - small[op]) / per_thread for op in large | small}
            rows.append({
                "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}",
                "registers": regs,
                "instructions_per_element": sum(extra.values()),
                "shared_memory_instructions": small["LDS"] + small["STS"],
                "barriers": small["BAR"],
                "budget_at_copy_bandwidth": instruction_budget(per_element),
                "bytes_per_element": per_element,
            })
    return rows
