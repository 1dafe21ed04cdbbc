"""The stored m and v at the FP32 shadow's sampled elements, decoded, beside the shadow.

Computes :func:`srtrain.numerics.rounding.dequantize` bit for bit at given flat indices of
many parameters' local shards: each program gathers its elements' codes (and, for the
block-scaled formats, their blocks' scale bytes), decodes them with the formats' Triton
decoders (:mod:`srtrain.kernels.state_codes`) and copies the shadow's values beside them,
so a log step reads every sampled state in one launch for each kind of state pair (formats
and block size) from a table built once, with no work a parameter on the host.
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
    scale_factor,
    state_code,
)
from srtrain.kernels.triton_numerics import bf16_bits_to_float
from srtrain.numerics.formats import row_layout
from srtrain.numerics.rounding import StoredState

# Elements per program, as in the shadow's update.
BLOCK = 1024
# A parameter's row in a launch table (int64): its indices' address, their count, its row
# length, the offset of its values in the output, the addresses of m's codes and scales, of
# v's codes and scales, and of its shadow m and v.
TABLE_COLUMNS = tl.constexpr(10)
# The output's rows: the stored m, the stored v, the shadow m, the shadow v.
OUTPUT_ROWS = 4


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
        scale_byte = tl.load(scale_ptr + col // BS, mask=mask, other=0).to(tl.int32)
        factor = scale_factor(scale_byte, C.KMIN, C.KMAX)
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
    out_ptr,
    total,
    M: tl.constexpr,
    V: tl.constexpr,
    BS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (parameter, chunk): the chunk's ``BLOCK`` sampled elements of that parameter
    into the rows of ``out_ptr`` (float32 [:data:`OUTPUT_ROWS`, ``total``]). ``table_ptr``
    holds a row of :data:`TABLE_COLUMNS` per parameter; ``M`` and ``V`` are the states'
    formats."""
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
        out = out_ptr + tl.load(table + 3) + offs
        m = _decoded(tl.load(table + 4), tl.load(table + 5), idx, row, col, cols, mask, M, BS)
        tl.store(out, m, mask=mask)
        v = _decoded(tl.load(table + 6), tl.load(table + 7), idx, row, col, cols, mask, V, BS)
        tl.store(out + total, v, mask=mask)
        for i in tl.static_range(2):
            shadow = tl.load(table + 8 + i).to(tl.pointer_type(tl.float32)) + offs
            tl.store(out + (2 + i) * total, tl.load(shadow, mask=mask), mask=mask)


class SampledRead(NamedTuple):
    """One parameter's sampled elements (1-D int64 flat indices into its local shard), its
    stored states there, and its FP32 shadow m and v (at least as long as the sample)."""

    elements: torch.Tensor
    m: StoredState
    v: StoredState
    shadow_m: torch.Tensor
    shadow_v: torch.Tensor


def _kind(read: SampledRead) -> tuple[StateCode, StateCode, int]:
    """The launch a read belongs to: its state formats' constants and block size."""
    if read.m.block_size != read.v.block_size or read.m.shape != read.v.shape:
        raise ValueError("a sampled read's m and v must share their shape and block size")
    return state_code(read.m.fmt), state_code(read.v.fmt), read.m.block_size


def _check(read: SampledRead, device: torch.device) -> None:
    elements = read.elements
    if elements.dtype != torch.int64 or elements.dim() != 1:
        raise ValueError("sampled elements must be 1-D int64 tensors")
    for shadow in (read.shadow_m, read.shadow_v):
        if shadow.dtype != torch.float32 or shadow.numel() < elements.numel():
            raise ValueError("a shadow must be float32 over the sample")
    tensors = [elements, read.shadow_m, read.shadow_v]
    for state in (read.m, read.v):
        tensors += [state.codes] + ([state.scales] if state.fmt.scaled else [])
    if any(t.device != device or not t.is_contiguous() for t in tensors):
        raise ValueError(f"sampled reads need contiguous tensors on {device}")


class SampledStates:
    """The stored m and v of many parameters at their sampled elements, decoded, and their
    shadows, read by one launch for each kind of state pair (:meth:`read`). The tensors of
    ``reads`` must stay alive and in place while it is used; all on one device."""

    def __init__(self, reads: Sequence[SampledRead]) -> None:
        if not reads:
            raise ValueError("SampledStates needs at least one read")
        self.device = reads[0].elements.device
        for read in reads:
            _check(read, self.device)
        self.sizes = [read.elements.numel() for read in reads]
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total = int(offsets[-1])
        self._keep = list(reads)
        self._launches = []
        kinds: dict[tuple[StateCode, StateCode, int], list[int]] = {}
        for i, read in enumerate(reads):
            if self.sizes[i]:
                kinds.setdefault(_kind(read), []).append(i)
        for (m_code, v_code, block_size), members in kinds.items():
            rows = [
                (
                    reads[i].elements.data_ptr(),
                    self.sizes[i],
                    row_layout(reads[i].m.shape)[1],
                    offsets[i],
                    reads[i].m.codes.data_ptr(),
                    reads[i].m.scales.data_ptr() if reads[i].m.fmt.scaled else 0,
                    reads[i].v.codes.data_ptr(),
                    reads[i].v.scales.data_ptr() if reads[i].v.fmt.scaled else 0,
                    reads[i].shadow_m.data_ptr(),
                    reads[i].shadow_v.data_ptr(),
                )
                for i in members
            ]
            table = np.array(rows, dtype=np.uint64).view(np.int64)
            grid = (len(members), -(-max(self.sizes[i] for i in members) // BLOCK))
            constants = dict(M=m_code, V=v_code, BS=block_size)
            self._launches.append((torch.from_numpy(table).to(self.device), grid, constants))

    def read(self) -> torch.Tensor:
        """float32 [:data:`OUTPUT_ROWS`, total]: the stored m, the stored v, the shadow m and
        the shadow v at each read's elements, each read's after the one before (the stored
        ones as ``dequantize(state).reshape(-1)[elements]``)."""
        out = torch.empty(OUTPUT_ROWS, self.total, dtype=torch.float32, device=self.device)
        for table, grid, constants in self._launches:
            sampled_states_kernel[grid](table, out, self.total, BLOCK=BLOCK, **constants)
        return out
