"""Number formats for optimizer states: their grids, codes and block scales.

Every format is a sign-magnitude floating-point grid described by four numbers:
``fraction_bits`` P, the unbiased exponent of the smallest normal value ``min_exp``,
the exponent of the largest binade ``max_exp`` and the fraction code of the largest
finite value ``max_fraction``. Below ``2**min_exp`` the grid is uniform (subnormals)
with spacing ``2**(min_exp - P)``; in the binade ``[2**e, 2**(e+1))`` the spacing is
``2**(e - P)``, so the relative spacing is ``eps = 2**-P``.

| format  | bits | P  | smallest normal | largest finite     | smallest subnormal | scaled |
|---------|------|----|-----------------|--------------------|--------------------|--------|
| fp32    | 32   | 23 | 2^-126          | (2-2^-23)·2^127    | 2^-149             | no     |
| bf16    | 16   | 7  | 2^-126          | (2-2^-7)·2^127     | 2^-133             | no     |
| fp8     | 8    | 3  | 2^-6            | 448 (E4M3, as torch.float8_e4m3fn) | 2^-9 | yes   |
| fp4_e2m1| 4    | 1  | 1               | 6 (signed)         | 0.5                | yes    |
| fp4_e2m2| 4    | 2  | 1               | 7 (unsigned)       | 0.25               | yes    |

Scaled formats store, per block of ``block_size`` consecutive elements of a row
(the last dimension of the parameter; a 1-D parameter's elements are rows of one),
one byte ``k + 127`` holding a power-of-two scale ``2**k``: the element value is
``decode(code) * 2**k``. A power-of-two scale keeps the relative grid, so the
stall theory holds unchanged. ``k`` is the smallest exponent with
``absmax(block) <= largest_finite * 2**k``, clamped to
``[min_scale_exp, max_scale_exp]`` so that every non-zero grid value is a normal
float32. Blocks never cross rows, so a row-sharded parameter (FSDP2 shards dim 0)
splits its codes and scales consistently however many ranks hold it.

Non-finite values: fp32 and bf16 keep NaN and ±Inf. The 8- and 4-bit formats have
no infinity; a block whose values contain NaN or ±Inf is stored with the NaN scale
byte 255 (as the OCP MX E8M0 scale does) and reads back as NaN in every element.
Values above the largest finite value saturate to it (only reachable for bf16,
and for scaled formats past ``largest_finite * 2**max_scale_exp``).

FP4 codes are packed two to a byte along each row, the even column in the low
nibble; a row of odd length leaves its last high nibble zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAN_SCALE_BYTE = 255
SCALE_BIAS = 127


@dataclass(frozen=True)
class Format:
    """A floating-point grid and how its values are stored."""

    name: str
    family: str  # how its codes are laid out: "fp32", "bf16", "e4m3", "fp4" (or another)
    bits: int
    fraction_bits: int
    min_exp: int
    max_exp: int
    max_fraction: int
    signed: bool
    scaled: bool

    @property
    def eps(self) -> float:
        """Relative grid spacing, 2**-fraction_bits."""
        return 2.0**-self.fraction_bits

    @property
    def max_value(self) -> float:
        """Largest finite value (before any block scale)."""
        return (1 + self.max_fraction / 2**self.fraction_bits) * 2.0**self.max_exp

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (before any block scale)."""
        return 2.0 ** (self.min_exp - self.fraction_bits)

    @property
    def min_scale_exp(self) -> int:
        """Smallest block-scale exponent: the smallest subnormal stays a normal float32."""
        return -126 - (self.min_exp - self.fraction_bits)

    @property
    def max_scale_exp(self) -> int:
        """Largest block-scale exponent: the largest value stays a finite float32."""
        return 127 - self.max_exp

    @property
    def packed(self) -> bool:
        """Two codes per byte."""
        return self.bits == 4


FP32 = Format("fp32", "fp32", 32, 23, -126, 127, 2**23 - 1, signed=True, scaled=False)
BF16 = Format("bf16", "bf16", 16, 7, -126, 127, 127, signed=True, scaled=False)
FP8_E4M3 = Format("fp8", "e4m3", 8, 3, -6, 8, 6, signed=True, scaled=True)
FP4_E2M1 = Format("fp4_e2m1", "fp4", 4, 1, 0, 2, 1, signed=True, scaled=True)
FP4_E2M2 = Format("fp4_e2m2", "fp4", 4, 2, 0, 2, 3, signed=False, scaled=True)

# The registry: every state format, the formats each moment may use (m needs a sign; v,
# never negative, must not waste one), every allowed (m, v) pair, and the pairs that
# configs, benches and studies name ("fp4": signed E2M1 for m, unsigned E2M2 for v).
FORMATS: dict[str, Format] = {f.name: f for f in (FP32, BF16, FP8_E4M3, FP4_E2M1, FP4_E2M2)}
FORMAT_ALIASES = {"fp8_e4m3": "fp8", "e4m3": "fp8", "float32": "fp32", "bfloat16": "bf16"}
M_FORMATS: tuple[Format, ...] = (FP32, BF16, FP8_E4M3, FP4_E2M1)
V_FORMATS: tuple[Format, ...] = (FP32, BF16, FP8_E4M3, FP4_E2M2)
STATE_PAIRS: tuple[tuple[Format, Format], ...] = tuple((m, v) for m in M_FORMATS for v in V_FORMATS)
NAMED_PAIRS: dict[str, tuple[Format, Format]] = {
    "fp32": (FP32, FP32),
    "bf16": (BF16, BF16),
    "fp8": (FP8_E4M3, FP8_E4M3),
    "fp4": (FP4_E2M1, FP4_E2M2),
    "fp8-fp4": (FP8_E4M3, FP4_E2M2),
}


def get_format(name: str | Format) -> Format:
    """Look a format up by name; unknown names list the allowed ones."""
    if isinstance(name, Format):
        return name
    key = FORMAT_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in FORMATS:
        raise ValueError(
            f"unknown state format {name!r}; allowed: {', '.join(FORMATS)} "
            f"(or aliases {', '.join(FORMAT_ALIASES)})"
        )
    return FORMATS[key]


def check_moment_formats(m_format: str | Format, v_format: str | Format) -> tuple[Format, Format]:
    """Formats of the two moments, a pair of :data:`STATE_PAIRS`: m needs a sign; v (never
    negative) must not waste one."""
    m_fmt, v_fmt = get_format(m_format), get_format(v_format)
    if (m_fmt, v_fmt) in STATE_PAIRS:
        return m_fmt, v_fmt
    if not m_fmt.signed:
        raise ValueError(
            f"m_format: {m_fmt.name} holds only non-negative values (it is unsigned) and cannot "
            "store the first moment; use fp4_e2m1 (or fp4, fp8, bf16, fp32)"
        )
    if v_fmt.name == "fp4_e2m1":
        raise ValueError(
            "v_format: fp4_e2m1 spends its sign bit on a non-negative state; use fp4_e2m2 (or fp4)"
        )
    raise ValueError(
        f"m_format, v_format: {m_fmt.name}, {v_fmt.name} is not a state pair; "
        f"m takes {', '.join(f.name for f in M_FORMATS)} and v "
        f"{', '.join(f.name for f in V_FORMATS)}"
    )


def check_block_size(block_size: int) -> int:
    """Block sizes are powers of two from 2 to 1024 (one scale byte per block)."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 2
        or block_size > 1024
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a power of two between 2 and 1024, got {block_size!r}"
        )
    return block_size


# ----------------------------------------------------------------------------- layout


def row_layout(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of a parameter: rows run over all but the last dim; 1-D is rows of one."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return (math.prod(shape), 1)
    return (math.prod(shape[:-1]), shape[-1])


def code_shape(fmt: Format, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the stored codes for a parameter of ``shape``."""
    shape = tuple(shape)
    if fmt.packed and len(shape) >= 2:
        return (*shape[:-1], (shape[-1] + 1) // 2)
    return shape


def scale_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Shape of the block-scale bytes for a parameter of ``shape``."""
    shape = tuple(shape)
    if len(shape) >= 2:
        return (*shape[:-1], -(-shape[-1] // block_size))
    return shape


def code_dtype(fmt: Format) -> torch.dtype:
    """Storage dtype of the codes."""
    return {32: torch.float32, 16: torch.bfloat16}.get(fmt.bits, torch.uint8)


# ----------------------------------------------------------------- float32 bit helpers


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor → its bit patterns as int64 in [0, 2**32)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bits_float(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2**32) → float32 tensor."""
    bits = bits & 0xFFFFFFFF
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


def pow2_bits(exp: torch.Tensor) -> torch.Tensor:
    """Bits of the float32 2**exp for exp in [-126, 127]."""
    return (exp + 127) << 23


# ------------------------------------------------------------------- codes and values


def encode_grid(r_bits: torch.Tensor, k: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Code of each float32 ``r_bits`` that lies exactly on the grid ``fmt·2**k`` (int64)."""
    p = fmt.fraction_bits
    sign = r_bits >> 31
    mag = r_bits & 0x7FFFFFFF
    e = (mag >> 23) - 127 - k
    normal = e >= fmt.min_exp
    fraction_normal = (mag >> (23 - p)) & ((1 << p) - 1)
    significand = (mag & 0x7FFFFF) | 0x800000
    sub_shift = torch.clamp(23 - p + fmt.min_exp - e, 0, 63)
    fraction_sub = significand >> sub_shift
    exp_field = torch.where(normal, e - fmt.min_exp + 1, 0)
    fraction = torch.where(normal, fraction_normal, fraction_sub)
    code = torch.where(mag == 0, 0, (exp_field << p) | fraction)
    if fmt.signed:
        code = code | (sign << (fmt.bits - 1))
    return code


def decode_grid(code: torch.Tensor, k: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float32 values of int64 ``code`` under scale exponent ``k``."""
    p = fmt.fraction_bits
    magnitude_bits = fmt.bits - 1 if fmt.signed else fmt.bits
    mag = code & ((1 << magnitude_bits) - 1)
    exp_field = mag >> p
    fraction = mag & ((1 << p) - 1)
    integer = torch.where(exp_field == 0, fraction, fraction + (1 << p))
    exponent = torch.clamp(exp_field, min=1) - 1 + fmt.min_exp - p + k
    value = integer.to(torch.float32) * bits_float(pow2_bits(exponent))
    if fmt.signed:
        value = torch.where((code >> (fmt.bits - 1)) & 1 == 1, -value, value)
    return value


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes of shape (rows, cols) into bytes (rows, ceil(cols/2))."""
    rows, cols = codes.shape
    if cols % 2:
        codes = torch.cat([codes, codes.new_zeros(rows, 1)], dim=1)
    pairs = codes.reshape(rows, -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles` (int64 codes of shape (rows, cols))."""
    packed = packed.to(torch.int64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return codes[:, :cols]
