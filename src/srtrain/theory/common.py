"""Validation and quadrature shared by the plain and the block stall models."""

from __future__ import annotations

import math
import numbers
from functools import cache

ROUNDINGS = ("nearest", "stochastic")
MOMENTS = ("m", "v")
DEFAULT_BETAS = {"m": 0.9, "v": 0.999}


def check_beta(beta: float) -> float:
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be a number in (0, 1), got {beta!r}")
    return float(beta)


def check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < eps <= 1.0:
        raise ValueError(f"eps must be a number in (0, 1], got {eps!r}")
    return float(eps)


def check_choice(kind: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; allowed: {', '.join(allowed)}")
    return value


def check_snr(snr: float) -> float:
    if isinstance(snr, bool) or not isinstance(snr, numbers.Real) or not math.isfinite(snr):
        raise ValueError(f"snr must be a finite number, got {snr!r}")
    return abs(float(snr))


def check_age(age: int) -> int:
    if isinstance(age, bool) or not isinstance(age, numbers.Integral) or age < 0:
        raise ValueError(f"age must be an integer >= 0, got {age!r}")
    return int(age)


# ------------------------------------------------------------------------------ helpers


@cache
def gauss_legendre(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Nodes and weights of the n-point Gauss-Legendre rule on [-1, 1]."""
    nodes, weights = [], []
    for i in range(1, n + 1):
        x = math.cos(math.pi * (i - 0.25) / (n + 0.5))
        for _ in range(100):
            p0, p1 = 1.0, x
            for k in range(2, n + 1):
                p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
            dp = n * (x * p1 - p0) / (x * x - 1.0)
            step = p1 / dp
            x -= step
            if abs(step) < 1e-16:
                break
        nodes.append(x)
        weights.append(2.0 / ((1.0 - x * x) * dp * dp))
    return tuple(nodes), tuple(weights)
