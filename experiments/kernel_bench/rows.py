"""Kernel benchmarks: the fused step and the SR cast against the device's copy bandwidth.

Times are medians of CUDA-event timings after warm-up. Kernel rows time the device
alone (a spin kernel covers the host's launch work); whole-model ``SRAdamW.step`` and
torch-step rows start from an idle GPU, so their host work counts. Bytes are the fewest
the operation must move (each input read once, each output written once); the floor is
bytes over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from srtrain.numerics.adamw import NUM_COUNTS, AdamWScalars, RoundingPlan
from srtrain.numerics.formats import NAMED_PAIRS, code_shape, get_format, scale_shape
from srtrain.numerics.rounding import (
    STATE_MOMENTS,
    STATE_PARAM,
    empty_state,
    quantize,
    rng_key,
)

SR_CAST_TILES = (1024, 16384)  # other tiles than the default (4096) for the SR cast rows


@dataclass
class Timing:
    """One benchmark row."""

    name: str
    numel: int
    bytes: int
    median_us: float
    tb_per_s: float
    fraction_of_copy: float

    @classmethod
    def against(cls, name: str, numel: int, nbytes: int, us: float, copy: Timing) -> Timing:
        """A row moving ``nbytes`` in ``us``: its rate and that rate over ``copy``'s
        (0 for a row that moves no bytes, such as host time)."""
        tbs = nbytes / us / 1e6
        return cls(name, numel, nbytes, us, tbs, tbs / copy.tb_per_s)


BENCH_COLS = 4096  # row length of the fused-step rows' tensors unless --cols says otherwise


def bench_shape(numel: int, row: int = BENCH_COLS) -> tuple[int, int]:
    """A 2-D shape of ``numel`` elements with rows of ``row`` (weights are matrices)."""
    if row < 1 or numel < row or numel % row:
        raise ValueError(f"numel {numel} must be a positive multiple of the row length {row}")
    return (numel // row, row)


def profile_range(name: str) -> str:
    """The NVTX range a fused-step row's timing runs in: its name with each run of
    characters other than letters, digits, '-' and '.' as one '.', so that
    ``ncu --nvtx --nvtx-include "RANGE/"`` selects its launches."""
    return re.sub(r"[^A-Za-z0-9.-]+", ".", name).strip(".")


def step_bytes(
    shape: tuple[int, ...],
    m_format: str,
    v_format: str,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    block_size: int,
) -> int:
    """Bytes one fused step must move: param r+w, grad r, each state's codes and scales r+w."""
    numel = math.prod(shape)
    total = 2 * numel * param_dtype.itemsize + numel * grad_dtype.itemsize
    for name in (m_format, v_format):
        fmt = get_format(name)
        codes = math.prod(code_shape(fmt, shape)) * max(1, fmt.bits // 8)
        scales = math.prod(scale_shape(shape, block_size)) if fmt.scaled else 0
        total += 2 * (codes + scales)
    return total


@functools.cache
def _spin_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep``, measured once."""
    cycles = 2_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1000.0)


def _median_us(fn, repeats: int, warmup: int = 5, device_only: bool = True) -> float:
    """Median CUDA-event time of ``fn`` after ``warmup`` calls.

    With ``device_only`` a spin kernel holds the GPU while the host enqueues ``fn``, so the
    time is the device's alone; otherwise the GPU starts idle and the host's work before the
    first launch counts too (as it does for a step nothing else overlaps).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    lead_cycles = 0
    if device_only:
        host_us = median_host_us(fn, 3)
        lead_cycles = int(_spin_cycles_per_us() * (2 * host_us + 50))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def copy_bandwidth(numel: int, repeats: int) -> Timing:
    """Device-to-device copy of ``numel`` float32 values (bytes read + written)."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src), repeats)
    nbytes = 8 * numel
    return Timing("copy fp32", numel, nbytes, us, nbytes / us / 1e6, 1.0)


def _prebuilt_step(items, **launch):
    """A MultiStep over ``items`` and a closure launching it (host tables built once);
    ``launch`` takes its ``tile`` and the choices of its launch plan
    (:func:`~srtrain.kernels.launch_plan.launch_plan`; "auto": the plan's own)."""
    from srtrain.kernels.launch import MultiStep, Shard, shards_plan, step_tables

    first = items[0]
    rounding = first.plan
    shards = [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items]
    chosen = {k: v for k, v in launch.items() if v != "auto"}
    tile = chosen.pop("tile", None)
    plan = (
        shards_plan(
            shards,
            first.grad.dtype,
            rounding.m_stochastic or rounding.v_stochastic,
            tile=tile,
            **chosen,
        )
        if chosen
        else None
    )
    step = MultiStep(
        shards,
        first.grad.dtype,
        rounding.m_stochastic,
        rounding.v_stochastic,
        rounding.param_stochastic,
        tile=None if plan else tile,
        plan=plan,
    )
    keys, floats = step_tables(items)
    grads = [i.grad for i in items]
    counts = torch.zeros(len(items), NUM_COUNTS, dtype=torch.int64, device=first.param.device)
    return lambda: step.launch(grads, keys, floats, counts, health=False)


# the low-precision state pairs the bench times, by name from numerics.formats.NAMED_PAIRS
STATE_PAIRS = tuple(
    (NAMED_PAIRS[name][0].name, NAMED_PAIRS[name][1].name) for name in ("bf16", "fp8", "fp4")
)


def step_variants(
    pairs: Sequence[tuple[str, str]] = STATE_PAIRS,
) -> list[tuple[str, str, bool, torch.dtype]]:
    """(m format, v format, stochastic, parameter dtype) of every fused-step bench row of
    the state ``pairs``."""
    return [
        (m, v, sr, dtype)
        for dtype in (torch.float32, torch.bfloat16)
        for m, v in pairs
        for sr in (False, True)
    ]


def step_name(
    param_dtype: torch.dtype, m_format: str, v_format: str, stochastic: bool, cols: int = BENCH_COLS
) -> str:
    """Row name of a fused-step timing (rows of other than ``BENCH_COLS`` say so)."""
    rounding = "SR" if stochastic else "NR"
    name = f"step {str(param_dtype).split('.')[-1]} param, m {m_format} v {v_format} {rounding}"
    return name if cols == BENCH_COLS else f"{name}, rows of {cols}"


def fused_step(
    numel: int,
    m_format: str,
    v_format: str,
    stochastic: bool,
    param_dtype: torch.dtype,
    block_size: int,
    repeats: int,
    copy: Timing,
    cols: int = BENCH_COLS,
    **launch,
) -> Timing:
    """Time the fused SR-AdamW step on one tensor of ``numel`` elements in rows of ``cols``,
    inside the NVTX range :func:`profile_range` of its row name."""
    from srtrain.kernels.launch import StepItem

    shape = bench_shape(numel, cols)
    param = (torch.randn(shape, device="cuda") * 0.02).to(param_dtype)
    grad = torch.randn(shape, device="cuda").to(param_dtype) * 1e-3
    m = quantize(torch.randn(shape, device="cuda") * 1e-4, m_format, block_size)
    v = quantize(torch.rand(shape, device="cuda") * 1e-7, v_format, block_size)
    scalars = AdamWScalars.make(1e-4, 0.9, 0.999, 1e-8, 0.1, 10, 10)
    plan = RoundingPlan(
        stochastic,
        stochastic,
        stochastic,
        rng_key(0, 10, 0, STATE_MOMENTS),
        rng_key(0, 10, 0, STATE_PARAM),
    )
    run = _prebuilt_step([StepItem(param, grad, m, v, scalars, plan, 0, 0)], **launch)
    name = step_name(param_dtype, m_format, v_format, stochastic, cols)
    if launch:
        name += " " + " ".join(f"{k}={v}" for k, v in launch.items())
    with torch.cuda.nvtx.range(profile_range(name)):
        us = _median_us(run, repeats)
    nbytes = step_bytes(shape, m_format, v_format, param_dtype, param_dtype, block_size)
    return Timing.against(name, numel, nbytes, us, copy)


def torch_adamw(numel: int, state_dtype: torch.dtype, repeats: int, copy: Timing) -> Timing:
    """torch.optim.AdamW(fused=True) on one tensor with states of ``state_dtype``."""
    param = torch.nn.Parameter((torch.randn(numel, device="cuda") * 0.02).to(state_dtype))
    param.grad = torch.randn_like(param) * 1e-3
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    opt.step()
    us = _median_us(opt.step, repeats)
    size = state_dtype.itemsize
    nbytes = numel * (2 * size + size + 4 * size)  # param r+w, grad r, m and v r+w
    name = f"torch AdamW fused, {str(state_dtype).split('.')[-1]} param+states"
    return Timing.against(name, numel, nbytes, us, copy)


def compiled_spec_cast():
    """``torch.compile`` of the SR cast's PyTorch spec: one graph, static shapes."""
    from srtrain.numerics.rounding import sr_cast_bf16

    return torch.compile(sr_cast_bf16, fullgraph=True, dynamic=False)


def casts(numel: int, repeats: int, copy: Timing) -> list[Timing]:
    """FP32 → BF16: torch's nearest cast, the Triton SR cast (default tile, then the other
    ``SR_CAST_TILES``), the PyTorch spec eager and compiled (checked against eager first)."""
    from srtrain.kernels.cast import sr_cast_bf16_triton
    from srtrain.numerics.rounding import sr_cast_bf16

    x = torch.randn(numel, device="cuda")
    key = rng_key(0, 1, 0, 1)
    compiled = compiled_spec_cast()
    if not torch.equal(compiled(x, key).view(torch.int16), sr_cast_bf16(x, key).view(torch.int16)):
        raise RuntimeError("torch.compile of the SR cast spec gave other bits than the spec")
    nbytes = 6 * numel
    rows = []
    for name, fn in (
        ("cast torch .to(bfloat16) (nearest)", lambda: x.to(torch.bfloat16)),
        ("cast Triton SR", lambda: sr_cast_bf16_triton(x, key)),
        *(
            (f"cast Triton SR, tile {t}", lambda t=t: sr_cast_bf16_triton(x, key, tile=t))
            for t in SR_CAST_TILES
        ),
        ("cast PyTorch spec SR (eager)", lambda: sr_cast_bf16(x, key)),
        ("cast PyTorch spec SR (torch.compile)", lambda: compiled(x, key)),
    ):
        rows.append(Timing.against(name, numel, nbytes, _median_us(fn, repeats), copy))
    return rows


def run_kernel_bench(
    numel: int, repeats: int, pairs: Sequence[tuple[str, str]] = STATE_PAIRS, cols: int = BENCH_COLS
) -> list[dict]:
    """Casts, each state pair × NR/SR × FP32/BF16 parameters on rows of ``cols``, torch
    AdamW with FP32 and BF16 states; step rows carry their speed-up over both torch steps
    (launch shapes: --sweep)."""
    copy = copy_bandwidth(numel, repeats)
    rows = [copy, *casts(numel, repeats, copy)]
    steps = [
        fused_step(numel, m_fmt, v_fmt, stochastic, dtype, 32, repeats, copy, cols)
        for m_fmt, v_fmt, stochastic, dtype in step_variants(pairs)
    ]
    torch_fp32 = torch_adamw(numel, torch.float32, repeats, copy)
    torch_bf16 = torch_adamw(numel, torch.bfloat16, repeats, copy)
    step_rows = [
        {
            **asdict(r),
            "speedup_vs_torch_fp32": torch_fp32.median_us / r.median_us,
            "speedup_vs_torch_bf16": torch_bf16.median_us / r.median_us,
        }
        for r in steps
    ]
    return [asdict(r) for r in rows] + step_rows + [asdict(torch_fp32), asdict(torch_bf16)]


# (tile, warps, registers per thread) of the sweep: four elements a thread (the default of
# unscaled states, and 512, 4, 80), eight (the default of block-scaled states: 512, 2, 128),
# and eight on larger and smaller programs
SWEEP_SHAPES = ((1024, 8, 80), (512, 4, 80), (1024, 4, 128), (512, 2, 128), (256, 1, 128))


def launch_sweep(
    numel: int, repeats: int, pairs: Sequence[tuple[str, str]] = STATE_PAIRS, cols: int = BENCH_COLS
) -> list[dict]:
    """Each of ``SWEEP_SHAPES`` per parameter dtype, state pair and rounding, on rows of
    ``cols``; programs per multiprocessor are as many as fit."""
    copy = copy_bandwidth(numel, repeats)
    rows = [copy]
    for dtype, (m_fmt, v_fmt) in itertools.product((torch.float32, torch.bfloat16), pairs):
        for stochastic in (False, True):
            for tile, warps, cap in SWEEP_SHAPES:
                rows.append(
                    fused_step(
                        numel,
                        m_fmt,
                        v_fmt,
                        stochastic,
                        dtype,
                        32,
                        repeats,
                        copy,
                        cols,
                        tile=tile,
                        num_warps=warps,
                        max_registers=cap,
                    )
                )
                torch.cuda.empty_cache()
    return [asdict(r) for r in rows]


def dry_run(
    numel: int, pairs: Sequence[tuple[str, str]] = STATE_PAIRS, cols: int = BENCH_COLS
) -> list[dict]:
    """Shapes and byte counts without a GPU (checks the accounting): stored state bytes per
    state pair on rows of ``cols``, then the bytes each fused-step row of the GPU bench
    counts."""
    shape = bench_shape(numel, cols)
    rows = []
    for m_fmt, v_fmt in pairs:
        state_m = empty_state(m_fmt, shape, 32, "cpu")
        state_v = empty_state(v_fmt, shape, 32, "cpu")
        nbytes = step_bytes(shape, m_fmt, v_fmt, torch.float32, torch.float32, 32)
        stored = sum(
            t.numel() * t.element_size()
            for s in (state_m, state_v)
            for t in (s.codes, s.scales)
            if t is not None
        )
        rows.append(
            {"name": f"m {m_fmt} v {v_fmt}", "numel": numel, "bytes": nbytes, "state_bytes": stored}
        )
    for m_fmt, v_fmt, stochastic, dtype in step_variants(pairs):
        rows.append(
            {
                "name": step_name(dtype, m_fmt, v_fmt, stochastic, cols),
                "numel": numel,
                "bytes": step_bytes(shape, m_fmt, v_fmt, dtype, dtype, 32),
            }
        )
    return rows


def model_shard_shapes(preset: str, world: int, vocab_size: int = 32000) -> list[tuple]:
    """Rank 0's FSDP2 shard shape (dim-0 chunk) of every parameter of ``preset``."""
    from srtrain.models import build_model

    shapes = []
    for p in build_model(preset, vocab_size, 1024).parameters():
        rows = -(-p.shape[0] // world)
        shapes.append((rows, *p.shape[1:]))
    return shapes


def median_host_us(fn, repeats: int) -> float:
    """Median wall time of the host call alone, with nothing queued on the GPU (if any)
    before each call and no synchronisation inside the timing."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    sync()
    return statistics.median(times)


def model_variants(
    pairs: Sequence[tuple[str, str]] = STATE_PAIRS,
) -> list[tuple[str, str, bool, torch.dtype]]:
    """(m format, v format, stochastic, parameter dtype) of the whole-model bench: FP32
    states with nearest rounding (the end-to-end baseline), then every row of the kernel
    bench for the state ``pairs`` (:func:`step_variants`)."""
    return [("fp32", "fp32", False, torch.float32), *step_variants(pairs)]


def model_step(
    preset: str,
    world: int,
    m_format: str,
    v_format: str,
    stochastic: bool,
    param_dtype: torch.dtype,
    repeats: int,
    copy: Timing,
    shadow_sample: int = 0,
) -> list[Timing]:
    """Whole-model optimizer step on rank 0's shards with parameters and gradients of
    ``param_dtype`` (stochastic rounding applies to the states and a BF16 parameter alike):
    SRAdamW.step (host work and launches), its host time alone, the step of a log step
    (health counts), the same with an FP32 shadow on one block in ``shadow_sample`` (0: not
    timed) and that shadow's report of a log step, its launches alone, and
    torch's fused AdamW with states of the parameters' dtype."""
    from srtrain.kernels.launch import KEY_COLUMNS
    from srtrain.optim import SRAdamW

    shapes = model_shard_shapes(preset, world)
    params = [
        torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).to(param_dtype)) for s in shapes
    ]
    grads = [(torch.randn(s, device="cuda") * 1e-3).to(param_dtype) for s in shapes]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    rounding = "stochastic" if stochastic else "nearest"

    def optimizer(sample: int) -> SRAdamW:
        opt = SRAdamW(
            params,
            lr=1e-4,
            weight_decay=0.1,
            m_format=m_format,
            v_format=v_format,
            m_rounding=rounding,
            v_rounding=rounding,
            param_rounding=rounding,
            shadow_sample=sample,
        )
        opt.count_health = False  # the ordinary step, as training runs it between log steps
        opt.step()
        return opt

    opt = optimizer(0)
    nbytes = sum(step_bytes(s, m_format, v_format, param_dtype, param_dtype, 32) for s in shapes)
    numel = sum(math.prod(s) for s in shapes)
    bf16_params = ", BF16 params" if param_dtype == torch.bfloat16 else ""
    label = (
        f"{preset} W={world} ({len(shapes)} shards) m {m_format} v {v_format} "
        + ("SR" if stochastic else "NR")
        + bf16_params
    )
    rows = []

    def timed(
        name: str, fn: Callable[[], object], nbytes: int = nbytes, device_only: bool = False
    ) -> None:
        us = _median_us(fn, repeats, device_only=device_only)
        rows.append(Timing.against(f"{label}, {name}", numel, nbytes, us, copy))

    def host_timed(name: str, fn: Callable[[], object]) -> None:
        us = median_host_us(fn, repeats)
        rows.append(Timing.against(f"{label}, {name}", numel, 0, us, copy))

    timed("SRAdamW.step", opt.step)
    host_timed("SRAdamW.step host time", opt.step)
    opt.count_health = True  # a log step: the same pass also counts the health counts
    timed("SRAdamW.step on a log step (health counts)", opt.step)
    opt.count_health = False
    if shadow_sample:
        shadowed = optimizer(shadow_sample)
        name = f"SRAdamW.step with shadow 1/{shadow_sample}"
        timed(name, shadowed.step)
        host_timed(f"{name} host time", shadowed.step)
        timed(f"shadow sums of a log step 1/{shadow_sample}", shadowed.shadow_sums, nbytes=0)
        host_timed(f"shadow sums of a log step 1/{shadow_sample} host time", shadowed.shadow_sums)
        del shadowed
    prepared = []  # the optimizer's own launches, with this step's keys and scalars fixed
    for launch in opt._plan.launches:
        n = len(launch.members)
        keys = np.tile(np.arange(KEY_COLUMNS, dtype=np.int64), (n, 1))
        floats = np.tile(
            np.array([0.9, 0.1, 0.999, 1e-3, 1.0, 1e-8, 1e-4, 1.0], dtype=np.float32), (n, 1)
        )
        prepared.append((launch, [e.param.grad for e in launch.members], keys, floats))

    def launches_only():
        for launch, launch_grads, keys, floats in prepared:
            launch.step.launch(launch_grads, keys, floats, launch.counts, health=False)

    timed("launches with prebuilt tables", launches_only, device_only=True)
    for launch, launch_grads, keys, floats in prepared:  # each launch alone
        step = launch.step
        shards = [tuple(s.param.shape) for s in step.shards]
        n_bytes = sum(
            step_bytes(s, m_format, v_format, param_dtype, param_dtype, 32) for s in shards
        )
        us = _median_us(
            functools.partial(step.launch, launch_grads, keys, floats, launch.counts, False),
            repeats,
        )
        kind = "aligned" if step.static_aligned else "unaligned"
        narrow = "" if step.flat or step.wide else " of rows under half a tile"
        name = f"{label}, one launch: {len(shards)} {kind} shards{narrow}"
        n_el = sum(math.prod(s) for s in shards)
        rows.append(Timing.against(name, n_el, n_bytes, us, copy))
    prepared.clear()
    del opt
    torch.cuda.empty_cache()
    ref = torch.optim.AdamW(params, lr=1e-4, fused=True)  # states of the params' dtype
    ref.step()
    us = _median_us(ref.step, repeats, device_only=False)
    torch_bytes = 7 * param_dtype.itemsize * numel  # param r+w, grad r, m and v r+w
    dtype = "bf16" if param_dtype == torch.bfloat16 else "fp32"
    name = f"{preset} W={world} torch AdamW fused {dtype}"
    rows.append(Timing.against(name, numel, torch_bytes, us, copy))
    return rows


def run_model_bench(
    preset: str,
    repeats: int,
    pairs: Sequence[tuple[str, str]] = STATE_PAIRS,
    worlds: Sequence[int] = (8, 1),
    shadow_sample: int = 0,
) -> list[dict]:
    """Whole-model steps at each of ``worlds`` for each of :func:`model_variants` of
    ``pairs`` (:func:`model_step`)."""
    copy = copy_bandwidth(2**28, repeats)
    rows = [copy]
    for world in worlds:
        for m_fmt, v_fmt, stochastic, param_dtype in model_variants(pairs):
            rows += model_step(
                preset, world, m_fmt, v_fmt, stochastic, param_dtype, repeats, copy, shadow_sample
            )
            torch.cuda.empty_cache()
    return [asdict(r) for r in rows]
