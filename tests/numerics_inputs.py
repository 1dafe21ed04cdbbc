"""Random inputs that exercise every corner of the rounding spec, and bitwise comparisons."""

from __future__ import annotations

import os

import torch


def fresh_seed() -> int:
    """A new seed per call (printed by the tests that use it, so failures replay)."""
    return int.from_bytes(os.urandom(4), "little")


def nasty_values(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    """float32 values over many binades with zeros, subnormals, huge values, NaN and ±Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4) * scale
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randperm(n, generator=g)
    specials = [
        0.0,
        -0.0,
        1e-40,
        -3e-42,
        1.4e-45,
        3.0e38,
        -3.3e38,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    for i, value in zip(pick[: len(specials)].tolist(), specials, strict=False):
        flat[i] = value
    # a run of subnormals and a run of exact zeros, each long enough to fill blocks
    if n > 100:
        start = int(pick[len(specials)])
        flat[start : start + 40] = torch.rand(min(40, n - start), generator=g) * 1e-39
        start = int(pick[len(specials) + 1])
        flat[start : start + 40] = 0.0
    return x


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's storage (identity for integer tensors)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality; float32 NaNs match any NaN (their payloads are not specified)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}"
    same = bits_of(a) == bits_of(b)
    if a.dtype == torch.float32:
        same |= torch.isnan(a) & torch.isnan(b)
    bad = (~same).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
        f"{a[tuple(bad[0])].item()} vs {b[tuple(bad[0])].item()}"
    )
