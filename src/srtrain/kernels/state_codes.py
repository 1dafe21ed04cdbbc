"""Each state format's codes in Triton, beside their reference in
:mod:`srtrain.numerics.formats`: encode and decode per code family (float32, BF16 bits,
E4M3 bytes, FP4 nibble pairs), block-scale exponents, and the constants a format takes
into a kernel (:class:`StateCode`). Kernels dispatch on the family (:data:`FAMILIES`),
never on the width, and implement exactly the formats of
:data:`~srtrain.numerics.formats.FORMATS`; any other format is refused before a launch is
built (:func:`check_formats`)."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from srtrain.kernels.triton_numerics import _u32, round_magnitude, shift_right
from srtrain.numerics.formats import FORMATS, NAN_SCALE_BYTE, SCALE_BIAS, Format

# code family → the small integer a kernel dispatches on; families from 2 are block-scaled
FAMILIES = {"fp32": 0, "bf16": 1, "e4m3": 2, "fp4": 3}
FP32_CODES, BF16_CODES, E4M3_CODES, FP4_CODES = (
    tl.constexpr(FAMILIES[f]) for f in ("fp32", "bf16", "e4m3", "fp4")
)
_SCALE_BIAS, _NAN_SCALE_BYTE = tl.constexpr(SCALE_BIAS), tl.constexpr(NAN_SCALE_BYTE)


def check_formats(*fmts: Format) -> None:
    """Raise, in one line, unless the kernels implement each of ``fmts``: one of
    :data:`~srtrain.numerics.formats.FORMATS`, whose code family they decode."""
    for fmt in fmts:
        if FORMATS.get(fmt.name) != fmt or fmt.family not in FAMILIES:
            raise ValueError(
                f"the fused kernels have no codes for state format {fmt.name} ({fmt.family}, "
                f"{fmt.bits} bits); they implement {', '.join(FORMATS)}"
            )


class StateCode(NamedTuple):
    """A state format's constants as a kernel takes them, one compile-time argument: its code
    family (``KIND``, :data:`FAMILIES`), fraction bits, exponents of the smallest normal and
    the largest binade, fraction code of the largest value, sign, bits a code, and the
    range of its block-scale exponents (0, 0 unscaled)."""

    KIND: int
    P: int
    EMIN: int
    EMAX: int
    MAXF: int
    SIGNED: int
    BITS: int
    KMIN: int
    KMAX: int


def state_code(fmt: Format) -> StateCode:
    """The :class:`StateCode` of ``fmt``; refuses a format the kernels do not implement
    (:func:`check_formats`)."""
    check_formats(fmt)
    return StateCode(
        FAMILIES[fmt.family],
        fmt.fraction_bits,
        fmt.min_exp,
        fmt.max_exp,
        fmt.max_fraction,
        int(fmt.signed),
        fmt.bits,
        fmt.min_scale_exp if fmt.scaled else 0,
        fmt.max_scale_exp if fmt.scaled else 0,
    )


@triton.jit
def block_scale_exp(
    top,
    P: tl.constexpr,
    EMAX: tl.constexpr,
    MAXF: tl.constexpr,
    KMIN: tl.constexpr,
    KMAX: tl.constexpr,
):
    """Block-scale exponent (int32) of numerics.rounding.block_scale_exp from the bits of
    the block's largest magnitude ``top`` (uint32, under 2**31).

    A fraction above the format's largest, ``MAXF << (23 - P)``, carries into the exponent
    field when ``2**23 - 1 - (MAXF << (23 - P))`` is added, so one add and a shift give the
    exponent field plus that carry. Zero and subnormal magnitudes give a field of 0 or 1,
    which the lower clamp lifts to ``KMIN`` as the spec does: ``-127 - EMAX`` lies below
    ``KMIN = -126 - (EMIN - P)`` for every format (EMIN < EMAX)."""
    field = shift_right(top + (0x7FFFFF - (MAXF << (23 - P))), 23).to(tl.int32)
    return tl.minimum(tl.maximum(field - (127 + EMAX), KMIN), KMAX)


@triton.jit
def encode_grid(
    r, k, P: tl.constexpr, EMIN: tl.constexpr, SIGNED: tl.constexpr, BITS: tl.constexpr
):
    """Code of grid value bits ``r`` under scale exponent ``k`` (uint32)."""
    sign = r >> 31
    mag = r & 0x7FFFFFFF
    e = (mag >> 23).to(tl.int32) - 127 - k
    normal = e >= EMIN
    fraction_normal = (mag >> (23 - P)) & ((1 << P) - 1)
    significand = (mag & 0x7FFFFF) | 0x800000
    fraction_sub = significand >> _u32(tl.minimum(tl.maximum(23 - P + EMIN - e, 0), 31))
    exp_field = _u32(tl.where(normal, e - EMIN + 1, 0))
    fraction = tl.where(normal, fraction_normal, fraction_sub)
    code = tl.where(mag == 0, 0, (exp_field << P) | fraction).to(tl.uint32)
    if SIGNED:
        code = code | (sign << (BITS - 1))
    return code


@triton.jit
def pow2(k):
    """2**k as float32 for int32 ``k`` in the normal range."""
    return ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_factor(scale_byte, KMIN: tl.constexpr, KMAX: tl.constexpr):
    """float32 scale factor of blocks' scale bytes (int32): 2**k of their exponent k, clamped
    to [KMIN, KMAX] as the spec reads it, or NaN for a NaN block's byte."""
    k = tl.minimum(tl.maximum(scale_byte - _SCALE_BIAS, KMIN), KMAX)
    return tl.where(scale_byte == _NAN_SCALE_BYTE, float("nan"), pow2(k))


@triton.jit
def fp4_as_e4m3(code, P: tl.constexpr, SIGNED: tl.constexpr):
    """E4M3 code (uint32) of the FP4 code's value · 2**-(6 + EMIN): its exponent field and
    fraction move into E4M3's low exponent bits and top fraction bits."""
    if SIGNED:
        return ((code & 8) << 4) | ((code & 7) << (3 - P))
    return code << (3 - P)


@triton.jit
def e4m3_code(x):
    """E4M3 codes (uint32) of float32 ``x`` by the hardware conversion (nearest, ties to
    even, saturating; exact on E4M3 values)."""
    return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)


@triton.jit
def e4m3_codes(x):
    """E4M3 codes (uint8) of float32 ``x`` by the hardware conversion (nearest, ties to even,
    saturating), four at a time, two a conversion: the codes come in the word a store
    writes, not one register each."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r",
        [x],
        dtype=tl.uint8,
        is_pure=True,
        pack=4,
    )


@triton.constexpr_function
def fp4_pairs_ptx(P: int, SIGNED: bool) -> str:
    """PTX of :func:`fp4_pairs`: output $0 four byte pairs, inputs $1-$4 the even values and
    $5-$8 the odd ones."""
    magnitude = (0x7F >> (3 - P)) * 0x01010101

    def nibbles(w: str) -> str:  # E4M3 codes of a word to FP4 codes, an odd one moved up
        sign = f"shr.b32 s, {w}, 4; and.b32 s, s, 0x08080808; " if SIGNED else ""
        keep = f"or.b32 {w}, {w}, s; " if SIGNED else ""
        return (
            sign
            + f"shr.b32 {w}, {w}, {3 - P}; and.b32 {w}, {w}, {magnitude}; "
            + keep
            + f"shr.b32 s, {w}, 4; or.b32 {w}, {w}, s; "
        )

    return (
        "{ .reg .b16 a, b, c, d; .reg .b32 w, x, s; "
        "cvt.rn.satfinite.e4m3x2.f32 a, $5, $1; cvt.rn.satfinite.e4m3x2.f32 b, $6, $2; "
        "cvt.rn.satfinite.e4m3x2.f32 c, $7, $3; cvt.rn.satfinite.e4m3x2.f32 d, $8, $4; "
        "mov.b32 w, {a, b}; mov.b32 x, {c, d}; "
        + nibbles("w")
        + nibbles("x")
        + "prmt.b32 $0, w, x, 0x6420; }"
    )


@triton.jit
def fp4_pairs(even, odd, P: tl.constexpr, SIGNED: tl.constexpr):
    """FP4 byte pairs (uint8) of float32 values on the FP4 grid moved into E4M3's range (see
    :func:`fp4_as_e4m3`), ``even`` in the low nibbles and ``odd`` in the high ones, four
    pairs at a time: E4M3 conversions of each pair, whose sign moves from bit 7 to bit 3
    while the rest shifts down by 3 - P (the dropped bits are 0 on the grid), each byte
    masked after the shift (a pack of fewer than four pairs holds other bits); one shift
    and or put each odd code above its even one, and a byte permute gathers the pairs."""
    return tl.inline_asm_elementwise(
        fp4_pairs_ptx(P, SIGNED),
        "=r,r,r,r,r,r,r,r,r",
        [even, odd],
        dtype=tl.uint8,
        is_pure=True,
        pack=4,
    )


@triton.constexpr_function
def e4m3_move_ptx(word: str, P: int, SIGNED: bool) -> str:
    """PTX moving four FP4 codes (one a byte of ``word``) to E4M3 codes of their values
    · 2**-(6 + EMIN), in place (:func:`fp4_as_e4m3`)."""
    if SIGNED:
        return (
            f"and.b32 e, {word}, 0x08080808; shl.b32 e, e, 4; "
            f"and.b32 {word}, {word}, 0x07070707; shl.b32 {word}, {word}, {3 - P}; "
            f"or.b32 {word}, {word}, e; "
        )
    return f"shl.b32 {word}, {word}, {3 - P}; "


@triton.constexpr_function
def fp4_pair_values_ptx(P: int, EMIN: int, SIGNED: bool) -> str:
    """PTX of :func:`fp4_pair_values`: outputs $0-$3 the low nibbles' values, $4-$7 the
    high nibbles', input $8 four byte pairs."""
    scale = ((21 + EMIN) << 10) * 0x10001  # 2**(6 + EMIN) in both halves
    halves = "".join(
        f"mov.b32 {{a, b}}, {word}; cvt.rn.f16x2.e4m3x2 fa, a; cvt.rn.f16x2.e4m3x2 fb, b; "
        f"mul.rn.f16x2 fa, fa, s; mul.rn.f16x2 fb, fb, s; mov.b32 {{a, b}}, fa; "
        f"mov.b32 {{c, d}}, fb; cvt.f32.f16 ${first}, a; cvt.f32.f16 ${first + 1}, b; "
        f"cvt.f32.f16 ${first + 2}, c; cvt.f32.f16 ${first + 3}, d; "
        for word, first in (("n", 0), ("h", 4))
    )
    return (
        "{ .reg .b32 n, h, e, s, fa, fb; .reg .b16 a, b, c, d; "
        "and.b32 n, $8, 0x0F0F0F0F; shr.b32 h, $8, 4; and.b32 h, h, 0x0F0F0F0F; "
        + e4m3_move_ptx("n", P, SIGNED)
        + e4m3_move_ptx("h", P, SIGNED)
        + f"mov.b32 s, {scale}; "
        + halves
        + "}"
    )


@triton.jit
def fp4_pair_values(pairs, P: tl.constexpr, EMIN: tl.constexpr, SIGNED: tl.constexpr):
    """float32 values of the two FP4 codes of each byte of ``pairs`` (uint8), four bytes at a
    time: the low nibbles' (even elements) and the high nibbles' (odd elements). The codes
    convert exactly through E4M3 (:func:`fp4_as_e4m3`) and half precision, where the
    product by 2**(6 + EMIN) that undoes the move into E4M3's range is exact too."""
    return tl.inline_asm_elementwise(
        fp4_pair_values_ptx(P, EMIN, SIGNED),
        "=r,=r,=r,=r,=r,=r,=r,=r,r",
        [pairs],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )


@triton.jit
def e4m3_value(code):
    """float32 value of E4M3 codes (uint8 or uint32), converted exactly in hardware."""
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def code_value(
    code, factor, P: tl.constexpr, EMIN: tl.constexpr, SIGNED: tl.constexpr, KIND: tl.constexpr
):
    """float32 value of a scaled format's code (uint32) under the block's scale factor
    (a power of two, or NaN for a NaN block): E4M3 codes convert exactly in hardware,
    FP4 codes through E4M3 (``KIND``: the code family)."""
    if KIND == E4M3_CODES:
        byte = code
    else:
        byte = fp4_as_e4m3(code, P, SIGNED)
    x = e4m3_value(byte)
    if KIND == FP4_CODES:
        x = x * (2.0 ** (6 + EMIN))
    return x * factor


@triton.jit
def grid_code(
    x,
    u,
    k,
    bad,
    valid,
    rand,
    C: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    KEEP_POSITIVE: tl.constexpr,
    NONNEGATIVE: tl.constexpr,
    PART: tl.constexpr,
):
    """Codes and values over 2**k of finite float32 ``x`` (bits ``u``) rounded onto a scaled
    format's grid fmt·2**k (its :class:`StateCode` ``C``) under the part ``PART`` of draws
    ``rand``: round_bits, keep-positive and encode_grid bit for bit, on the GPU. Codes come
    as uint8, 0 in ``bad`` blocks ([TB, 1]) and, for FP4, where not ``valid``; FP4 codes
    come as their byte pairs ([TB, BS // 2], :func:`fp4_pairs`). Rounded values are capped
    per block, at the largest grid value or, in a bad block, at 0 with the sign left off, so
    a bad block's values and codes are 0 with no select an element. ``NONNEGATIVE`` promises
    no negative ``x`` (a second moment: an unsigned format's old values are not, and the
    step adds g²·(1 − β2)), so an unsigned format skips the clamp at zero.

    ``x·2**-k`` is exact where it matters (a product small enough to lose bits lies far under
    the smallest grid step and rounds to 0 either way). E4M3 nearest rounding is the
    conversion itself; the others round by :func:`round_magnitude` and convert a grid
    value, which is exact (FP4 values move into E4M3's range as :func:`fp4_as_e4m3` does).
    Keep-positive lifts a positive value to the smallest grid step before it rounds: a value
    at or above that step never rounds to 0, and one below it rounds to 0 or to the step,
    which keep-positive makes the step either way.
    """
    P: tl.constexpr = C.P
    EMIN: tl.constexpr = C.EMIN
    KIND: tl.constexpr = C.KIND
    SIGNED: tl.constexpr = C.SIGNED
    scale = pow2(-k)
    if KIND == E4M3_CODES and not STOCHASTIC:
        t = x * scale
        if KEEP_POSITIVE:
            t = tl.where(x > 0, tl.maximum(t, 2.0 ** (EMIN - P)), t)
        code = e4m3_codes(tl.where(bad, 0.0, t))
        value = e4m3_value(code)
    else:
        if SIGNED or NONNEGATIVE:  # NaN lies in a bad block, whose values are capped at 0
            t = tl.abs(x) * scale
        else:  # negative values clamp to zero
            t = tl.maximum(x, 0.0) * scale
        if KEEP_POSITIVE:
            t = tl.where(x > 0, tl.maximum(t, 2.0 ** (EMIN - P)), t)
        r = round_magnitude(t, rand, P, EMIN, STOCHASTIC, PART).to(tl.uint32, bitcast=True)
        cap = tl.where(bad, 0, ((C.EMAX + 127) << 23) | (C.MAXF << (23 - P))).to(tl.uint32)
        r = tl.minimum(r, cap)
        if SIGNED:
            sign = tl.where(bad, 0, 0x80000000).to(tl.uint32)
            value = (r | (u & sign)).to(tl.float32, bitcast=True)
        else:
            value = r.to(tl.float32, bitcast=True)
        if KIND == E4M3_CODES:
            code = e4m3_codes(value)
        else:  # a pair's padding nibble stays 0
            moved = tl.where(valid, value, 0.0) * (2.0 ** -(6 + EMIN))
            even, odd = tl.split(tl.reshape(moved, (moved.shape[0], moved.shape[1] // 2, 2)))
            code = fp4_pairs(even, odd, P, SIGNED)
    return code, value
