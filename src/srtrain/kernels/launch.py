"""The fused AdamW launch, on the host: one kernel over every shard that shares dtypes,
formats and rounding.

A :class:`MultiStep` holds what does not change between steps for a list of shards
(addresses of parameters and states, sizes, the tile → shard table) in device tables
built once; each step adds one small table of gradient addresses, keys and scalars
and launches :func:`~srtrain.kernels.step_kernel.multi_adamw_kernel` once.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from srtrain.kernels.launch_plan import (
    LaunchPlan,
    check_tile,
    launch_plan,
    run_length,
    tile_blocks,
    without,
)
from srtrain.kernels.layout import (
    ALIGNMENT,
    aligned_shard,
    fills_tile,
    row_slots,
    tile_layout,
    tile_span,
    tiles_of,
)
from srtrain.kernels.memory import (
    LOAD4,
    int_view,
    run_access_ptx,
    scales_or_codes,
    tile_prefetch_ptx,
)
from srtrain.kernels.state_codes import check_formats, state_code
from srtrain.kernels.step_kernel import DYNAMIC_COLUMNS, GATE_COLUMN, multi_adamw_kernel
from srtrain.kernels.tile import StepFlags, TileShape
from srtrain.kernels.triton_numerics import interpreted
from srtrain.numerics.adamw import (
    NUM_COUNTS,
    AdamWScalars,
    RoundingPlan,
    check_gate,
    check_step_inputs,
)
from srtrain.numerics.formats import Format
from srtrain.numerics.rounding import StoredState

KEY_COLUMNS = 3  # of a step's keys as launch() takes them: k0, k1 of the states, k1 of the param
MAX_TILES_PER_PROGRAM = 65535  # packed count words hold 16-bit per-lane counts


@dataclass
class Shard:
    """What one shard contributes to every step: parameter, states, global offset, counts row."""

    param: torch.Tensor
    m: StoredState
    v: StoredState
    offset: int
    counts_row: int


@dataclass
class StepItem:
    """One shard's part of a multi-tensor step (arguments of :func:`fused_adamw_triton`)."""

    param: torch.Tensor
    grad: torch.Tensor
    m: StoredState
    v: StoredState
    scalars: AdamWScalars
    plan: RoundingPlan
    offset: int
    counts_row: int


def _element_type(dtype: torch.dtype):
    """Triton element type of a tensor as the kernel reads it (bfloat16 as int16 bits)."""
    return {
        torch.float32: tl.float32,
        torch.bfloat16: tl.int16,
        torch.uint8: tl.uint8,
        torch.int16: tl.int16,
    }[dtype]


class Signature(NamedTuple):
    """What must agree for shards to share one launch: parameter and gradient dtypes, state
    formats, block size, stochastic rounding of m, v and the parameter, and device."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    m_format: str
    v_format: str
    block_size: int
    m_stochastic: bool
    v_stochastic: bool
    param_stochastic: bool
    device: torch.device


class LaunchKey(NamedTuple):
    """How an optimizer groups its shards into launches: by :class:`Signature`, and apart by
    whether their rows allow the vectorised accesses (:func:`aligned_shard`) and are a tile
    wide (:func:`wide_rows`), so that each launch compiles the accesses its rows allow."""

    signature: Signature
    aligned: bool
    wide: bool


def shard_signature(
    shard: Shard,
    grad_dtype: torch.dtype,
    m_stochastic: bool,
    v_stochastic: bool,
    param_stochastic: bool,
) -> Signature:
    """The :class:`Signature` of ``shard`` stepped with gradients of ``grad_dtype`` and the
    given rounding."""
    return Signature(
        shard.param.dtype,
        grad_dtype,
        shard.m.fmt.name,
        shard.v.fmt.name,
        shard.m.block_size,
        m_stochastic,
        v_stochastic,
        param_stochastic,
        shard.param.device,
    )


def launch_key(shard: Shard, signature: Signature) -> LaunchKey:
    """The :class:`LaunchKey` of a non-empty ``shard`` whose :class:`Signature` is
    ``signature``."""
    fmts = (shard.m.fmt, shard.v.fmt)
    return LaunchKey(
        signature,
        aligned_shard(shard.param, shard.m, shard.v),
        wide_rows(tuple(shard.param.shape), fmts, shard.m.block_size),
    )


def signature(item: StepItem) -> Signature:
    """The :class:`Signature` of a step item."""
    rounding = item.plan
    return shard_signature(
        Shard(item.param, item.m, item.v, item.offset, item.counts_row),
        item.grad.dtype,
        rounding.m_stochastic,
        rounding.v_stochastic,
        rounding.param_stochastic,
    )


def wide_rows(
    shape: tuple[int, ...], fmts: tuple[Format, ...], block_size: int, tile: int | None = None
) -> bool:
    """Whether each tile of a block-scaled shard lies within one row (tiles of ``tile``
    elements; None: the default): rows over half a tile long, whose tiles hold a part of a
    row or one row masked past its end. A launch whose shards all have such rows
    compiles without the per-shard lookup of how many rows a tile holds. Unscaled states
    run flat: False."""
    _, cols, bs = tile_layout(shape, fmts, block_size)
    if not any(f.scaled for f in fmts):
        return False
    tb = tile_blocks(tile, True, bs)
    return fills_tile(row_slots(cols, bs, tb)[0], tb)


# Programs of one launch that fit on a multiprocessor at once, per compiled kernel variant
# (from its register count), so that a persistent launch runs in a single wave.
_RESIDENT: dict[tuple, int] = {}
REGISTER_FILE = 65536  # 32-bit registers a multiprocessor holds (sm_80, sm_90)
REGISTER_UNIT = 256  # a warp's registers are allocated in units of this many
WARP_GRANULE = 4  # and warps in fours, one to each scheduler's quarter of the file
MAX_THREADS = 2048  # resident threads a multiprocessor holds
MAX_PROGRAMS = 32  # resident programs a multiprocessor holds


def resident_programs(n_regs: int, num_warps: int) -> int:
    """Programs of ``num_warps`` warps at ``n_regs`` registers a thread that one
    multiprocessor holds at once. Each scheduler owns a quarter of the register file, so
    the warps that fit are floored to a multiple of four: at 112 registers a thread, 18
    warps' worth of registers hold 16 warps (8 programs of 2), not 9 programs, and a launch
    sized for 9 would run a second wave."""
    per_warp = -(-max(n_regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    warps = REGISTER_FILE // per_warp // WARP_GRANULE * WARP_GRANULE
    return max(1, min(warps // num_warps, MAX_THREADS // (32 * num_warps), MAX_PROGRAMS))


def _check_shards(shards: Sequence[Shard]) -> None:
    """Raise unless ``shards`` share one parameter dtype, state formats, block size and
    device (and their formats have kernel codes)."""
    first = shards[0]
    check_formats(first.m.fmt, first.v.fmt)
    for s in shards:
        if (s.param.dtype, s.m.fmt, s.v.fmt, s.m.block_size, s.v.block_size) != (
            first.param.dtype,
            first.m.fmt,
            first.v.fmt,
            first.m.block_size,
            first.m.block_size,
        ):
            raise ValueError(
                "a multi-tensor step needs one param dtype, state format and "
                "block size for all its shards; group them by signature()"
            )
        if s.param.device != first.param.device:
            raise ValueError("all shards of a multi-tensor step must be on one device")


class StaticRows(NamedTuple):
    """The static table of a launch (:data:`~srtrain.kernels.step_kernel.STATIC_COLUMNS`
    int64 a shard), each shard's tile count, and whether every shard allows the vectorised
    accesses (:func:`aligned_shard`), has rows a tile wide (:func:`wide_rows`) and tiles
    that start at multiples of their span (:func:`~srtrain.kernels.layout.tile_span`)."""

    rows: list[list[int]]
    tiles: list[int]
    aligned: bool
    wide: bool
    spans: bool


def _static_rows(
    shards: Sequence[Shard],
    layouts: Sequence[tuple[int, int, int]],
    bs: int,
    tb: int,
    flat: bool,
) -> StaticRows:
    """The :class:`StaticRows` of ``shards`` laid out as ``layouts`` (:func:`tile_layout`)
    in tiles of ``tb`` blocks of ``bs`` elements (``flat``: unscaled states)."""
    rows, ntiles, aligned, wide, spans = [], [], True, not flat, True
    for s, (n_rows, cols, _) in zip(shards, layouts, strict=True):
        slot_bits, tiles_per_row = row_slots(cols, bs, tb)
        wide &= fills_tile(slot_bits, tb)
        span = tile_span(n_rows, cols, bs, tb, flat)
        spans &= span > 0 and s.offset % span == 0
        ntiles.append(tiles_of(n_rows, cols, bs, tb, flat))
        rows.append(
            [
                int_view(s.param).data_ptr(),
                s.m.codes.data_ptr(),
                scales_or_codes(s.m).data_ptr(),
                s.v.codes.data_ptr(),
                scales_or_codes(s.v).data_ptr(),
                s.offset,
                cols,
                triton.cdiv(cols, bs),
                tiles_per_row,
                0,
                s.counts_row,
                n_rows,
                slot_bits,
                ntiles[-1],
            ]
        )
        aligned &= aligned_shard(s.param, s.m, s.v)
    for row, first_tile in zip(rows, np.cumsum([0, *ntiles[:-1]]), strict=True):
        row[9] = int(first_tile)
    return StaticRows(rows, ntiles, bool(aligned), bool(wide), bool(spans))


class MultiStep:
    """The fused step over a fixed list of shards: device tables built once, one launch a step.

    ``grad_dtype`` and the rounding flags are fixed for the launch. Its
    :class:`~srtrain.kernels.launch_plan.LaunchPlan` is ``plan``, or that of
    :func:`~srtrain.kernels.launch_plan.launch_plan` for the shards (with ``tile``
    elements per tile, a power of two; None: the default); it tunes the launch only and
    never changes results. The launch runs as many programs as fit on the device at once.
    Successive steps reuse one device copy of the per-step table, so they must run on one
    CUDA stream (as an optimizer's steps do).

    A step may be gated (:meth:`stage`'s ``gate``, a 0-d float32 tensor on the launch's
    device, read by the kernel without a host sync): a finite gate multiplies every
    gradient element in float32 before anything else, a non-finite one (NaN, ±Inf) leaves
    every shard of the launch as it was (parameters, states, scales and counts), as
    :func:`~srtrain.numerics.adamw.adamw_step_reference`'s ``grad_scale``.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        grad_dtype: torch.dtype,
        m_stochastic: bool,
        v_stochastic: bool,
        param_stochastic: bool,
        *,
        tile: int | None = None,
        plan: LaunchPlan | None = None,
    ) -> None:
        shards = [s for s in shards if s.param.numel()]
        check_tile(tile)
        if tile is not None and plan is not None:
            raise ValueError("a MultiStep takes a tile or a plan (whose tile it is), not both")
        if not (plan is None or isinstance(plan, LaunchPlan)):
            raise ValueError(f"plan must be a LaunchPlan, not {plan!r}")
        self.shards = shards
        self.shapes = [s.param.shape for s in shards]
        self.grad_dtype = grad_dtype
        self.stochastic_states = m_stochastic or v_stochastic
        if not shards:
            return
        first = shards[0]
        self.device = first.param.device
        self.device_index = first.param.get_device()  # -1 on the CPU
        m_fmt, v_fmt = first.m.fmt, first.v.fmt
        _check_shards(shards)
        self.flat = not (m_fmt.scaled or v_fmt.scaled)
        self.asked = plan is not None  # a refused access of an asked plan warns
        self.plan = plan or launch_plan(
            [tuple(s.param.shape) for s in shards],
            first.param.dtype,
            grad_dtype,
            m_fmt,
            v_fmt,
            first.m.block_size,
            self.stochastic_states,
            tile=tile,
        )
        self.multiprocessors = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 1
        )
        layouts = [
            tile_layout(tuple(s.param.shape), (m_fmt, v_fmt), first.m.block_size) for s in shards
        ]
        bs = layouts[0][2]
        self.tb = max(1, self.plan.tile // bs)
        table = _static_rows(shards, layouts, bs, self.tb, self.flat)
        self.static_aligned = table.aligned
        self._l2_ptx = {
            aligned: tile_prefetch_ptx(
                self.tb,
                bs,
                first.param.element_size(),
                grad_dtype.itemsize,
                m_fmt,
                v_fmt,
                aligned,
                self.plan.l2_every_thread,
            )
            for aligned in (False, True)
        }
        self.total_tiles = int(sum(table.tiles))
        self.static = torch.tensor(table.rows, dtype=torch.int64).to(self.device)
        self.tile_shard = torch.repeat_interleave(
            torch.arange(len(shards), dtype=torch.int32), torch.tensor(table.tiles)
        ).to(self.device)
        self.bs = bs
        self.wide = table.wide  # as wide_rows()
        self.carry = any(s.offset >> 32 != (s.offset + s.param.numel() - 1) >> 32 for s in shards)
        self.spans = table.spans and not self.carry
        # the kernel's compile-time arguments of each alignment, health and gate choice
        flags = (
            first.param.dtype == torch.bfloat16,
            grad_dtype == torch.bfloat16,
            param_stochastic,
            m_stochastic,
            v_stochastic,
        )
        self._step_flags = {
            (health, gated): StepFlags(*flags, health, gated)
            for health, gated in itertools.product((False, True), repeat=2)
        }
        self._codes = state_code(m_fmt), state_code(v_fmt)
        self._shapes = {
            aligned: TileShape(
                P_T=_element_type(first.param.dtype),
                G_T=_element_type(grad_dtype),
                MC_T=_element_type(int_view(first.m.codes).dtype),
                VC_T=_element_type(int_view(first.v.codes).dtype),
                TB=self.tb,
                BS=bs,
                RUN=run_length(self.tb, bs, self.plan.num_warps),
                FLAT=self.flat,
                ALIGNED=aligned,
                WIDE=self.wide,
                CARRY=self.carry,
                SPANS=self.spans,
            )
            for aligned in (False, True)
        }
        cuda = self.device.type == "cuda"
        self._host_table = torch.zeros(
            (len(shards), DYNAMIC_COLUMNS), dtype=torch.int32, pin_memory=cuda
        )
        self._device_table = (
            torch.empty_like(self._host_table, device=self.device) if cuda else None
        )
        self._copied: torch.cuda.Event | None = None
        # (aligned, health, gated, table address, counts address) → the compiled kernel's
        # launcher and its arguments; a compiled kernel is specialised on its arguments'
        # alignment and values
        self._launchers: dict[tuple[bool, bool, bool, int, int], tuple] = {}

    def _staging(self) -> torch.Tensor:
        """The host buffer of the step's dynamic table, free to be written.

        On CUDA it is page-locked, so its upload neither waits for the queued work (as a
        copy from pageable memory does) nor blocks the host; the buffer is reused once the
        previous step's upload has finished.
        """
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_table

    def _upload(self, staging: torch.Tensor) -> torch.Tensor:
        """The dynamic table on the launch's device, copied from ``staging``."""
        if self.device.type != "cuda":  # the interpreter runs the launch before returning
            return staging
        self._device_table.copy_(staging, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return self._device_table

    def kernel_constexprs(self, aligned: bool, health: bool = True, gated: bool = False) -> dict:
        """The kernel's compile-time arguments for a launch on rows with the vectorised
        accesses (``aligned``) or without, counting the health counts or not (``health``),
        gated or not (``gated``): its :class:`~srtrain.kernels.tile.StepFlags`, state codes,
        :class:`~srtrain.kernels.tile.TileShape`, the plan's
        :class:`~srtrain.kernels.launch_plan.Access` and the L2 prefetch's PTX."""
        return dict(
            STEP=self._step_flags[health, gated],
            M=self._codes[0],
            V=self._codes[1],
            SHAPE=self._shapes[aligned],
            ACCESS=self.plan.access(aligned),
            L2_PTX=self._l2_ptx[aligned],
        )

    def _programs(self, variant: tuple) -> int:
        total = self.total_tiles
        if interpreted() or self.device.type != "cuda":
            programs = min(total, 4)
        else:
            per_sm = _RESIDENT.get(variant, 2)
            programs = min(total, per_sm * self.multiprocessors)
        # a program's per-thread counts, summed over its threads in 32 bits, stay below 2**31
        tile_elements = self.tb * self.bs
        most = min(MAX_TILES_PER_PROGRAM, (2**31 - 1) // tile_elements)
        return max(programs, triton.cdiv(total, most))

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Raise, naming the first mismatch, unless each gradient has its shard's shape and the
        launch's dtype and device."""
        shapes = [g.shape for g in grads]
        if (
            shapes == self.shapes
            and {g.dtype for g in grads} == {self.grad_dtype}
            and {g.get_device() for g in grads} == {self.device_index}
        ):
            return
        for i, (g, shape) in enumerate(zip(grads, self.shapes, strict=True)):
            if (g.dtype, g.shape, g.device) != (self.grad_dtype, shape, self.device):
                raise ValueError(
                    f"gradient {i} is {g.dtype} {tuple(g.shape)} on {g.device}; the step needs "
                    f"{self.grad_dtype} {tuple(shape)} on {self.device}"
                )

    def launch(
        self,
        grads: Sequence[torch.Tensor],
        keys: np.ndarray,
        floats: np.ndarray,
        counts: torch.Tensor,
        health: bool = True,
        gate: torch.Tensor | None = None,
    ) -> None:
        """One step: ``grads`` per shard, ``keys`` [n, 3] (k0, k1 of the states, k1 of the
        param) as unsigned 32-bit words, ``floats`` [n, 8] the AdamWScalars in field order;
        counts are added to ``counts[shard.counts_row]``, the health counts only with
        ``health`` (as :func:`~srtrain.numerics.adamw.adamw_step_reference` adds them);
        ``gate`` as :meth:`stage` takes it."""
        if self.shards:
            self.run(self.stage(grads, keys, floats, gate), counts, health)

    def stage(
        self,
        grads: Sequence[torch.Tensor],
        keys: np.ndarray,
        floats: np.ndarray,
        gate: torch.Tensor | None = None,
    ) -> StagedStep:
        """The host half of :meth:`launch`: check the gradients and upload the step's table.
        On CUDA the upload is queued on the current stream, so it can run ahead of the
        kernels still producing the gradients; stage again before the next run.

        ``gate`` (a 0-d float32 tensor on the launch's device; None: ungated) gates every
        shard of the step: the kernel reads its value when it runs, so the gate may still be
        being computed on the stream; finite, it multiplies the gradients (float32), NaN or
        ±Inf, the step changes nothing (see :class:`MultiStep`)."""
        n = len(self.shards)
        if len(grads) != n or keys.shape != (n, KEY_COLUMNS) or floats.shape != (n, 8):
            raise ValueError(f"a step over {n} shards needs {n} gradients, keys and scalars")
        contiguous = (
            list(grads)
            if all(map(torch.Tensor.is_contiguous, grads))
            else [g if g.is_contiguous() else g.contiguous() for g in grads]
        )
        self._check_grads(contiguous)
        if gate is not None:
            check_gate(gate)
            if gate.device != self.device:
                raise ValueError(f"the gate is on {gate.device}; the step runs on {self.device}")
        addresses = np.fromiter(map(torch.Tensor.data_ptr, contiguous), dtype=np.uint64, count=n)
        aligned = self.static_aligned and not (addresses % ALIGNMENT).any()
        staging = self._staging()
        table = staging.numpy()
        table[:, 0:2] = addresses.view(np.int32).reshape(n, 2)
        words = np.asarray(keys, dtype=np.uint64).astype(np.uint32)
        table[:, 2 : 2 + KEY_COLUMNS] = words.view(np.int32)
        table[:, 6:14] = np.asarray(floats, dtype=np.float32).view(np.int32)
        gate_address = 0 if gate is None else gate.data_ptr()
        table[:, GATE_COLUMN : GATE_COLUMN + 2] = np.array([gate_address], np.int64).view(np.int32)
        return StagedStep(self._upload(staging), bool(aligned), contiguous, addresses, gate)

    def run(self, staged: StagedStep, counts: torch.Tensor, health: bool = True) -> None:
        """The kernel half of :meth:`launch`: one launch over the staged table, adding to
        ``counts[shard.counts_row]`` (the health counts only with ``health``, which selects
        one of two compiled kernels: without, the kernel holds no trace of them). A gated
        ``staged`` step launches the kernel compiled gated (``StepFlags.GATED``), an ungated
        one the kernel that holds no trace of a gate.

        On the GPU each launch is compiled (or found compiled) before it runs, so that a
        kernel with 16-byte PTX loads is checked first (:func:`quads_in_order`; one that
        fails launches without them, after a warning where the plan was given; small tiles
        give such layouts), and so is one with run accesses (:func:`runs_in_order`), and a
        launch whose table, counts and alignment were launched before calls the kernel that
        launch compiled with the same arguments, skipping Triton's argument binding and
        cache lookup."""
        if counts.dtype != torch.int64 or counts.dim() != 2 or counts.shape[1] != NUM_COUNTS:
            raise ValueError(f"counts must be an int64 tensor of shape [parameters, {NUM_COUNTS}]")
        dynamic, aligned, gated = staged.table, staged.aligned, staged.gated
        known = (aligned, health, gated, dynamic.data_ptr(), counts.data_ptr())
        ready = self._launchers.get(known)
        if ready is not None:
            launcher, args = ready
            launcher(*args)
            return
        plan = self.plan
        registers = plan.max_registers
        cap = {} if interpreted() or registers is None else {"maxnreg": registers}
        constexprs = self.kernel_constexprs(aligned, health, gated)
        variant = (plan.num_warps, registers, tuple(constexprs.items()))  # one compiled kernel
        settled = variant in _RESIDENT  # the program count no longer changes
        per_program = triton.cdiv(self.total_tiles, self._programs(variant))
        grid = (triton.cdiv(self.total_tiles, per_program),)
        args = dict(
            static=self.static,
            dynamic=dynamic,
            counts=counts,
            tile_shard=self.tile_shard,
            total_tiles=self.total_tiles,
            tiles_per_program=per_program,
            **constexprs,
        )
        options = dict(num_warps=plan.num_warps, enable_fp_fusion=False, **cap)
        if self.device.type != "cuda" or interpreted():
            multi_adamw_kernel[grid](**args, **options)
            return
        compiled = multi_adamw_kernel.warmup(**args, grid=grid, **options)  # not launched
        ttgir = compiled.asm["ttgir"]
        if constexprs["ACCESS"].quad_loads and not quads_in_order(ttgir):
            if self.asked:
                warnings.warn(
                    "the fused step's compiled layout does not hold its float32 "
                    "parameter in runs of four elements a thread; it launches with "
                    "quad_loads=False (tl.load)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.plan = without(plan, True, "quad_loads")
            self.run(staged, counts, health)
            return
        if constexprs["ACCESS"].run_accesses and not runs_in_order(ttgir):
            if self.asked:
                warnings.warn(
                    "the fused step's compiled layout does not hold its float32 "
                    "parameter in runs of eight elements a thread; it launches with "
                    "run_accesses=False",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.plan = without(plan, False, "run_accesses")
            self.run(staged, counts, health)
            return
        launcher = compiled[(grid[0], 1, 1)]
        positional = tuple(args[name] for name in multi_adamw_kernel.arg_names)
        launcher(*positional)
        if settled:
            self._launchers[known] = (launcher, positional)
        else:
            _RESIDENT[variant] = resident_programs(compiled.n_regs, plan.num_warps)


_BLOCKED = re.compile(
    r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
    r"threadsPerWarp = \[[\d, ]+\], warpsPerCTA = \[[\d, ]+\], "
    r"order = \[([\d, ]+)\]",
    re.MULTILINE,
)


def packs_in_order(ttgir: str, asms: tuple[str, ...], pack: int) -> bool:
    """Whether a compiled kernel's TritonGPU IR holds PTX accesses of ``asms`` and each
    packs ``pack`` consecutive elements: every tensor it takes or gives is laid out blocked,
    with its last dimension first in order and a multiple of ``pack`` elements of it a
    thread (its packed elements are then consecutive elements of one row)."""
    runs = {}
    for name, per_thread, order in _BLOCKED.findall(ttgir):
        sizes = [int(x) for x in per_thread.split(",")]
        first = int(order.split(",")[0])
        runs[name] = first == len(sizes) - 1 and sizes[-1] % pack == 0
    accesses = [
        line
        for line in ttgir.splitlines()
        if "tt.elementwise_inline_asm" in line and any(asm in line for asm in asms)
    ]
    for line in accesses:
        types = line.split(f"packed_element = {pack}")[-1].split(" loc(")[0]
        layouts = re.findall(r"tensor<[^>]*?, (#[\w.]+)", types)
        if not layouts or not all(runs.get(layout, False) for layout in layouts):
            return False
    return bool(accesses)


def quads_in_order(ttgir: str) -> bool:
    """:func:`packs_in_order` for the 16-byte loads of
    :func:`~srtrain.kernels.memory.load_quads`, four elements each."""
    return packs_in_order(ttgir, (LOAD4.value,), 4)


def runs_in_order(ttgir: str) -> bool:
    """:func:`packs_in_order` for the run accesses of
    :func:`~srtrain.kernels.memory.load_runs` and
    :func:`~srtrain.kernels.memory.store_runs`, eight elements each."""
    return packs_in_order(ttgir, (run_access_ptx(False), run_access_ptx(True)), 8)


@dataclass
class StagedStep:
    """A step's uploaded table, whether its gradients allow the vectorised accesses, the
    gradients it points at (contiguous, checked) and their addresses (uint64), and its gate
    (None: ungated; kept alive until the launch)."""

    table: torch.Tensor
    aligned: bool
    grads: list[torch.Tensor]
    addresses: np.ndarray
    gate: torch.Tensor | None = None

    @property
    def gated(self) -> bool:
        """Whether the step is gated (its table holds the gate's address)."""
        return self.gate is not None


def shards_plan(
    shards: Sequence[Shard],
    grad_dtype: torch.dtype,
    stochastic: bool,
    *,
    tile: int | None = None,
    **choices,
) -> LaunchPlan:
    """:func:`~srtrain.kernels.launch_plan.launch_plan` of a launch over ``shards`` (one
    dtype, format pair and block size; states rounded stochastically or not), with
    ``tile`` and ``choices`` in place of its own."""
    shards = [s for s in shards if s.param.numel()]
    first = shards[0]
    return launch_plan(
        [tuple(s.param.shape) for s in shards],
        first.param.dtype,
        grad_dtype,
        first.m.fmt,
        first.v.fmt,
        first.m.block_size,
        stochastic,
        tile=tile,
        **choices,
    )


def step_tables(items: Sequence[StepItem]) -> tuple[np.ndarray, np.ndarray]:
    """The keys [n, 3] and scalars [n, 8] of ``items`` as :meth:`MultiStep.launch` takes them."""
    keys = np.array(
        [[i.plan.key_states[0], i.plan.key_states[1], i.plan.key_param[1]] for i in items],
        dtype=np.uint64,
    ).reshape(len(items), KEY_COLUMNS)
    floats = np.array([i.scalars.row() for i in items], dtype=np.float32)
    return keys, floats.reshape(len(items), 8)


def fused_adamw_multi_triton(
    items: Sequence[StepItem],
    counts: torch.Tensor,
    *,
    health: bool = True,
    tile: int | None = None,
    plan: LaunchPlan | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One launch of the fused step over ``items``, adding to ``counts[item.counts_row]``
    (the health counts only with ``health``), with :class:`MultiStep`'s ``tile`` or
    ``plan``, gated by ``grad_scale`` (:meth:`MultiStep.stage`'s ``gate``)."""
    items = [i for i in items if i.param.numel()]
    if not items:
        return
    first = items[0]
    if any(signature(i) != signature(first) for i in items):
        raise ValueError(
            "a multi-tensor step needs one dtype, format, block size and rounding "
            "for all its shards; group them by signature()"
        )
    if counts.dtype != torch.int64 or counts.dim() != 2 or counts.shape[1] != NUM_COUNTS:
        raise ValueError(f"counts must be an int64 tensor of shape [parameters, {NUM_COUNTS}]")
    for item in items:
        check_step_inputs(item.param, item.grad, item.m, item.v, counts[item.counts_row])
        if item.plan.key_states[0] != item.plan.key_param[0]:
            raise ValueError("the keys of one step must share their first word (see rng_key)")
    rounding = first.plan
    step = MultiStep(
        [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items],
        first.grad.dtype,
        rounding.m_stochastic,
        rounding.v_stochastic,
        rounding.param_stochastic,
        tile=tile,
        plan=plan,
    )
    step.launch([i.grad for i in items], *step_tables(items), counts, health, grad_scale)


def fused_adamw_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: StoredState,
    v: StoredState,
    scalars: AdamWScalars,
    plan: RoundingPlan,
    offset: int,
    counts: torch.Tensor,
    health: bool = True,
    grad_scale: torch.Tensor | None = None,
    *,
    tile: int | None = None,
    launch_plan: LaunchPlan | None = None,
) -> None:
    """Triton twin of :func:`srtrain.numerics.adamw.adamw_step_reference` (same arguments;
    ``grad_scale`` on the parameter's device), with :class:`MultiStep`'s ``tile`` or plan
    (``launch_plan``)."""
    check_step_inputs(param, grad, m, v, counts)
    if m.block_size != v.block_size:
        raise ValueError("m and v must share one block size")
    fused_adamw_multi_triton(
        [StepItem(param, grad, m, v, scalars, plan, offset, 0)],
        counts.view(1, NUM_COUNTS),
        health=health,
        tile=tile,
        plan=launch_plan,
        grad_scale=grad_scale,
    )
