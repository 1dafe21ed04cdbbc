"""The stored m and v at the FP32 shadow's sampled elements, decoded, in one launch per kind.

Computes :func:`srtrain.numerics.rounding.dequantize` bit for bit at given flat indices of
many parameters' local shards: each program gathers its elements' codes (and, for the
block-scaled formats, their blocks' scale bytes) and decodes them with the formats'
Triton decoders (:mod:`srtrain.kernels.state_codes`), so a log step reads every sampled
state in one launch for each kind of state pair (formats and block size) instead of a few
gathers a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from srtrain.kernels.state_codes import (
    BF16_CODES,
    E4M3_CODES,
    FP32_CODES,
    StateCode,
    code_value,
    pow2,
    state_code,
)
from srtrain.kernels.triton_numerics import bf16_bits_to_float
from srtrain.numerics.formats import NAN_SCALE_BYTE, SCALE_BIAS, row_layout
from srtrain.numerics.rounding import StoredState

# Elements per program, as in the shadow's update.
BLOCK = 1024
# A read's row in the launch table (int64): its indices' address, their count, its row
# length, the offset of its values in the outputs, m's codes and scales, v's codes and scales.
TABLE_COLUMNS = tl.constexpr(8)
_SCALE_BIAS = tl.constexpr(SCALE_BIAS)
_NAN_SCALE_BYTE = tl.constexpr(NAN_SCALE_BYTE)


@triton.jit
def _decoded(
    codes_address, scales_address, idx, row, col, cols, mask, C: tl.constexpr, BS: tl.constexpr
):
    """float32 values of a state (constants ``C``, block size ``BS``) at flat indices ``idx``
    (rows ``row``, columns ``col`` of rows ``cols`` long), from its codes' and scale bytes'
    addresses."""
    if C.KIND == FP32_CODES:
        x = tl.load(codes_address.to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)
    elif C.KIND == BF16_CODES:
        bits = tl.load(codes_address.to(tl.pointer_type(tl.int16)) + idx, mask=mask, other=0)
        x = bf16_bits_to_float(bits)
    else:
        scale_ptr = scales_address.to(tl.pointer_type(tl.uint8)) + row * ((cols + BS - 1) // BS)
        scale_byte = tl.load(scale_ptr + col // BS, mask=mask, other=_SCALE_BIAS).to(tl.int32)
        k = tl.minimum(tl.maximum(scale_byte - _SCALE_BIAS, C.KMIN), C.KMAX)
        factor = tl.where(scale_byte == _NAN_SCALE_BYTE, float("nan"), pow2(k))
        codes_ptr = codes_address.to(tl.pointer_type(tl.uint8))
        if C.KIND == E4M3_CODES:
            code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.uint32)
        else:  # FP4 nibble pairs: an even column in the low nibble
            pair = tl.load(codes_ptr + row * ((cols + 1) // 2) + col // 2, mask=mask, other=0)
            pair = pair.to(tl.uint32)
            code = tl.where((col & 1) == 1, pair >> 4, pair & 0xF)
        x = code_value(code, factor, C.P, C.EMIN, C.SIGNED, C.KIND)
    return x


@triton.jit
def sampled_states_kernel(
    table_ptr,
    m_out_ptr,
    v_out_ptr,
    M: tl.constexpr,
    V: tl.constexpr,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (parameter, chunk): the chunk's ``BLOCK`` sampled elements of that parameter.
    ``table_ptr`` holds a row of :data:`TABLE_COLUMNS` per parameter; ``M`` and ``V`` are the
    states' formats."""
    entry = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    table = table_ptr + entry * TABLE_COLUMNS
    n = tl.load(table + 1)
    if start < n:
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        idx = tl.load(tl.load(table).to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=0)
        cols = tl.load(table + 2)
        row = idx // cols
        col = idx - row * cols
        out = tl.load(table + 3) + offs
        m = _decoded(tl.load(table + 4), tl.load(table + 5), idx, row, col, cols, mask, M, BS)
        tl.store(m_out_ptr + out, m, mask=mask)
        v = _decoded(tl.load(table + 6), tl.load(table + 7), idx, row, col, cols, mask, V, BS)
        tl.store(v_out_ptr + out, v, mask=mask)


class SampledRead(NamedTuple):
    """One parameter's sampled elements (contiguous 1-D int64 flat indices into its local
    shard) and its stored states there (contiguous codes and scale bytes)."""

    elements: torch.Tensor
    m: StoredState
    v: StoredState


def _kind(read: SampledRead) -> tuple[StateCode, StateCode, int]:
    if read.m.block_size != read.v.block_size or read.m.shape != read.v.shape:
        raise ValueError("a sampled read's m and v must share their shape and block size")
    return state_code(read.m.fmt), state_code(read.v.fmt), read.m.block_size


def _check(read: SampledRead, device: torch.device) -> None:
    elements = read.elements
    if elements.dtype != torch.int64 or elements.dim() != 1 or not elements.is_contiguous():
        raise ValueError("sampled elements must be contiguous 1-D int64 tensors")
    for state in (read.m, read.v):
        tensors = [state.codes] + ([state.scales] if state.fmt.scaled else [])
        if any(t.device != device or not t.is_contiguous() for t in [elements, *tensors]):
            raise ValueError(f"sampled reads need contiguous tensors on {device}")


def read_sampled(reads: Sequence[SampledRead]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values of the stored m and of the stored v at each read's elements, each
    read's after the one before (as ``dequantize(state).reshape(-1)[elements]``): one launch
    for each kind of state pair among ``reads``, all on one device."""
    if not reads:
        raise ValueError("read_sampled needs at least one read")
    device = reads[0].elements.device
    sizes = [read.elements.numel() for read in reads]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    m_out = torch.empty(int(offsets[-1]), dtype=torch.float32, device=device)
    v_out = torch.empty_like(m_out)
    kinds: dict[tuple[StateCode, StateCode, int], list[int]] = {}
    for i, read in enumerate(reads):
        _check(read, device)
        if sizes[i]:
            kinds.setdefault(_kind(read), []).append(i)
    for (m_code, v_code, block_size), members in kinds.items():
        rows = []
        for i in members:
            read = reads[i]
            rows.append(
                (
                    read.elements.data_ptr(),
                    sizes[i],
                    max(row_layout(read.m.shape)[1], 1),
                    offsets[i],
                    read.m.codes.data_ptr(),
                    read.m.scales.data_ptr() if read.m.fmt.scaled else 0,
                    read.v.codes.data_ptr(),
                    read.v.scales.data_ptr() if read.v.fmt.scaled else 0,
                )
            )
        table = torch.from_numpy(np.array(rows, dtype=np.uint64).view(np.int64)).to(device)
        grid = (len(members), -(-max(sizes[i] for i in members) // BLOCK))
        sampled_states_kernel[grid](
            table, m_out, v_out, M=m_code, V=v_code, BS=block_size, BLOCK=BLOCK
        )
    return m_out, v_out
