"""Triton device functions that compute :mod:`srtrain.numerics` bit for bit: the hash and
its draws, rounding, and whether kernels run compiled or in Triton's interpreter.

Bit patterns are ``tl.uint32``, exponents and shift counts ``tl.int32``; every
shift amount is clamped into [0, 31] because both LLVM and the interpreter leave
wider shifts undefined. A state format's codes are in :mod:`srtrain.kernels.state_codes`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from srtrain.numerics.rounding import MIX_MUL1, MIX_MUL2


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Paths only the GPU runs: scaled formats rounded by float adds and the E4M3 conversion
# (grid_code), and block scales stored by the threads that hold them (PTX stores). The
# interpreter has no round-toward-zero add, no nearest float8 conversion and no inline
# assembly, so it rounds with integer operations (round_bits, encode_grid) and stores
# through tl.store, which gives the same bits.
HARDWARE = tl.constexpr(not interpreted())


_MUL1 = tl.constexpr(MIX_MUL1)
_MUL2 = tl.constexpr(MIX_MUL2)


@triton.jit
def _u32(x):
    return x.to(tl.uint32)


@triton.jit
def is_finite(x):
    """Whether float32 ``x`` is finite (not NaN or ±Inf), from its bits."""
    return (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000


@triton.jit
def shift_right(x, S: tl.constexpr):
    """``x >> S`` for uint32 ``x`` as the high word of ``x · 2**(32 - S)``: the same bits,
    computed by the multiplier (IMAD.HI) instead of the integer ALU, which the hash and
    the rounding otherwise saturate."""
    return tl.umulhi(x, tl.full(x.shape, 1 << (32 - S), tl.uint32))


@triton.jit
def mix_tail(x):
    """numerics.rounding.mix32 after its first xorshift."""
    x = x * _MUL1
    x = x ^ shift_right(x, 15)
    x = x * _MUL2
    return x ^ shift_right(x, 15)


@triton.jit
def mix32(x):
    """The 32-bit mixer of numerics.rounding.mix32."""
    return mix_tail(x ^ shift_right(x, 16))


@triton.jit
def index_words(index):
    """Low and high 32-bit words (uint32) of int64 global indices."""
    return (index & 0xFFFFFFFF).to(tl.uint32), (index >> 32).to(tl.uint32)


@triton.jit
def flat_index_words(base, offs):
    """Words of the indices ``base + offs`` (int64 scalar base, small int32 ``offs``)
    with 32-bit adds: the high word carries when the low word wraps."""
    base_lo, base_hi = index_words(base)
    lo = base_lo + offs.to(tl.uint32)
    return lo, base_hi + (lo < base_lo).to(tl.uint32)


@triton.jit
def tile_index_words(base, offs):
    """:func:`flat_index_words` where ``base + offs`` stays under the next multiple of 2**32:
    the high word is the base's."""
    base_lo, base_hi = index_words(base)
    return base_lo + offs.to(tl.uint32), base_hi


@triton.jit
def span_key(k0, k1, hi):
    """``k0 ^ mix32(hi ^ k1)``: the word keying the draws of indices with high word ``hi``
    (numerics.rounding.span_key); a scalar for a tile whose indices share their high word."""
    return k0 ^ mix32(hi ^ k1)


@triton.jit
def draw(key, lo):
    """Uniform uint32 for the indices with low words ``lo`` under their span key
    (numerics.rounding.draw): ``mix32(lo ^ key)``, whose first xorshift distributes over
    the xor, ``lo ^ (lo >> 16) ^ (key ^ (key >> 16))``, so that the key's part is one
    word a tile and each element takes one three-input xor."""
    return mix_tail(lo ^ shift_right(lo, 16) ^ (key ^ (key >> 16)))


@triton.jit
def span_word(key, base):
    """The word of :func:`draw_in_span` for the span key ``key`` and a span whose first
    index has low word ``base`` (uint32 scalars)."""
    return key ^ (key >> 16) ^ base ^ (base >> 16)


@triton.jit
def draw_in_span(word, offs):
    """:func:`draw` of the indices ``base + offs`` of a span whose low word ``base`` is a
    multiple of a power of two ``P`` <= 2**16 above every offset ``offs`` (uint32), under
    its :func:`span_word`: ``base + offs`` is ``base ^ offs`` and shifts right by 16 to
    ``base >> 16``, so each element takes one xor before the mixer's tail."""
    return mix_tail(offs ^ word)


@triton.jit
def round_bits(
    u,
    k,
    rand,
    P: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX: tl.constexpr,
    MAXF: tl.constexpr,
    SIGNED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Round finite float32 bits ``u`` onto the grid fmt·2**k (numerics.rounding.round_bits)
    of a scaled format, whose smallest grid step ``2**(EMIN + k - P)`` is a normal float32.

    A value at most ``P`` binades below the grid's smallest normal drops ``shift`` <= 23
    fraction bits: adding the rounding increment to the bits and clearing the dropped ones
    rounds it, carrying into the exponent where needed. Anything smaller rounds to 0 or to
    the smallest grid step. NaN and ±Inf give unspecified bits: a block holding one is
    stored as the NaN block. :func:`round_magnitude` computes the same with float adds.
    """
    a = u & 0x7FFFFFFF
    ex = (a >> 23).to(tl.int32)
    below = tl.maximum((EMIN + 127) + k - tl.maximum(ex, 1), 0)  # binades under the normals
    shift = (23 - P) + below
    near = below <= P
    cs = _u32(tl.minimum(shift, 23))
    dropped = (tl.full(cs.shape, 1, tl.uint32) << cs) - 1
    significand = (a & 0x7FFFFF) | tl.where(ex > 0, 0x800000, 0).to(tl.uint32)
    if STOCHASTIC:
        # up iff rand < dropped bits << (32 - shift): the complement of rand's top bits
        # carries exactly then
        increment = (rand ^ 0xFFFFFFFF) >> (32 - cs)
        frac = (significand << 8) >> _u32(tl.minimum(tl.maximum(shift - 24, 0), 31))
        up_far = rand < (frac & 0xFFFFFE00)  # the fraction's top 23 bits decide
    else:
        increment = (dropped >> 1) + ((significand >> cs) & 1)  # ties to even
        # only a value in (half, 1) of the smallest step rounds up from below the grid
        up_far = (shift == 24) & (ex > 0) & ((a & 0x7FFFFF) != 0)
    r_near = (a + increment) & (dropped ^ 0xFFFFFFFF)
    smallest = _u32(k + (EMIN - P + 127)) << 23
    r = tl.where(near, r_near, tl.where(up_far, smallest, 0))
    max_bits = (_u32(EMAX + k + 127) << 23) | (MAXF << (23 - P))
    r = tl.minimum(r, max_bits)
    if SIGNED:
        r = r | (u & 0x80000000)
    else:
        r = tl.where((u >> 31) == 1, 0, r)
    return r.to(tl.uint32)


# Which bits of a uniform uint32 draw a rounding reads: all of it, its top 16 bits (the low
# half cleared), or its low 16 bits moved to the top (numerics.rounding.split_draw). Device
# code takes the whole draw and a part, and reads the part's bits where they lie: no mask
# or shift builds the part first.
DRAW_WHOLE, DRAW_HIGH, DRAW_LOW = (tl.constexpr(i) for i in range(3))


@triton.jit
def draw_part(rand, PART: tl.constexpr):
    """The part ``PART`` of draws ``rand`` as a draw of its own (uint32)."""
    if PART == DRAW_HIGH:
        rand = rand & 0xFFFF0000
    elif PART == DRAW_LOW:
        rand = rand << 16
    return rand


@triton.jit
def or_complement(a, b, MASK: tl.constexpr):
    """``a | (~b & MASK)`` (uint32) as one PTX ``lop3``: LLVM rewrites the expression into
    three operations, an and, an add and an xor, around the add that made ``a``."""
    asm: tl.constexpr = f"lop3.b32 $0, $1, $2, {MASK}, 0xF2;"
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def binade_max(binade, C: tl.constexpr, EMIN: tl.constexpr):
    """``max(binade, (EMIN + 127) << 23) + C`` (uint32 bits) for a constant ``C`` in
    [0, 2**28), in the form ``max(binade + C, ((EMIN + 127) << 23) + C)`` over int32, which
    sm_90 computes in one instruction (VIADDMNMX) where the max then the add take two. The
    sums stay in int32: a block that is not NaN scales its values under 2**10 (``binade`` <
    0x44800000); a NaN block's values are not stored."""
    sums = binade.to(tl.int32, bitcast=True) + C
    return tl.maximum(sums, ((EMIN + 127) << 23) + C).to(tl.uint32, bitcast=True)


@triton.jit
def round_magnitude(
    t, rand, P: tl.constexpr, EMIN: tl.constexpr, STOCHASTIC: tl.constexpr, PART: tl.constexpr
):
    """Finite float32 ``t`` >= 0 rounded onto the grid of ``P`` fraction bits whose smallest
    normal is ``2**EMIN`` (no upper clamp): :func:`round_bits` at k = 0 under the part
    ``PART`` of draws ``rand``, by float adds.

    ``big`` is 2**23 grid steps at ``t``, so float32 sums in [big, 2·big) hold exactly the
    grid's multiples: nearest rounding is RN(t + big) - big (ties to an even multiple).
    Stochastic rounding adds step·(1 + n), n the complement of the draw's top 23 bits over
    2**23, rounding toward zero, then truncates the sum to a multiple of the step the same
    way, by adding big - step. Both truncations keep the sum's whole steps, and
    ``t + step·n`` passes a grid point exactly when round_bits goes up. A 16-bit part's
    draw has 7 zero bits under its 16, whose complement is set in the step's fraction
    before the part's bits go in. Round-toward-zero adds are PTX instructions (libdevice):
    the interpreter takes :func:`round_bits`.
    """
    binade = t.to(tl.uint32, bitcast=True) & 0x7F800000
    big = binade_max(binade, (23 - P) << 23, EMIN)
    if STOCHASTIC:
        if PART == DRAW_LOW:  # the draw's top 23 bits, of which 16 are the part's
            part = rand << 7
        else:
            part = shift_right(rand, 9)
        mask: tl.constexpr = 0x7FFFFF if PART == DRAW_WHOLE else 0x7FFF80
        step = big - ((23 << 23) - (0x7FFFFF ^ mask))
        noisy = or_complement(step, part, mask)
        y = libdevice.add_rz(t, noisy.to(tl.float32, bitcast=True))
        below_big = big - 2  # big - step: the float two places under big
        z = libdevice.add_rz(y, below_big.to(tl.float32, bitcast=True))
    else:
        z = t + big.to(tl.float32, bitcast=True)
    return z - big.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(u, rand, STOCHASTIC: tl.constexpr, PART: tl.constexpr):
    """Float32 bits ``u`` rounded onto the bf16 grid under the part ``PART`` of draws
    ``rand``: round_bits for bf16, in fewer steps.

    The rounding shift of bf16 is always 16. Stochastic rounding goes up when
    ``rand >> 16 < lo`` (the same decision as ``rand < lo << 16``), which is when adding
    ``0xFFFF - (rand >> 16)`` (for the low part, ``0xFFFF - (rand & 0xFFFF)``) to the bits
    carries out of the low half-word; nearest adds ``0x7FFF`` plus the kept part's last
    bit. Overflow saturates, NaN becomes 0x7FC00000, ±Inf stays: the rounded magnitude is
    capped at the largest finite bf16, or at Inf for ±Inf (whose exponent field the cap
    takes over).
    """
    a = u & 0x7FFFFFFF
    if STOCHASTIC:
        if PART == DRAW_LOW:
            increment = (rand & 0xFFFF) ^ 0xFFFF
        else:
            increment = 0xFFFF - shift_right(rand, 16)
    else:
        increment = 0x7FFF + ((u >> 16) & 1)
    cap = tl.maximum(a & 0x7F800000, 0x7F7F0000)
    r = tl.minimum((a + increment) & 0xFFFF0000, cap) | (u & 0x80000000)
    return tl.where(a > 0x7F800000, 0x7FC00000, r).to(tl.uint32)


@triton.jit
def bf16_bits_to_float(h):
    """float32 from bfloat16 bits loaded as int16."""
    return (_u32(h.to(tl.uint16, bitcast=True)) << 16).to(tl.float32, bitcast=True)
