"""Stall theory of block-scaled states: each element on its block's absolute grid.

The plain model (:mod:`srtrain.theory.plain`) gives every element a grid step proportional to its
own magnitude, ``ε·ln2·|s|``. A block-scaled format (FP8 E4M3, FP4 E2M1/E2M2) stores a
block of ``B`` consecutive elements of a row on one grid ``fmt·2**k``, with ``2**k`` the
smallest power of two such that the block's largest magnitude fits under the format's
largest value. An element at ``q = |s|/2**k`` (its magnitude in units of the block scale)
has the format's absolute step ``h(q)``: ``2**(e-P)`` in the binade ``[2**e, 2**(e+1))``,
``2**(min_exp-P)`` below the smallest normal. Its relative step is ``η(q) = h(q)/q``. An
element far below its block's maximum sits among the few coarse grid points near zero
(E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 times the scale), where ``η`` is large and updates stall.

The block model replaces ``ε·ln2`` by ``η(q)`` and averages the plain model's stall
probability given the state (for ``m``: given ``X``, see :mod:`srtrain.theory.plain`) over the law
of ``q``. That law comes from a stated model of the block's values:

- within a block, element ``i`` has its own gradient scale ``σ_i = σ·exp(λ·ξ_i)``,
  ``ξ_i ~ N(0, 1)`` i.i.d.; ``λ`` (``spread``) is the log-normal spread of gradient scales
  among the ``B`` elements of a block (``λ = 0``: the elements are identically distributed);
- ``m_i = σ_i·s·X_i`` with the plain model's stationary (or at-age) law, ``X_i ~ N(0, 1)``;
  ``v_i = w·σ_i²`` (its own spread, about 3% at β₂ = 0.999, is ignored, as in the plain
  model);
- the block scale is set by the largest ``|m_j|`` (or ``v_j``) over the block, the element
  itself included; the block's overall size is log-uniform against the powers of two, so
  with ``M`` the block's largest magnitude, ``2**k = M·2**φ/max_value`` with
  ``φ ~ U[0, 1)`` independent of the rest.

For ``m`` the element's ratio to its block maximum, ``a = y/max(y, M_o)`` with
``y = exp(λξ)·|X|`` and ``M_o`` the largest of the other ``B-1`` elements (CDF
``H_λ(y)**(B-1)``, ``H_λ(y) = E_ξ[2Φ(y·e^(-λξ)) - 1]``), gives ``q = a·max_value·2**-φ``, and the
NR stall condition ``|Z - sX| < T`` has ``T = s|X|·η(q)/(2(1-β))`` (SR: the tent of width
``2T``). For ``v``, ``q = exp(2λ(ξ - ξ_max))·max_value·2**-φ`` capped at ``max_value``, and
``ρ = η(q)/(2(1-β))`` replaces ``ρ̂`` in the χ²₁ forms. The expectation is a product
quadrature: Gauss-Hermite over ``ξ``, Gauss-Legendre panels over ``|X|`` and over the
quantile level of ``M_o``, midpoints over ``φ``. With ``λ = 0`` and a block of identical
``v`` values the block model of ``v`` equals the plain one (``η`` averaged over a
log-uniform octave has the plain model's mean of ``1/η``); for ``m`` it does not, because
the elements of a block differ.

Second moment under NR. The plain at-age law puts ``v`` at ``w_j = 1-β₂^j`` of its steady
value, the mean of the exact recursion, which SR keeps (it is unbiased). NR is biased: an
update with ``|z - w| < ρw`` is dropped, and in BF16 at β₂ > 1 - 2⁻⁹ (0.99805) every decrease is, so
``v`` only grows. Its mean then follows (mean field, ``v``'s own spread ignored)::

    w_{j+1} = w_j + (1-β)·E[(z - w_j)·1{|z - w_j| ≥ ρ·w_j}]
            = w_j + (1-β)·(1 - G(b) - w_j(1 - F(b)) + G(a) - w_j·F(a))

with ``a = w_j·max(0, 1-ρ)``, ``b = w_j(1+ρ)`` and F, G the χ²₁ CDF and partial mean,

which passes 1 and keeps creeping up, so NR ``v`` stalls more with age than the plain model
says even at a constant gradient scale: at β₂ = 0.999 in BF16, over ages 1600–2000, the
model's stall lies above the plain law's and within 0.015 below a simulation of the rounded
recursion (``tests/test_theory_blocks.py`` checks both). The mean field ignores ``v``'s spread
across elements, which dominates the startup of coarse formats (FP8, FP4: ``ρ`` in the tens,
so ``v`` moves by rare large jumps); there it lags ``1-β₂^j`` while simulation follows the plain
law. :func:`block_stall_at_age` therefore takes ``max(w_j, 1-β₂^j)`` for ``v`` under NR in every
format (for unscaled formats it is the only change); the steady state
(:func:`block_stall_probability`) stays at ``w = 1``, which NR ``v`` has no steady state to
replace.

Assumptions the model does not lift: the block scale is treated as fixed across the step
(it changes when the block maximum crosses a power of two), the stored value is taken to be
the full-precision state (rounding's feedback on the state's law is ignored, as in the plain
model; with NR and FP4 this overstates stalls by 0.02–0.04 against a simulation of the rounded
recursion), and gradients are zero-mean Gaussian given their scale.

The spread. ``λ`` is a property of the model and data, not of the format, and nothing here
derives it. :data:`DEFAULT_SPREAD` is fitted: ``λ_m = 0.4`` minimises the largest miss over
the FP4 ``m`` cells of the study (LLaMA-60M NR and SR, NeoX-160M SR, dense weights), chosen
after seeing that the ``λ = 0`` model (FP4 E2M1 ``m``: NR 0.314, SR 0.303) still falls short of
the measured 0.351–0.420. ``λ_v = 0``: the measured FP4 ``v`` stall (0.993–0.994) sits at the
``λ = 0`` value and rises with ``λ`` (0.997 at 0.5), so the persistent scale spread that ``v``
sees is small; the ``m`` spread is then read as per-step heavy tails of the gradient, which an
average over 1/(1-β₂) steps removes. At ``λ_m = 0.4``, block size 32: FP8 ``m`` 0.062 (NR and
SR), FP4 E2M1 ``m`` NR 0.396, SR 0.373. A measured histogram of the stored codes' exponents
relative to their block scale, per state and joint with the update size, would replace the
stated law of ``q`` and the fitted ``λ``; the kernels do not count one.

Where it misses the study (dense weights, runs without resets, tolerance 0.02): FP4 ``m`` on
LLaMA-60M, NR 0.420 measured against 0.396 and SR 0.351 against 0.373. The measured NR-SR gap
(0.069) is three times the model's (0.023), and the rounded recursion at a fixed gradient law
makes it smaller still, so no single ``λ`` fits both: the gap is not a rounding effect alone.
The FP4 NR run also trains much worse (validation loss 3.75 against 3.01), so its gradients
are not those of the SR run. Every other cell of the README's table is within 0.02.

On the grids recorded after the fit (LLaMA-60M at an 8k vocabulary on another corpus), the
model overpredicts FP4 ``m`` under SR in every run, by about 0.03, and is within 0.02 in every
other cell: ``λ_m`` depends on the model and data, and 0.4 is the first study's value
(``docs/study.md`` scores every cell; ``tests/test_theory_blocks.py`` holds them to that).
"""

from __future__ import annotations

import math
import numbers
from functools import cache

import numpy as np
import torch

from srtrain.numerics.formats import Format, get_format
from srtrain.theory.common import (
    DEFAULT_BETAS,
    MOMENTS,
    ROUNDINGS,
    check_age,
    check_beta,
    check_choice,
    gauss_legendre,
)
from srtrain.theory.plain import p_stall_at_age, rho_hat, stall_probability

DEFAULT_BLOCK_SIZE = 32
DEFAULT_SPREAD = {"m": 0.4, "v": 0.0}  # λ per moment: fitted to the study (module docstring)
_X_RANGE = 8.5  # |X| is integrated over [0, 8.5]
_X_PANELS, _X_POINTS = 6, 8
_LEVEL_PANELS, _LEVEL_POINTS = 2, 8
_HERMITE_POINTS = 8
_PHASES = 16
_SMALL_WIDTH = 1e-3
_SMALL_TENT = 0.05
_SETTLED = 1e-6  # β**age below this: m is at its steady law


def _check_block_size(block_size: int) -> int:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, numbers.Integral)
        or (block_size < 1)
    ):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    return int(block_size)


def _check_spread(spread: float) -> float:
    if (
        isinstance(spread, bool)
        or not isinstance(spread, numbers.Real)
        or not (0.0 <= spread < 5.0)
    ):
        raise ValueError(f"spread must be a number in [0, 5), got {spread!r}")
    return float(spread)


# ------------------------------------------------------------------------------- grids


def relative_step(fmt: str | Format, q: np.ndarray) -> np.ndarray:
    """η(q) = h(q)/q: the format's grid step at ``q`` (units of the block scale) over ``q``."""
    fmt = get_format(fmt)
    q = np.asarray(q, dtype=np.float64)
    p = fmt.fraction_bits
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.maximum(q, 2.0**fmt.min_exp)))
        return 2.0 ** (e - p) / q


def _panels(lo: float, hi: float, panels: int, points: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of composite Gauss-Legendre on [lo, hi]."""
    x, w = (np.array(a) for a in gauss_legendre(points))
    edges = np.linspace(lo, hi, panels + 1)
    half, mid = 0.5 * np.diff(edges), 0.5 * (edges[1:] + edges[:-1])
    return (mid[:, None] + half[:, None] * x).ravel(), (half[:, None] * w).ravel()


@cache
def _hermite(spread: float) -> tuple[np.ndarray, np.ndarray]:
    """ξ nodes and probability weights (one node at 0 when the spread is zero)."""
    if spread == 0.0:
        return np.zeros(1), np.ones(1)
    x, w = np.polynomial.hermite_e.hermegauss(_HERMITE_POINTS)
    return x, w / w.sum()


def _normal_quantile(p: np.ndarray) -> np.ndarray:
    t = torch.as_tensor(np.clip(p, 1e-300, 1.0 - 1e-16), dtype=torch.float64)
    return torch.special.ndtri(t).numpy()


@cache
def _largest_other(block_size: int, spread: float, moment: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantile nodes of the largest of the other ``B-1`` elements, with weights.

    ``m``: largest ``exp(λξ)|X|``; ``v``: largest ``ξ``. Empty arrays for a block of one.
    """
    if block_size == 1:
        return np.zeros(0), np.zeros(0)
    level, weight = _panels(0.0, 1.0, _LEVEL_PANELS, _LEVEL_POINTS)
    one = level ** (1.0 / (block_size - 1))  # CDF value of one element at the max's quantile
    if moment == "v":
        return _normal_quantile(one), weight
    if spread == 0.0:
        return _normal_quantile(0.5 * (1.0 + one)), weight
    xi, xw = _hermite(spread)
    grid = np.exp(np.linspace(math.log(1e-6), math.log(60.0 * math.exp(4.0 * spread)), 4000))
    z = torch.as_tensor(grid[:, None] * np.exp(-spread * xi)[None, :], dtype=torch.float64)
    cdf = ((2.0 * torch.special.ndtr(z) - 1.0).numpy() * xw).sum(axis=1)
    return np.interp(one, cdf, grid), weight


# ------------------------------------------------------------------ conditional stalls


def _ndtr(x: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(x)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _stop_loss(x: torch.Tensor) -> torch.Tensor:
    return x * _ndtr(x) + _normal_pdf(x)


def _normal_stall(delta: torch.Tensor, t: torch.Tensor, rounding: str) -> torch.Tensor:
    """NR: P(|D| < t); SR: E[max(0, 1 - |D|/(2t))]; D ~ N(delta, 1)."""
    if rounding == "nearest":
        return _ndtr(t - delta) - _ndtr(-t - delta)
    width = 2.0 * t
    small = width < _SMALL_WIDTH
    safe = torch.where(small, torch.ones_like(width), width)
    closed = (_stop_loss(delta + safe) - 2.0 * _stop_loss(delta) + _stop_loss(delta - safe)) / safe
    series = width * _normal_pdf(delta) * (1.0 + width * width * (delta * delta - 1.0) / 12.0)
    return torch.where(small, series, closed)


def _chi2_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(torch.sqrt(0.5 * torch.clamp(x, min=0.0)))


def _chi2_partial_mean(x: torch.Tensor) -> torch.Tensor:
    x = torch.clamp(x, min=0.0)
    return _chi2_cdf(x) - torch.sqrt(2.0 * x / math.pi) * torch.exp(-0.5 * x)


def _v_nearest(rho: torch.Tensor, w: float) -> torch.Tensor:
    return _chi2_cdf(w * (1.0 + rho)) - _chi2_cdf(w * torch.clamp(1.0 - rho, min=0.0))


def _v_stochastic(rho: torch.Tensor, w: float) -> torch.Tensor:
    c = 2.0 * rho
    F, G = _chi2_cdf, _chi2_partial_mean
    cs = torch.clamp(c, min=_SMALL_TENT)
    a, b, cw = w * torch.clamp(1.0 - cs, min=0.0), w * (1.0 + cs), cs * w
    closed = (
        (1.0 - 1.0 / cs) * (F(w * torch.ones_like(cs)) - F(a))
        + (G(w + 0 * cs) - G(a)) / cw
        + (1.0 + 1.0 / cs) * (F(b) - F(w + 0 * cs))
        - (G(b) - G(w + 0 * cs)) / cw
    )
    x, wt = (torch.tensor(a, dtype=torch.float64) for a in gauss_legendre(6))
    t = 0.5 * c[..., None] * (1.0 + x)  # thresholds in [0, c]
    mean = 0.5 * (_v_nearest(t, w) * wt).sum(dim=-1)
    return torch.where(c < _SMALL_TENT, mean, closed)


# --------------------------------------------------------------------------- the model


def _phases(fmt: Format) -> np.ndarray:
    """``max_value·2**-φ`` at the midpoints of ``φ ∈ [0, 1)``."""
    return fmt.max_value * 2.0 ** -((np.arange(_PHASES) + 0.5) / _PHASES)


def _m_block(
    fmt: Format, beta: float, rounding: str, std: float, block_size: int, spread: float
) -> float:
    """Stall probability of a block-scaled ``m`` whose stationary std (units of σ_i) is ``std``."""
    if std == 0.0:
        return 0.0
    x, xw = _panels(0.0, _X_RANGE, _X_PANELS, _X_POINTS)
    xw = xw * 2.0 * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)  # half-normal density
    xi, xiw = _hermite(spread)
    other, ow = _largest_other(block_size, spread, "m")
    y = np.exp(spread * xi)[:, None] * x[None, :]  # [ξ, X]
    if other.size:
        a = y[..., None] / np.maximum(y[..., None], other)  # [ξ, X, M_o]
        weights = xiw[:, None, None] * xw[None, :, None] * ow[None, None, :]
    else:
        a = np.ones_like(y)[..., None]
        weights = xiw[:, None, None] * xw[None, :, None]
    q = a[..., None] * _phases(fmt)  # [ξ, X, M_o, φ]
    eta = torch.as_tensor(relative_step(fmt, q), dtype=torch.float64)
    xs = torch.as_tensor(std * x, dtype=torch.float64)[None, :, None, None]
    stall = _normal_stall(xs, xs * eta / (2.0 * (1.0 - beta)), rounding).mean(dim=-1)
    return float((stall.numpy() * weights).sum())


@cache
def _v_rho(
    fmt_name: str, beta: float, block_size: int, spread: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes ρ of a ``v`` element's half-step ratio and their probability weights."""
    fmt = get_format(fmt_name)
    if not fmt.scaled:
        return (
            torch.tensor([rho_hat(fmt.eps, beta)], dtype=torch.float64),
            torch.ones(1, dtype=torch.float64),
        )
    xi, xiw = _hermite(spread)
    other, ow = _largest_other(block_size, spread, "v")
    if spread == 0.0 or not other.size:
        ratio, weights = np.ones((1, 1)), np.ones((1, 1))
    else:
        ratio = np.exp(2.0 * spread * np.minimum(xi[:, None] - other[None, :], 0.0))
        weights = xiw[:, None] * ow[None, :]
    q = ratio[..., None] * _phases(fmt)
    weights = np.broadcast_to(weights[..., None] / _PHASES, q.shape)
    rho = relative_step(fmt, q) / (2.0 * (1.0 - beta))
    return (
        torch.as_tensor(rho.ravel(), dtype=torch.float64),
        torch.as_tensor(weights.ravel().copy(), dtype=torch.float64),
    )


def _v_stall(
    rho: torch.Tensor, weights: torch.Tensor, w: torch.Tensor | float, rounding: str
) -> float:
    fn = _v_nearest if rounding == "nearest" else _v_stochastic
    return float((fn(rho, w) * weights).sum())


class _NearestDrift:
    """Mean ``w_j`` of an NR ``v`` at age ``j``, per ρ node (module docstring), grown on demand."""

    def __init__(self, rho: torch.Tensor, beta: float) -> None:
        self.rho, self.beta = rho, beta
        self.ages = [torch.zeros_like(rho)]

    def at(self, age: int) -> torch.Tensor:
        while len(self.ages) <= age:
            w = self.ages[-1]
            lo, hi = w * torch.clamp(1.0 - self.rho, min=0.0), w * (1.0 + self.rho)
            taken = (
                1.0
                - _chi2_partial_mean(hi)
                - w * (1.0 - _chi2_cdf(hi))
                + _chi2_partial_mean(lo)
                - w * _chi2_cdf(lo)
            )
            self.ages.append(w + (1.0 - self.beta) * taken)
        return self.ages[age]


@cache
def _drift(fmt_name: str, beta: float, block_size: int, spread: float) -> _NearestDrift:
    return _NearestDrift(_v_rho(fmt_name, beta, block_size, spread)[0], beta)


@cache
def _block_stall(
    fmt_name: str,
    beta: float,
    rounding: str,
    moment: str,
    age: int | None,
    block_size: int,
    spread: float,
) -> float:
    fmt = get_format(fmt_name)
    if age == 0:
        return 0.0
    decay = 0.0 if age is None else beta**age
    if moment == "m":
        if not fmt.scaled:
            return (
                stall_probability(fmt, beta, rounding, "m")
                if age is None
                else p_stall_at_age(fmt.eps, beta, age, rounding, "m")
            )
        std = math.sqrt((1.0 - beta) / (1.0 + beta) * (1.0 - decay * decay))
        return _m_block(fmt, beta, rounding, std, block_size, spread)
    if not fmt.scaled and (age is None or rounding == "stochastic"):
        return (
            stall_probability(fmt, beta, rounding, "v")
            if age is None
            else p_stall_at_age(fmt.eps, beta, age, rounding, "v")
        )
    rho, weights = _v_rho(fmt_name, beta, block_size, spread)
    if age is not None and rounding == "nearest":
        w = torch.clamp(_drift(fmt_name, beta, block_size, spread).at(age), min=1.0 - decay)
        return _v_stall(rho, weights, w, rounding)
    return _v_stall(rho, weights, 1.0 - decay, rounding)


def _checked(
    fmt: str | Format,
    beta: float | None,
    rounding: str,
    moment: str,
    block_size: int,
    spread: float | None,
) -> tuple[Format, float, int, float]:
    fmt = get_format(fmt)
    check_choice("moment", moment, MOMENTS)
    check_choice("rounding", rounding, ROUNDINGS)
    beta = DEFAULT_BETAS[moment] if beta is None else check_beta(beta)
    spread = DEFAULT_SPREAD[moment] if spread is None else _check_spread(spread)
    return fmt, beta, _check_block_size(block_size), spread


def block_stall_probability(
    fmt: str | Format,
    beta: float | None,
    rounding: str,
    moment: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    spread: float | None = None,
) -> float:
    """Steady-state stall probability of ``m`` or ``v`` in ``fmt`` under the block model.

    ``beta`` None: 0.9 for m, 0.999 for v; ``spread`` None: :data:`DEFAULT_SPREAD`. Formats
    without block scales (fp32, bf16) get the plain model's value.
    """
    fmt, beta, block_size, spread = _checked(fmt, beta, rounding, moment, block_size, spread)
    if not fmt.scaled:
        return stall_probability(fmt, beta, rounding, moment)
    return _block_stall(fmt.name, beta, rounding, moment, None, block_size, spread)


def block_stall_at_age(
    fmt: str | Format,
    beta: float | None,
    age: int,
    rounding: str,
    moment: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    spread: float | None = None,
) -> float:
    """Stall probability under the block model of the update applied at ``age`` after a reset.

    ``m``, and ``v`` under SR: the block model at the plain model's at-age state law. ``v``
    under NR (every format): the state's mean is the larger of :class:`_NearestDrift` (NR's
    biased recursion) and ``1-β**age``.
    """
    fmt, beta, block_size, spread = _checked(fmt, beta, rounding, moment, block_size, spread)
    age = check_age(age)
    if moment == "m" and beta**age < _SETTLED:
        return _block_stall(fmt.name, beta, rounding, moment, None, block_size, spread)
    return _block_stall(fmt.name, beta, rounding, moment, age, block_size, spread)
