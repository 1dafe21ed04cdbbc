"""Nearest and stochastic rounding into every format: the reference in plain PyTorch.

Rounding works on float32 bit patterns in integers, so it is exact on any device
and is what the Triton kernels reproduce bit for bit.

For a finite float32 ``x`` and a grid ``fmt·2**k`` the grid spacing at ``|x|`` is
``2**G`` with ``G = max(e_x, min_exp + k) - P``. The significand's low ``shift``
bits lie below the grid; ``hi`` counts whole grid steps and ``lo`` is the remainder.

* Nearest (NR): round up when ``lo`` is past half a step, ties to an even ``hi``.
* Stochastic (SR): round up when a uniform 32-bit draw ``u < lo·2**(32-shift)``,
  so the upper neighbour is taken with probability equal to the distance across
  the gap and ``E[SR(x)] = x``. The decision compares the draw with the dropped
  fraction's top 23 bits, so the probability is exact whenever at most 23 bits are
  dropped (always for bf16; for scaled formats, for every element at or above its
  block's smallest grid step); below that it is truncated to multiples of 2**-23
  of a step. (A float32 add of the draw's top 23 bits under the grid step decides
  the same way, which the GPU kernel uses.)

Grid values never move, the sign is kept (an unsigned format clamps negatives to
zero), results past the largest finite value saturate to it, and NaN/±Inf are
handled as :mod:`srtrain.numerics.formats` describes.

The uniform draw for an element is ``draw(key, i)``: a counter-based hash of its
global index ``i`` within the full parameter (64-bit, no wrap-around) under a
64-bit key derived from (seed, step, parameter, state). The key and the index's
high word fold into one hashed 32-bit word (:func:`span_key`), the same for all
2**32 indices that share a high word, and one mixing round of the low word under
it gives the draw: a bijection of the low words for each key, so no two elements
of a span share a draw. The two states of an element share one draw in an optimizer
step, 16 bits each (:func:`split_draw`). The seed enters the key through the hash, never by
shifting the counter, and nothing depends on the rank, shard, program or block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from srtrain.numerics.formats import (
    BF16,
    FP32,
    NAN_SCALE_BYTE,
    SCALE_BIAS,
    Format,
    bits_float,
    check_block_size,
    code_dtype,
    code_shape,
    decode_grid,
    encode_grid,
    float_bits,
    get_format,
    pack_nibbles,
    pow2_bits,
    row_layout,
    scale_shape,
    unpack_nibbles,
)

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x21F0AAAD
MIX_MUL2 = 0x735A2D97
KEY_SALT = 0x9E3779B9

STATE_MOMENTS = 1  # m and v, which split one draw
STATE_PARAM = 3
ROUNDING_MODES = ("nearest", "stochastic")


def check_rounding(mode: str) -> str:
    """Validate a rounding mode name."""
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {mode!r}; allowed: {', '.join(ROUNDING_MODES)}")
    return mode


# ------------------------------------------------------------------------------- hash


def mix32(x):
    """A 32-bit integer mixer (xorshift-multiply); works on Python ints and int64 tensors."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def _stream_word(seed: int, step, stream):
    """First key word from (seed, step, stream): Python ints or numpy int64 arrays."""
    h = mix32(KEY_SALT ^ (seed & MASK32))
    for word in (seed >> 32, step & MASK32, step >> 32, stream):
        h = mix32(h ^ (word & MASK32))
    return h


def _state_words(k0, states: tuple[int, ...]) -> list:
    """Second key words, one per state: the first word with the state mixed in."""
    salted = mix32(k0 ^ KEY_SALT)
    return [mix32(salted ^ (state & MASK32)) for state in states]


def rng_key(seed: int, step: int, stream: int, state: int) -> tuple[int, int]:
    """64-bit key (two 32-bit words) for the draws of one state of one parameter at one step.

    The first word depends on (seed, step, stream) only, so the keys of one step of a
    parameter share it (the fused step keeps it once per shard); the second adds the state.
    """
    if seed < 0 or step < 0 or stream < 0 or state < 0:
        raise ValueError("seed, step, stream and state must be non-negative integers")
    k0 = _stream_word(seed, step, stream)
    return k0, _state_words(k0, (state,))[0]


def _mix32_words(x: np.ndarray) -> np.ndarray:
    """:func:`mix32` of a uint32 array, in place (uint32 products wrap as the masks do)."""
    x ^= x >> 16
    x *= np.uint32(MIX_MUL1)
    x ^= x >> 15
    x *= np.uint32(MIX_MUL2)
    x ^= x >> 15
    return x


def _low_words(values: np.ndarray) -> np.ndarray:
    """The low 32 bits of non-negative int64 values, as uint32."""
    return (values & MASK32).astype(np.uint32)


def rng_keys(seed: int, steps, streams, states: tuple[int, ...]):
    """:func:`rng_key` for arrays of steps and streams (numpy int64) and several states:
    ``k0`` [n] and ``k1`` [n, len(states)], uint32. Where every step is the same (as when
    every parameter had a gradient at every step) the words that precede the stream are
    hashed once."""
    steps = np.asarray(steps, dtype=np.int64)
    streams = np.asarray(streams, dtype=np.int64)
    if seed < 0 or (steps < 0).any() or (streams < 0).any() or min(states) < 0:
        raise ValueError("seed, step, stream and state must be non-negative integers")
    if steps.shape != streams.shape:
        raise ValueError("rng_keys needs one step per stream")
    h = mix32(KEY_SALT ^ (seed & MASK32))
    h = mix32(h ^ ((seed >> 32) & MASK32))
    if steps.size > 0 and steps.min() == steps.max():
        step = int(steps.flat[0])
        h = mix32(h ^ (step & MASK32))
        k0 = _mix32_words(np.uint32(mix32(h ^ (step >> 32))) ^ _low_words(streams))
    else:
        words = _mix32_words(np.uint32(h) ^ _low_words(steps))
        words ^= _low_words(steps >> 32)
        k0 = _mix32_words(_mix32_words(words) ^ _low_words(streams))
    salted = _mix32_words(k0 ^ np.uint32(KEY_SALT))
    k1 = _mix32_words(salted[..., None] ^ np.array([s & MASK32 for s in states], np.uint32))
    return k0, k1


def span_key(key: tuple[int, int], hi):
    """The word that keys the draws of the indices whose high word is ``hi``:
    ``k0 ^ mix32(hi ^ k1)`` (Python int or int64 tensor)."""
    k0, k1 = key
    return k0 ^ mix32(hi ^ k1)


def draw(key: tuple[int, int], index: torch.Tensor) -> torch.Tensor:
    """Uniform 32-bit integers (int64 tensor) for global element indices ``index`` (int64):
    ``mix32(index_lo ^ span_key(key, index_hi))``."""
    return mix32((index & MASK32) ^ span_key(key, index >> 32))


def split_draw(rand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent rounding draws from one: its top 16 bits (the low half cleared) and
    its low 16 bits moved to the top.

    A decision on such a draw reads 16 bits. BF16 drops 16 bits, so its decisions stay
    exact; where more bits drop (FP8, FP4) a value a fraction ``f`` of a step above the
    grid rounds up with probability ``ceil(f·2**16) / 2**16``: never more than 2**-16 of a
    step above ``f``, and grid values still never move.
    """
    return rand & 0xFFFF0000, (rand << 16) & MASK32


def global_index(offset: int, numel: int, device: torch.device | str) -> torch.Tensor:
    """Global indices ``offset .. offset+numel-1`` of a shard's elements (int64)."""
    return torch.arange(offset, offset + numel, dtype=torch.int64, device=device)


# --------------------------------------------------------------------------- rounding


def round_bits(
    x: torch.Tensor,
    fmt: Format,
    k: torch.Tensor | int,
    stochastic: bool,
    rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round float32 ``x`` onto the grid ``fmt·2**k``; returns float32 bits (int64).

    Non-finite inputs come back unchanged (canonical NaN); callers of scaled
    formats mark such blocks themselves.
    """
    p = fmt.fraction_bits
    u = float_bits(x)
    k = torch.as_tensor(k, dtype=torch.int64, device=x.device)
    sign = u >> 31
    a = u & 0x7FFFFFFF
    ex = a >> 23
    e_eff = torch.clamp(ex, min=1) - 127
    significand = (a & 0x7FFFFF) | torch.where(ex > 0, 0x800000, 0)
    grid_exp = torch.maximum(e_eff, fmt.min_exp + k) - p
    shift = grid_exp - (e_eff - 23)
    cs = torch.clamp(shift, max=31)
    lo = significand & ((1 << cs) - 1)
    hi = significand >> cs
    if stochastic:
        if rand is None:
            raise ValueError("stochastic rounding needs uniform draws")
        frac32 = torch.where(
            shift <= 31,
            lo << torch.clamp(32 - shift, 0, 32),
            significand >> torch.clamp(shift - 32, 0, 31),
        )
        # the fraction's top 23 bits decide: exact whenever at most 23 bits drop
        up = (rand < (frac32 & 0xFFFFFE00)).to(torch.int64)
    else:
        half = 1 << (cs - 1)
        up = ((lo > half) | ((lo == half) & ((hi & 1) == 1))).to(torch.int64)
    short = torch.clamp(shift, max=23)
    r = torch.where(
        shift <= 23,
        ((a >> short) + up) << short,
        up * ((torch.clamp(grid_exp, -126, 127) + 127) << 23),
    )
    max_bits = ((fmt.max_exp + k + 127) << 23) | (fmt.max_fraction << (23 - p))
    r = torch.minimum(r, max_bits)
    if fmt.signed:
        r = r | (sign << 31)
    else:
        r = torch.where(sign == 1, 0, r)
    nan = a > 0x7F800000
    inf = a == 0x7F800000
    r = torch.where(inf, u, r)
    return torch.where(nan, torch.full_like(r, 0x7FC00000), r)


BF16_MAX_BITS = ((BF16.max_exp + 127) << 23) | (BF16.max_fraction << (23 - BF16.fraction_bits))


def bf16_bits(x: torch.Tensor, stochastic: bool, rand: torch.Tensor | None = None) -> torch.Tensor:
    """``round_bits(x, BF16, 0, stochastic, rand)``, bit for bit, in fewer operations.

    bf16's rounding shift is always 16, so rounding up is a carry out of the low
    half-word: stochastic adds ``0xFFFF - (rand >> 16)`` (a carry exactly when
    ``rand < lo << 16``), nearest adds ``0x7FFF`` plus the kept part's last bit (ties to
    even). The magnitude is capped at the largest finite bf16 (±Inf, whose exponent field
    the cap takes over, stays), the sign kept, NaN made 0x7FC00000.
    """
    u = float_bits(x)
    a = u & 0x7FFFFFFF
    if stochastic:
        if rand is None:
            raise ValueError("stochastic rounding needs uniform draws")
        increment = 0xFFFF - (rand >> 16)
    else:
        increment = 0x7FFF + ((u >> 16) & 1)
    cap = torch.clamp(a & 0x7F800000, min=BF16_MAX_BITS)
    r = torch.minimum((a + increment) & 0xFFFF0000, cap) | (u & 0x80000000)
    return torch.where(a > 0x7F800000, 0x7FC00000, r)


def round_to_format(
    x: torch.Tensor,
    fmt: Format | str,
    mode: str = "nearest",
    key: tuple[int, int] | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Round float32 ``x`` onto an unscaled format's grid (fp32, bf16); float32 result."""
    fmt = get_format(fmt)
    if fmt.scaled:
        raise ValueError(f"{fmt.name} needs block scales: use quantize()")
    if fmt is FP32:
        check_rounding(mode)
        return x.to(torch.float32, copy=True)
    return to_bf16(x, mode, key, offset).to(torch.float32)


def bf16_from_bits(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """bfloat16 tensor holding the top halves of float32 bit patterns on the bf16 grid."""
    high = bits >> 16
    high = torch.where(high >= 2**15, high - 2**16, high)
    return high.to(torch.int16).view(torch.bfloat16).reshape(shape)


def to_bf16(
    x: torch.Tensor,
    mode: str = "nearest",
    key: tuple[int, int] | None = None,
    offset: int = 0,
    rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 (NaN becomes the canonical 0x7FC0); stochastic
    rounding takes its draws from ``key`` or, given, from ``rand``."""
    x = x.to(torch.float32)
    rand = _draws(mode, key, offset, x, rand)
    return bf16_from_bits(bf16_bits(x.reshape(-1), mode == "stochastic", rand), x.shape)


def sr_cast_bf16(x: torch.Tensor, key: tuple[int, int], offset: int = 0) -> torch.Tensor:
    """Stochastically round float32 ``x`` to bfloat16 (the spec of the Triton SR cast)."""
    return to_bf16(x, "stochastic", key, offset)


def _draws(
    mode: str, key, offset: int, x: torch.Tensor, rand: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The flat draws of ``x``'s elements: ``rand`` when given, else the key's."""
    check_rounding(mode)
    if mode == "nearest":
        return None
    if rand is not None:
        if rand.numel() != x.numel():
            raise ValueError(f"{rand.numel()} draws for {x.numel()} elements")
        return rand.reshape(-1)
    if key is None:
        raise ValueError("stochastic rounding needs a key (see rng_key)")
    return draw(key, global_index(offset, x.numel(), x.device)).reshape(-1)


# ------------------------------------------------------------------- stored states


@dataclass
class StoredState:
    """One optimizer state as stored: codes and, for scaled formats, scale bytes."""

    fmt: Format
    codes: torch.Tensor
    scales: torch.Tensor | None
    shape: tuple[int, ...]
    block_size: int


def empty_state(
    fmt: Format | str,
    shape: tuple[int, ...],
    block_size: int,
    device: torch.device | str,
    zeroed: bool = True,
) -> StoredState:
    """An all-zero state for a parameter of ``shape``; with ``zeroed=False`` its buffers are
    left unwritten, for a writer that sets every code and scale byte."""
    fmt = get_format(fmt)
    check_block_size(block_size)
    shape = tuple(shape)
    new = torch.zeros if zeroed else torch.empty
    codes = new(code_shape(fmt, shape), dtype=code_dtype(fmt), device=device)
    scales = None
    if fmt.scaled:
        scales = new(scale_shape(shape, block_size), dtype=torch.uint8, device=device)
        if zeroed:
            scales.fill_(SCALE_BIAS + fmt.min_scale_exp)
    return StoredState(fmt, codes, scales, shape, block_size)


def _blocks(x: torch.Tensor, shape: tuple[int, ...], block_size: int) -> torch.Tensor:
    """View values as (rows, blocks, block_size), padding each row's last block with zeros."""
    rows, cols = row_layout(shape)
    nblocks = -(-cols // block_size)
    x = x.reshape(rows, cols)
    pad = nblocks * block_size - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, nblocks, block_size)


def keep_positive_bits(
    x: torch.Tensor, r: torch.Tensor, k: torch.Tensor, fmt: Format
) -> torch.Tensor:
    """Replace a zero result of a positive input by the smallest positive grid value.

    Used for the second moment: a block scale set by the block's largest value
    flushes much smaller values to zero, and a zero v turns the next update into
    m/eps. Storing the smallest positive value instead biases v up by at most one
    grid step, which only shrinks that element's update.
    """
    smallest = pow2_bits(fmt.min_exp - fmt.fraction_bits + k)
    return torch.where((r == 0) & (x > 0) & torch.isfinite(x), smallest, r)


def block_scale_exp(absmax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Smallest k with absmax <= max_value·2**k, clamped to the format's range (int64)."""
    a = float_bits(absmax) & 0x7FFFFFFF
    e = (a >> 23) - 127
    over = (a & 0x7FFFFF) > (fmt.max_fraction << (23 - fmt.fraction_bits))
    k = e - fmt.max_exp + over.to(torch.int64)
    k = torch.clamp(k, fmt.min_scale_exp, fmt.max_scale_exp)
    return torch.where(a == 0, torch.full_like(k, fmt.min_scale_exp), k)


def quantize(
    x: torch.Tensor,
    fmt: Format | str,
    block_size: int = 32,
    mode: str = "nearest",
    key: tuple[int, int] | None = None,
    offset: int = 0,
    keep_positive: bool = False,
    rand: torch.Tensor | None = None,
) -> StoredState:
    """Round float32 ``x`` (a parameter's shard, rows whole) into a stored state.

    ``offset`` is the global index of the shard's first element in its full
    parameter; it keys the stochastic draws (``rand``, one per element, replaces
    the key's draws when given). With ``keep_positive`` a scaled
    format never rounds a positive value to zero: it stores the block's smallest
    positive value instead (see :func:`keep_positive_bits`).
    """
    fmt = get_format(fmt)
    check_block_size(block_size)
    x = x.to(torch.float32)
    shape = tuple(x.shape)
    if fmt is BF16:
        return StoredState(fmt, to_bf16(x, mode, key, offset, rand), None, shape, block_size)
    if fmt is FP32:
        check_rounding(mode)
        return StoredState(fmt, x.clone(), None, shape, block_size)
    rand = _draws(mode, key, offset, x, rand)
    if x.numel() == 0:
        return empty_state(fmt, shape, block_size, x.device)
    rows, cols = row_layout(shape)
    blocks = _blocks(x, shape, block_size)
    finite = torch.isfinite(blocks)
    absmax = torch.where(finite, blocks.abs(), 0.0).amax(dim=-1)
    k = block_scale_exp(absmax, fmt)
    k_elem = k.unsqueeze(-1).expand_as(blocks).reshape(rows, -1)[:, :cols].reshape(-1)
    r = round_bits(x.reshape(-1), fmt, k_elem, mode == "stochastic", rand)
    if keep_positive:
        r = keep_positive_bits(x.reshape(-1), r, k_elem, fmt)
    codes = encode_grid(r, k_elem, fmt).reshape(rows, cols)
    bad_block = ~finite.all(dim=-1)
    bad_elem = bad_block.unsqueeze(-1).expand_as(blocks).reshape(rows, -1)[:, :cols]
    codes = torch.where(bad_elem, 0, codes)
    scales = torch.where(bad_block, NAN_SCALE_BYTE, k + SCALE_BIAS).to(torch.uint8)
    codes = pack_nibbles(codes) if fmt.packed else codes.to(torch.uint8)
    return StoredState(
        fmt,
        codes.reshape(code_shape(fmt, shape)),
        scales.reshape(scale_shape(shape, block_size)),
        shape,
        block_size,
    )


def _scale_exps(state: StoredState) -> torch.Tensor:
    """Each element's block-scale exponent (int64, shaped [rows, cols]; clamped to the
    format's range, as a NaN block's byte reads)."""
    rows, cols = row_layout(state.shape)
    scale_bytes = state.scales.reshape(rows, -1).to(torch.int64)
    k = torch.repeat_interleave(scale_bytes - SCALE_BIAS, state.block_size, dim=1)[:, :cols]
    return torch.clamp(k, state.fmt.min_scale_exp, state.fmt.max_scale_exp)


def largest_magnitudes(state: StoredState) -> torch.Tensor:
    """float32 largest finite magnitude each element's code can hold, shaped like the
    parameter: the format's largest value, times its block's scale for scaled formats."""
    fmt = state.fmt
    top = torch.tensor(fmt.max_value, dtype=torch.float32, device=state.codes.device)
    if not fmt.scaled or state.codes.numel() == 0:
        return top.expand(state.shape)
    return (top * bits_float(pow2_bits(_scale_exps(state)))).reshape(state.shape)


def dequantize(state: StoredState) -> torch.Tensor:
    """float32 values of a stored state, shaped like its parameter."""
    fmt = state.fmt
    if not fmt.scaled:
        return state.codes.to(torch.float32, copy=True)
    if state.codes.numel() == 0:
        return torch.zeros(state.shape, dtype=torch.float32, device=state.codes.device)
    rows, cols = row_layout(state.shape)
    if fmt.packed:
        codes = unpack_nibbles(state.codes.reshape(rows, -1), cols)
    else:
        codes = state.codes.reshape(rows, cols).to(torch.int64)
    values = decode_grid(codes, _scale_exps(state), fmt)
    nan_blocks = state.scales.reshape(rows, -1) == NAN_SCALE_BYTE
    nan_elem = torch.repeat_interleave(nan_blocks, state.block_size, dim=1)[:, :cols]
    values = torch.where(nan_elem, torch.nan, values)
    return values.reshape(state.shape)
