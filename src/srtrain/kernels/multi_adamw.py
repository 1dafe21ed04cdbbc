"""One launch over many shards: the fused AdamW step for every parameter that shares a layout.

Per-tensor addresses, sizes, keys and scalars travel in three small device tables,
and a tile → tensor table lets persistent programs walk all tiles of all tensors.
Each tile computes exactly what :func:`srtrain.kernels.fused_adamw.fused_adamw_triton`
computes for its tensor, so results equal the PyTorch spec bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srtrain.kernels.fused_adamw import (
    adamw_tile,
    int_view,
    num_programs,
    scales_or_codes,
    signed32,
    tile_elements,
    tile_layout,
)
from srtrain.kernels.triton_numerics import format_constexprs
from srtrain.numerics.adamw import AdamWScalars, RoundingPlan, check_step_inputs
from srtrain.numerics.formats import Format
from srtrain.numerics.rounding import StoredState

POINTER_COLUMNS = 7  # param, grad, m codes, m scales, v codes, v scales, global offset
INT_COLUMNS = 8  # cols, blocks per row, blocks, counts row, k0, k1 of m, v, param
FLOAT_COLUMNS = 8  # the AdamWScalars, in field order


@dataclass
class StepItem:
    """One shard's part of a multi-tensor step (arguments of ``fused_adamw_triton``)."""

    param: torch.Tensor
    grad: torch.Tensor
    m: StoredState
    v: StoredState
    scalars: AdamWScalars
    plan: RoundingPlan
    offset: int
    counts_row: int


@triton.jit
def _read(table, t, column: tl.constexpr, width: tl.constexpr):
    return tl.load(table + t * width + column)


@triton.jit
def multi_adamw_kernel(
    pointers, ints, floats, tile_tensor, tile_first, tile_counts, total_tiles,
    P_T: tl.constexpr, G_T: tl.constexpr, MC_T: tl.constexpr, VC_T: tl.constexpr,
    TB: tl.constexpr, BS: tl.constexpr,
    P_BF16: tl.constexpr, G_BF16: tl.constexpr, P_SR: tl.constexpr,
    M_SR: tl.constexpr, V_SR: tl.constexpr,
    M_KIND: tl.constexpr, M_P: tl.constexpr, M_EMIN: tl.constexpr, M_EMAX: tl.constexpr,
    M_MAXF: tl.constexpr, M_SIGNED: tl.constexpr, M_BITS: tl.constexpr,
    M_KMIN: tl.constexpr, M_KMAX: tl.constexpr,
    V_KIND: tl.constexpr, V_P: tl.constexpr, V_EMIN: tl.constexpr, V_EMAX: tl.constexpr,
    V_MAXF: tl.constexpr, V_SIGNED: tl.constexpr, V_BITS: tl.constexpr,
    V_KMIN: tl.constexpr, V_KMAX: tl.constexpr,
):
    """Every tile of every tensor in the tables; each tile's four counts go to its own
    column of ``tile_counts`` [4, tiles] (no atomics; summed per tensor afterwards)."""
    W_P: tl.constexpr = 7
    W_I: tl.constexpr = 8
    W_F: tl.constexpr = 8
    u8 = tl.pointer_type(tl.uint8)
    for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
        t = tl.load(tile_tensor + tile).to(tl.int64)
        local_tile = tile - tl.load(tile_first + t)
        c_m, c_v, c_p, c_g = adamw_tile(
            _read(pointers, t, 0, W_P).to(tl.pointer_type(P_T)),
            _read(pointers, t, 1, W_P).to(tl.pointer_type(G_T)),
            _read(pointers, t, 2, W_P).to(tl.pointer_type(MC_T)),
            _read(pointers, t, 3, W_P).to(u8),
            _read(pointers, t, 4, W_P).to(tl.pointer_type(VC_T)),
            _read(pointers, t, 5, W_P).to(u8),
            local_tile,
            _read(ints, t, 0, W_I), _read(ints, t, 1, W_I), _read(ints, t, 2, W_I),
            _read(pointers, t, 6, W_P),
            _read(floats, t, 0, W_F), _read(floats, t, 1, W_F), _read(floats, t, 2, W_F),
            _read(floats, t, 3, W_F), _read(floats, t, 4, W_F), _read(floats, t, 5, W_F),
            _read(floats, t, 6, W_F), _read(floats, t, 7, W_F),
            _read(ints, t, 4, W_I).to(tl.uint32, bitcast=True),
            _read(ints, t, 5, W_I).to(tl.uint32, bitcast=True),
            _read(ints, t, 6, W_I).to(tl.uint32, bitcast=True),
            _read(ints, t, 7, W_I).to(tl.uint32, bitcast=True),
            TB, BS, P_BF16, G_BF16, P_SR, M_SR, V_SR,
            M_KIND, M_P, M_EMIN, M_EMAX, M_MAXF, M_SIGNED, M_BITS, M_KMIN, M_KMAX,
            V_KIND, V_P, V_EMIN, V_EMAX, V_MAXF, V_SIGNED, V_BITS, V_KMIN, V_KMAX)
        tl.store(tile_counts + tile, tl.sum(tl.sum(c_m, axis=1), axis=0))
        tl.store(tile_counts + total_tiles + tile, tl.sum(tl.sum(c_v, axis=1), axis=0))
        tl.store(tile_counts + 2 * total_tiles + tile, tl.sum(tl.sum(c_p, axis=1), axis=0))
        tl.store(tile_counts + 3 * total_tiles + tile, tl.sum(tl.sum(c_g, axis=1), axis=0))


def _element_type(dtype: torch.dtype):
    """Triton element type of a tensor as the kernel reads it (bfloat16 as int16 bits)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.int16, torch.uint8: tl.uint8,
            torch.int16: tl.int16}[dtype]


def signature(item: StepItem) -> tuple:
    """What must agree for shards to share one launch."""
    p = item.plan
    return (item.param.dtype, item.grad.dtype, item.m.fmt.name, item.v.fmt.name,
            item.m.block_size, p.m_stochastic, p.v_stochastic, p.param_stochastic,
            item.param.device)


def fused_adamw_multi_triton(
    items: Sequence[StepItem],
    counts: torch.Tensor,
    *,
    tile: int | None = None,
    programs_per_sm: int = 4,
    num_warps: int = 8,
) -> None:
    """One launch of the fused step over ``items``, adding to ``counts[item.counts_row]``."""
    items = [i for i in items if i.param.numel()]
    if not items:
        return
    first = items[0]
    if any(signature(i) != signature(first) for i in items):
        raise ValueError("a multi-tensor step needs one dtype, format, block size and rounding "
                         "for all its shards; group them by signature()")
    if counts.dtype != torch.int64 or counts.dim() != 2 or counts.shape[1] != 4:
        raise ValueError("counts must be an int64 tensor of shape [parameters, 4]")
    device = first.param.device
    fmts: tuple[Format, Format] = (first.m.fmt, first.v.fmt)
    pointers, ints, floats, tiles = [], [], [], []
    grads = [item.grad.contiguous() for item in items]  # alive until the launch returns
    bs = 0
    for item, grad in zip(items, grads, strict=True):
        check_step_inputs(item.param, item.grad, item.m, item.v, counts[item.counts_row])
        if item.grad.device != device:
            raise ValueError("all shards of a multi-tensor step must be on one device")
        if not item.plan.key_m[0] == item.plan.key_v[0] == item.plan.key_param[0]:
            raise ValueError("the keys of one step must share their first word (see rng_key)")
        cols, blocks_per_row, nblocks, bs = tile_layout(tuple(item.param.shape), fmts,
                                                        item.m.block_size)
        pointers.append([int_view(item.param).data_ptr(), int_view(grad).data_ptr(),
                         item.m.codes.data_ptr(), scales_or_codes(item.m).data_ptr(),
                         item.v.codes.data_ptr(), scales_or_codes(item.v).data_ptr(),
                         item.offset])
        ints.append([cols, blocks_per_row, nblocks, item.counts_row,
                     *(signed32(w) for w in (item.plan.key_m[0], item.plan.key_m[1],
                                             item.plan.key_v[1], item.plan.key_param[1]))])
        s = item.scalars
        floats.append([s.beta1, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                       s.inv_bias_correction2_sqrt, s.eps, s.step_size, s.decay])
        tiles.append(nblocks)
    tb = max(1, (tile or tile_elements()) // bs)
    ntiles = torch.tensor([triton.cdiv(n, tb) for n in tiles], dtype=torch.int64)
    tile_first = torch.cumsum(ntiles, 0) - ntiles
    tile_tensor = torch.repeat_interleave(torch.arange(len(items), dtype=torch.int32), ntiles)
    total = int(ntiles.sum())
    to_device = {"device": device, "non_blocking": True}
    tile_counts = torch.empty(4, total, dtype=torch.int32, device=device)
    multi_adamw_kernel[(num_programs(total, device, programs_per_sm),)](
        torch.tensor(pointers, dtype=torch.int64).to(**to_device),
        torch.tensor(ints, dtype=torch.int32).to(**to_device),
        torch.tensor(floats, dtype=torch.float32).to(**to_device),
        tile_tensor.to(**to_device), tile_first.to(torch.int32).to(**to_device),
        tile_counts, total,
        P_T=_element_type(first.param.dtype), G_T=_element_type(first.grad.dtype),
        MC_T=_element_type(int_view(first.m.codes).dtype),
        VC_T=_element_type(int_view(first.v.codes).dtype),
        TB=tb, BS=bs, P_BF16=first.param.dtype == torch.bfloat16,
        G_BF16=first.grad.dtype == torch.bfloat16, P_SR=first.plan.param_stochastic,
        M_SR=first.plan.m_stochastic, V_SR=first.plan.v_stochastic,
        **format_constexprs("M_", first.m.fmt), **format_constexprs("V_", first.v.fmt),
        num_warps=num_warps, enable_fp_fusion=False,
    )
    # per-tensor sums of the tiles' counts: tiles of a tensor are consecutive
    running = torch.cumsum(tile_counts, 1, dtype=torch.int64)
    running = torch.cat([running.new_zeros(4, 1), running], dim=1)
    ends = (tile_first + ntiles).to(device)
    sums = (running[:, ends] - running[:, tile_first.to(device)]).t()
    rows = torch.tensor([i.counts_row for i in items], dtype=torch.int64).to(**to_device)
    counts.index_add_(0, rows, sums)
