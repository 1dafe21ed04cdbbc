"""One digest line per variant of the fused step's sm_90 machine code, without a GPU.

Compiles every variant of the fused AdamW step that the optimizer can launch, as
:class:`~srtrain.kernels.launch.MultiStep` builds it on the GPU (the default launch plan:
tile, warps, register cap and accesses), for sm_90 with Triton's bundled ``ptxas``, lists
its machine code with the bundled ``cuobjdump`` and prints, per variant::

    <variant>  regs=<registers> sass=<sha256 of the normalized SASS, 16 hex digits>

The normalized SASS is the instruction text (opcode, operands, encoding words) in order,
with the addresses in comments and the names of functions and symbols replaced by
placeholders, so two kernels that differ only in names give one digest. Variants:

- every m/v format pair the optimizer takes × FP32 or BF16 parameters and gradients ×
  nearest or stochastic rounding, on rows with the vectorised accesses (aligned); with
  FP32 parameters also the step that counts the health counts, and rows of odd length
  (no vectorised accesses);
- on a few pairs: mixed rounding (m only, parameter only, states but not the parameter),
  mixed parameter and gradient dtypes, the health counts without the vectorised accesses
  (odd rows; aligned rows under a misaligned gradient), rows narrower than a tile,
  shards whose indices cross a multiple of 2**32 (carry), a shard off its span (no span
  draws), and the masked tile path alone (the kernel bench's never-full tiles);
- the gated steps (a device gate scales the gradients or skips the shards; their lines end
  in ``gated=1``): every m/v format pair × FP32 or BF16 parameters and gradients × nearest
  or stochastic rounding on aligned rows, and on a few pairs the health counts (aligned
  and odd rows), rows narrower than a tile, carry and the masked tile path;
- the SR cast kernels of :mod:`srtrain.kernels.cast` (BF16, and each block-scaled format
  nearest and stochastic, on rows of a multiple of 16 elements or not), which share the
  tile's device functions.

Usage, from a checkout (``PYTHONPATH`` picks the tree whose kernels are compiled)::

    PYTHONPATH=src python tools/sass_digest.py [--jobs N] [--match REGEX] > digests.txt

Two trees compile to the same machine code when their outputs are identical (``diff``).
Unset ``TRITON_INTERPRET``: the tool compiles.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

# the checkout's experiments (the kernel bench), after the tree PYTHONPATH names
sys.path.append(str(Path(__file__).resolve().parents[1]))

MATCH_ALL = re.compile("")


class Variant(NamedTuple):
    """One compiled step: state formats, parameter and gradient dtypes, rounding of m, v
    and the parameter, the shard's shape and global offset, whether the launch takes the
    vectorised accesses, the health counts, the masked tile path alone, and the gate."""

    m: str
    v: str
    param: str
    grad: str
    rounding: tuple[bool, bool, bool]
    shape: tuple[int, int]
    offset: int
    aligned: bool
    health: bool
    masked: bool = False
    gated: bool = False

    def name(self) -> str:
        sr = "".join(c for c, on in zip("mvp", self.rounding, strict=True) if on) or "-"
        return (
            f"m={self.m} v={self.v} p={self.param} g={self.grad} sr={sr} "
            f"rows={self.shape[0]}x{self.shape[1]} offset={self.offset} "
            f"aligned={int(self.aligned)} health={int(self.health)} masked={int(self.masked)}"
            + (" gated=1" if self.gated else "")  # ungated lines read as before the gate
        )


M_FORMATS = ("fp32", "bf16", "fp8", "fp4_e2m1")
V_FORMATS = ("fp32", "bf16", "fp8", "fp4_e2m2")
ALIGNED_ROWS = (4, 4096)  # 16-element rows at 16-byte addresses
ODD_ROWS = (4, 5461)  # rows without the vectorised accesses
NARROW_ROWS = (64, 96)  # three 32-element blocks a row: several rows a tile
FEW_PAIRS = (("bf16", "bf16"), ("fp8", "fp8"), ("fp4_e2m1", "fp4_e2m2"), ("fp32", "fp8"))


def variants() -> list[Variant]:
    """Every variant the tool compiles (see the module docstring)."""
    out = []
    pairs = list(itertools.product(M_FORMATS, V_FORMATS))
    for (m, v), dtype, sr in itertools.product(pairs, ("fp32", "bf16"), (False, True)):
        out.append(Variant(m, v, dtype, dtype, (sr,) * 3, ALIGNED_ROWS, 0, True, False))
        if dtype == "fp32":
            out.append(Variant(m, v, dtype, dtype, (sr,) * 3, ALIGNED_ROWS, 0, True, True))
            out.append(Variant(m, v, dtype, dtype, (sr,) * 3, ODD_ROWS, 0, False, False))
    for m, v in FEW_PAIRS:
        out.append(
            Variant(m, v, "fp32", "fp32", (True, False, False), ALIGNED_ROWS, 0, True, False)
        )
        for rounding in ((False, False, True), (True, True, False)):
            out.append(Variant(m, v, "bf16", "bf16", rounding, ALIGNED_ROWS, 0, True, False))
        for param, grad in (("fp32", "bf16"), ("bf16", "fp32")):
            out.append(Variant(m, v, param, grad, (True,) * 3, ALIGNED_ROWS, 0, True, False))
        out.append(Variant(m, v, "bf16", "bf16", (True,) * 3, ODD_ROWS, 0, False, True))
        out.append(Variant(m, v, "fp32", "fp32", (True,) * 3, ALIGNED_ROWS, 0, False, True))
        for sr in (False, True):
            out.append(Variant(m, v, "fp32", "fp32", (sr,) * 3, NARROW_ROWS, 0, True, False))
        out.append(
            Variant(m, v, "fp32", "fp32", (True,) * 3, ALIGNED_ROWS, 2**32 - 4096, True, False)
        )
        out.append(Variant(m, v, "fp32", "fp32", (False,) * 3, ALIGNED_ROWS, 48, True, False))
        for sr, (shape, aligned) in itertools.product(
            (False, True), ((ALIGNED_ROWS, True), (ODD_ROWS, False))
        ):
            out.append(Variant(m, v, "fp32", "fp32", (sr,) * 3, shape, 0, aligned, False, True))
    return out + gated_variants()


def gated_variants() -> list[Variant]:
    """The gated steps the tool compiles (see the module docstring)."""
    out = []
    pairs = list(itertools.product(M_FORMATS, V_FORMATS))
    for (m, v), dtype, sr in itertools.product(pairs, ("fp32", "bf16"), (False, True)):
        out.append(Variant(m, v, dtype, dtype, (sr,) * 3, ALIGNED_ROWS, 0, True, False))
    for m, v in FEW_PAIRS:
        out.append(Variant(m, v, "fp32", "fp32", (True,) * 3, ALIGNED_ROWS, 0, True, True))
        out.append(Variant(m, v, "fp32", "fp32", (True,) * 3, ODD_ROWS, 0, False, True))
        out.append(Variant(m, v, "fp32", "fp32", (True,) * 3, NARROW_ROWS, 0, True, False))
        out.append(
            Variant(m, v, "fp32", "fp32", (True,) * 3, ALIGNED_ROWS, 2**32 - 4096, True, False)
        )
        out.append(Variant(m, v, "fp32", "fp32", (True,) * 3, ODD_ROWS, 0, False, False, True))
    return [variant._replace(gated=True) for variant in out]


class CastVariant(NamedTuple):
    """One compiled SR cast kernel: the format it rounds into, stochastic or nearest, rows of
    a multiple of 16 elements (aligned), keep-positive, indices crossing a multiple of 2**32
    (carry)."""

    fmt: str
    stochastic: bool
    aligned: bool
    keep_positive: bool
    carry: bool

    def name(self) -> str:
        return (
            f"cast={self.fmt} sr={int(self.stochastic)} aligned={int(self.aligned)} "
            f"keep_positive={int(self.keep_positive)} carry={int(self.carry)}"
        )


def cast_variants() -> list[CastVariant]:
    """The cast kernels the tool compiles: BF16 (flat), and each block-scaled format."""
    out = [
        CastVariant("bf16", sr, True, False, carry)
        for sr in (False, True)
        for carry in (False, True)
    ]
    for fmt, sr, aligned in itertools.product(
        ("fp8", "fp4_e2m1", "fp4_e2m2"), (False, True), (False, True)
    ):
        out.append(CastVariant(fmt, sr, aligned, fmt == "fp4_e2m2", False))
    out.append(CastVariant("fp8", True, True, False, True))
    return out


def compile_cast(variant: CastVariant):
    """The cast kernel of ``variant`` compiled for sm_90 (8 warps, as its launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from srtrain.kernels import cast
    from srtrain.kernels.state_codes import state_code
    from srtrain.numerics.formats import get_format

    common = {"offset": "i32", "k0": "i32", "k1": "i32"}
    if variant.fmt == "bf16":
        kernel = cast.bf16_cast_kernel
        runtime = {"x_ptr": "*fp32", "out_ptr": "*i16", "numel": "i32", **common}
        constants = {"BLOCK": 4096, "STOCHASTIC": variant.stochastic, "CARRY": variant.carry}
    else:
        kernel = cast.quantize_kernel
        runtime = {"x_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", **common}
        runtime.update({k: "i32" for k in ("rows", "cols", "tiles_per_row", "slot_bits")})
        constants = {
            "TB": 1024 // 32,  # tile_elements() on the GPU
            "BS": 32,
            "ALIGNED": variant.aligned,
            "STOCHASTIC": variant.stochastic,
            "KEEP_POSITIVE": variant.keep_positive,
            "CARRY": variant.carry,
            "F": state_code(get_format(variant.fmt)),
        }
    signature = {name: runtime.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3 if variant.fmt != "bf16" else 2)}
    options = {"num_warps": 8, "enable_fp_fusion": False}
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _kernel():
    """The fused step's jit kernel."""
    try:
        from srtrain.kernels.step_kernel import multi_adamw_kernel
    except ImportError:  # a tree whose kernel lives in the launcher's module
        from srtrain.kernels.launch import multi_adamw_kernel
    return multi_adamw_kernel


def compile_variant(variant: Variant):
    """The fused step of ``variant`` compiled for sm_90 as its launch compiles it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:  # a tree that carried the kernel bench in the package
        from srtrain.bench.sass import _tiles_never_full
    except ImportError:
        from experiments.kernel_bench.sass import _tiles_never_full
    from srtrain.kernels.launch import MultiStep, Shard
    from srtrain.kernels.launch_plan import launch_plan
    from srtrain.numerics.formats import get_format
    from srtrain.numerics.rounding import empty_state

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    param, grad = dtypes[variant.param], dtypes[variant.grad]
    shape = variant.shape
    shard = Shard(
        torch.zeros(shape, dtype=param),
        empty_state(variant.m, shape, 32, "cpu"),
        empty_state(variant.v, shape, 32, "cpu"),
        variant.offset,
        0,
    )
    m_sr, v_sr, p_sr = variant.rounding
    plan = launch_plan(
        [shape],
        param,
        grad,
        get_format(variant.m),
        get_format(variant.v),
        32,
        m_sr or v_sr,
        hardware=True,
    )
    step = MultiStep([shard], grad, m_sr, v_sr, p_sr, plan=plan)
    if variant.aligned and not step.static_aligned:
        raise ValueError(f"{variant.name()}: the shard does not allow the vectorised accesses")
    kernel = _kernel()
    # a tree without the gate compiles the ungated variants
    gate = {"gated": True} if variant.gated else {}
    constants = step.kernel_constexprs(variant.aligned, variant.health, **gate)
    runtime = {
        "static": "*i64",
        "dynamic": "*i32",
        "counts": "*i64",
        "tile_shard": "*i32",
        "total_tiles": "i32",
        "tiles_per_program": "i32",
    }
    signature = {name: runtime.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    options = {"num_warps": plan.num_warps, "enable_fp_fusion": False}
    if plan.max_registers is not None:
        options["maxnreg"] = plan.max_registers
    with _tiles_never_full() if variant.masked else nullcontext():
        source = ASTSource(kernel, signature, constants, attrs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_FUNCTION = re.compile(r"(Function|\.section|\.text)\s*:?\s*(\S+)")


def normalized_sass(cubin: bytes) -> tuple[int, str]:
    """(registers per thread, the SASS text of ``cubin`` normalized as the module says)."""
    from experiments.kernel_bench.sass import disassemble

    registers, sass = disassemble(cubin)
    names: dict[str, str] = {}
    lines = []
    for line in sass.splitlines():
        line = line.strip()
        if not line or line.startswith(("code for", "Fatbin", "arch", "identifier", "..")):
            continue
        function = _FUNCTION.match(line)
        if function:
            names.setdefault(function.group(2), f"<symbol{len(names)}>")
        lines.append(_ADDRESS.sub("", line))
    text = "\n".join(lines)
    for name, placeholder in sorted(names.items(), key=lambda item: -len(item[0])):
        text = text.replace(name, placeholder)
    return registers, " ".join(text.split())


def digest_line(variant: Variant | CastVariant) -> str:
    """The digest line of ``variant``."""
    compile_it = compile_cast if isinstance(variant, CastVariant) else compile_variant
    registers, text = normalized_sass(compile_it(variant).asm["cubin"])
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{variant.name()}  regs={registers} sass={digest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes (default 1)")
    parser.add_argument("--match", default="", help="only variants whose line matches REGEX")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: the tool compiles kernels; unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    pattern = re.compile(args.match) if args.match else MATCH_ALL
    chosen = [v for v in [*variants(), *cast_variants()] if pattern.search(v.name())]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for line in pool.map(digest_line, chosen):
                print(line, flush=True)
    else:
        for variant in chosen:
            print(digest_line(variant), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
