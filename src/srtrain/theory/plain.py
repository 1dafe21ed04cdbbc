"""Stall theory of low-precision Adam states: ρ̂, stall probabilities, startup window, reset periods.

A state ``s`` (Adam's ``m`` or ``v``) is rewritten every step as ``round(β·s + (1-β)·x)``,
i.e. ``s + Δ`` with ``Δ = (1-β)(x - s)``. The update *stalls* when the stored value does
not change. Nearest rounding (NR) stalls when ``|Δ|`` is below half the grid step; stochastic
rounding (SR) from a grid point stalls with probability ``max(0, 1 - |Δ|/step)``.

Grid model. A format with ``P`` fraction bits has ``2**P`` steps per binade, so its grid is,
averaged over a binade, geometric with log-step ``ε·ln2`` (``ε = 2**-P``): the step at a value
``s`` is taken to be ``ε·ln2·|s|``. This is the same as using the mean of a log-uniformly
placed value in ``[2**e, 2**(e+1))``, which is ``2**e/ln2``; it is the source of the ln2 in::

    ρ̂ = ε·ln2 / (2(1-β))

and with it NR stalls iff ``|x - s| < ρ̂·|s|`` and SR stalls with probability
``max(0, 1 - |x - s|/(2ρ̂·|s|))``. Because that tent is the average of the NR indicator over
thresholds ``t`` in ``[0, 2ρ̂]``, P_SR(ρ̂) is the mean of P_NR(t) over ``t ∈ [0, 2ρ̂]``.
The model ignores subnormals, saturation, and a block scale's coarse grid for elements far
below the block's maximum; power-of-two block scales themselves leave ``ε`` unchanged. This is
the *plain* model; :mod:`srtrain.theory.blocks` extends it to block-scaled formats (the *block*
model, which the trainer's predictions and the study use) and keeps this one for comparison.

Second moment ``v`` (``x = g²``, ``g ~ N(0, σ²)``, so ``x = σ²z`` with ``z ~ χ²₁``), with
the state at its typical value ``w·σ²`` (``w = 1`` at steady state). NR stalls iff
``|z - w| < ρ̂w``; SR stalls with probability ``max(0, 1 - |z - w|/(2ρ̂w))``. With the χ²₁ CDF
``F(x) = erf(√(x/2))`` and ``G(x) = ∫₀ˣ z dF = F(x) - √(2x/π)·e^(-x/2)``, splitting the tent at
``z = w`` (``c = 2ρ̂``, ``a = w·max(0, 1-c)``, ``b = w(1+c)``)::

    P_NR = F(w(1+ρ̂)) - F(w·max(0, 1-ρ̂))
    P_SR = (1-1/c)(F(w)-F(a)) + (G(w)-G(a))/(cw) + (1+1/c)(F(b)-F(w)) - (G(b)-G(w))/(cw)

At β₂ = 0.999 this gives NR 0.946 / 1.000 / 1.000 and SR 0.825 / 0.989 / 0.994 for
BF16 / FP8 / FP4 (E2M2). For ``c < 0.05`` the SR form cancels badly and the mean over
thresholds is integrated by Gauss-Legendre instead (FP32 gives ≈ 2ρ̂·f(1), f the χ²₁ density).

First moment ``m`` (``x = g``, ``g ~ N(μ, σ²)`` i.i.d., ``r = μ/σ`` the gradient's
signal-to-noise ratio; units of σ below). Assumptions: ``m`` follows its full-precision
stationary law ``m = r + s·X``, ``s² = (1-β₁)/(1+β₁)``, ``X ~ N(0,1)`` (rounding's feedback on
that law is ignored: exact when stalls are rare, approximate otherwise), and sits on a grid
point whose step is ``ε·ln2·|m|`` on both sides. The new gradient ``g = r + Z`` is independent
of ``m``, so ``g - m = Z - s·X``: correlated with ``m`` through ``X``. NR stalls iff
``|Z - sX| < ρ̂·|r + sX|``. For ``r = 0`` that region is the double wedge between the lines
``Z = s(1-ρ̂)X`` and ``Z = s(1+ρ̂)X``; a standard bivariate normal gives a wedge the mass
angle/π, so with ``A(u) = u·atan(u) - ½·ln(1+u²)`` (``A' = atan``) and ``c = 2ρ̂``::

    P_NR(m) = atan2(2sρ̂, 1 + s²(1-ρ̂²)) / π
    P_SR(m) = (A(s(1+c)) + A(s(1-c)) - 2A(s)) / (π·c·s)

(the SR form is the NR form averaged over thresholds; small ``c`` uses quadrature). For
``r ≠ 0`` the stall probability given ``X`` is closed (normal CDF for NR; for SR the second
difference of ``R(x) = xΦ(x) + φ(x)``, the normal's stop-loss transform) and the average over
``X`` is a composite Gauss-Legendre rule split at ``m = 0``. At β₁ = 0.9, r = 0, ``m`` stalls
rarely in BF16 (0.4%), sometimes in FP8 (6%) and often in FP4 E2M1 (23% NR, 22% SR). Against
a simulation of the rounded recursion on a float grid the model is within about 5% while
stalls are rare or rounding is SR; with NR and heavy stalling (say above 30%) it overstates
them by up to about 20%, because stuck states no longer follow the full-precision law.

Startup after a reset. A state reset to zero at age 0 has, after ``j`` updates, mean
``(1-β^j)`` of its steady value: ``v`` is at ``w_j = 1-β₂^j`` (its spread is ignored), and
``m = r(1-β₁^j) + s√(1-β₁^(2j))·X`` with ``g - m = rβ₁^j + Z - s√(1-β₁^(2j))·X``. The stall
probability of the update applied at age ``j`` follows from the same formulas
(:func:`p_stall_at_age`): zero at age 0, since a zero state never stalls, and rising towards
the steady value as the state grows and the updates shrink against its grid. Simulation of
the rounded recursion in BF16/FP8/FP4 agrees within a few per cent of the stall fraction.

Reset period. Staleness is measured by the expected number of stalled updates since the
reset, ``S(J) = Σ_{j<J} p_j``: each stalled update is a sample the state did not take in
(NR) or took in only as rounding noise (SR). The reset period is the first ``J`` with
``S(J) ≥ T``; past the startup window ``S`` grows by ``p_∞`` per step, so
``J ≈ T/p_∞ + (startup lag)``. The default ``T = 200`` stalled updates, a fifth of β₂ = 0.999's
memory ``1/(1-β₂)``, gives at β₂ = 0.999 with SR: BF16 409, FP8 239, FP4 (E2M2) 223 steps
(NR: 378, 224, 213). Against the periods that worked in published runs (about 1000, 300 and
200 steps) the order BF16 > FP8 > FP4 holds and FP8 and FP4 land within 25%, but BF16 comes
out about 2.5 times shorter than published and FP8 and FP4 come out close together: in this
picture the slow BF16 startup (its ``ρ̂ = 2.7`` needs ``w_j`` near 1, i.e. about 1/(1-β₂) steps,
to stall fully) is the only thing that separates it, while FP8 and FP4 stall almost fully
within tens of steps. No single ``T`` fits all three; take the rule as the right order of
magnitude, not a fit. Formats whose states barely stall get very long periods (FP32 ``v``
about 10^7 steps; BF16 ``m`` at β₁ = 0.9 about 5·10^4), which means: do not reset. For
``m`` at β₁ = 0.9 the SR periods are FP8 3348, FP4 E2M1 898, FP4 E2M2 1700 steps.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable

from srtrain.numerics.formats import Format, get_format
from srtrain.theory.common import (
    DEFAULT_BETAS,
    MOMENTS,
    ROUNDINGS,
    check_age,
    check_beta,
    check_choice,
    check_eps,
    check_snr,
    gauss_legendre,
)

DEFAULT_TOLERANCE = 200.0  # expected stalled updates since the reset

LN2 = math.log(2.0)
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SMALL_TENT = 0.05  # below this tent half-width c, SR forms use quadrature over thresholds
_SMALL_WIDTH = 1e-3  # below this tent width, the normal-tent second difference uses its series
_NORMAL_RANGE = 9.0  # the standard normal is integrated over [-9, 9]
_MAX_PANELS = 4096
_SETTLED = 1e-6  # β**age below this: the state is at its steady scale


def _integrate(fn: Callable[[float], float], lo: float, hi: float, n: int) -> float:
    """∫ fn over [lo, hi] by one n-point Gauss-Legendre panel."""
    nodes, weights = gauss_legendre(n)
    half, mid = 0.5 * (hi - lo), 0.5 * (hi + lo)
    return half * sum(w * fn(mid + half * x) for x, w in zip(nodes, weights, strict=True))


def _mean_over_threshold(nearest: Callable[[float], float], c: float) -> float:
    """SR stall probability from the NR one: the mean of nearest(t) over t in [0, c] (c small)."""
    return _integrate(nearest, 0.0, c, n=6) / c


def _chi2_cdf(x: float) -> float:
    return math.erf(math.sqrt(0.5 * x)) if x > 0.0 else 0.0


def _chi2_partial_mean(x: float) -> float:
    if x <= 0.0:
        return 0.0
    return _chi2_cdf(x) - math.sqrt(2.0 * x / math.pi) * math.exp(-0.5 * x)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / _SQRT2)


def _normal_pdf(x: float) -> float:
    return _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _stop_loss(x: float) -> float:
    """R(x) = E[(D + x)+] for D ~ N(0, 1)."""
    return x * _normal_cdf(x) + _normal_pdf(x)


# ------------------------------------------------------------------------ ρ̂ and v


def rho_hat(eps: float, beta: float) -> float:
    """Half-step-to-update ratio ρ̂ = ε·ln2 / (2(1-β)) of a state with relative spacing ε."""
    return check_eps(eps) * LN2 / (2.0 * (1.0 - check_beta(beta)))


def _v_nearest(rho: float, w: float) -> float:
    return _chi2_cdf(w * (1.0 + rho)) - _chi2_cdf(w * max(0.0, 1.0 - rho))


def _v_stochastic(rho: float, w: float) -> float:
    c = 2.0 * rho
    if c < _SMALL_TENT:
        return _mean_over_threshold(lambda t: _v_nearest(t, w), c)
    a, b, cw = w * max(0.0, 1.0 - c), w * (1.0 + c), c * w
    F, G = _chi2_cdf, _chi2_partial_mean
    return (
        (1.0 - 1.0 / c) * (F(w) - F(a))
        + (G(w) - G(a)) / cw
        + (1.0 + 1.0 / c) * (F(b) - F(w))
        - (G(b) - G(w)) / cw
    )


def p_stall_nearest(eps: float, beta2: float) -> float:
    """Steady-state probability that an NR update of ``v`` stalls: P(|z-1| < ρ̂), z ~ χ²₁."""
    return _v_nearest(rho_hat(eps, beta2), 1.0)


def p_stall_stochastic(eps: float, beta2: float) -> float:
    """Steady-state probability that an SR update of ``v`` stalls: E[max(0, 1-|z-1|/(2ρ̂))]."""
    return _v_stochastic(rho_hat(eps, beta2), 1.0)


# ------------------------------------------------------------------------------------ m


def _atan_integral(u: float) -> float:
    """A(u) = ∫₀ᵘ atan = u·atan(u) - ½·ln(1+u²)."""
    return u * math.atan(u) - 0.5 * math.log1p(u * u)


def _m_nearest_centred(rho: float, s: float) -> float:
    return math.atan2(2.0 * s * rho, 1.0 + s * s * (1.0 - rho * rho)) / math.pi


def _m_stochastic_centred(rho: float, s: float) -> float:
    c = 2.0 * rho
    if c < _SMALL_TENT:
        return _mean_over_threshold(lambda t: _m_nearest_centred(t, s), c)
    A = _atan_integral
    return (A(s * (1.0 + c)) + A(s * (1.0 - c)) - 2.0 * A(s)) / (math.pi * c * s)


def _normal_tent(delta: float, width: float) -> float:
    """E[max(0, 1 - |D|/width)] for D ~ N(delta, 1)."""
    if width < _SMALL_WIDTH:
        return width * _normal_pdf(delta) * (1.0 + width * width * (delta * delta - 1.0) / 12.0)
    R = _stop_loss
    return (R(delta + width) - 2.0 * R(delta) + R(delta - width)) / width


def _m_given_x(rho: float, rounding: str, m: float, delta: float) -> float:
    """Stall probability given the state m, for an update direction D ~ N(delta, 1)."""
    if rounding == "nearest":
        h = rho * abs(m)
        return _normal_cdf(h - delta) - _normal_cdf(-h - delta)
    return _normal_tent(delta, 2.0 * rho * abs(m))


def _m_quadrature(rho: float, rounding: str, mean: float, std: float, shift: float) -> float:
    """E over X ~ N(0,1) of the stall probability of m = mean + std·X, g-m = shift + Z - std·X."""

    def integrand(x: float) -> float:
        return _normal_pdf(x) * _m_given_x(rho, rounding, mean + std * x, shift - std * x)

    kink = -mean / std
    width = min(0.5, 0.5 / (std * (2.0 * rho + 1.0)))
    cuts = sorted({-_NORMAL_RANGE, _NORMAL_RANGE, min(max(kink, -_NORMAL_RANGE), _NORMAL_RANGE)})
    total = 0.0
    for lo, hi in itertools.pairwise(cuts):
        panels = min(_MAX_PANELS, max(1, math.ceil((hi - lo) / width)))
        step = (hi - lo) / panels
        total += sum(
            _integrate(integrand, lo + k * step, lo + (k + 1) * step, n=8) for k in range(panels)
        )
    return total


def _m_stall(rho: float, beta: float, rounding: str, snr: float, age: int | None) -> float:
    """Stall probability of m at ``age`` updates after a reset (None: steady state)."""
    decay = 0.0 if age is None else beta**age
    std = math.sqrt((1.0 - beta) / (1.0 + beta) * (1.0 - decay * decay))
    if std == 0.0:
        return 0.0
    if snr == 0.0:
        centred = _m_nearest_centred if rounding == "nearest" else _m_stochastic_centred
        return centred(rho, std)
    return _m_quadrature(rho, rounding, snr * (1.0 - decay), std, snr * decay)


def p_stall_m_nearest(eps: float, beta1: float, snr: float = 0.0) -> float:
    """Steady-state probability that an NR update of ``m`` stalls, gradients N(snr·σ, σ²)."""
    return _m_stall(rho_hat(eps, beta1), beta1, "nearest", check_snr(snr), None)


def p_stall_m_stochastic(eps: float, beta1: float, snr: float = 0.0) -> float:
    """Steady-state probability that an SR update of ``m`` stalls, gradients N(snr·σ, σ²)."""
    return _m_stall(rho_hat(eps, beta1), beta1, "stochastic", check_snr(snr), None)


# --------------------------------------------------------------------------- entry points


def stall_probability(fmt: str | Format, beta: float, rounding: str, moment: str) -> float:
    """Steady-state stall probability of moment ``m`` or ``v`` stored in ``fmt`` (zero-mean g)."""
    eps = get_format(fmt).eps
    check_choice("rounding", rounding, ROUNDINGS)
    if check_choice("moment", moment, MOMENTS) == "m":
        m_fns = {"nearest": p_stall_m_nearest, "stochastic": p_stall_m_stochastic}
        return m_fns[rounding](eps, beta)
    return {"nearest": p_stall_nearest, "stochastic": p_stall_stochastic}[rounding](eps, beta)


def p_stall_at_age(eps: float, beta: float, age: int, rounding: str, moment: str = "v") -> float:
    """Stall probability of the update applied to a state ``age`` updates after a reset."""
    rho = rho_hat(eps, beta)
    age = check_age(age)
    check_choice("rounding", rounding, ROUNDINGS)
    return _stall_at_age(rho, beta, age, rounding, check_choice("moment", moment, MOMENTS))


def _stall_at_age(rho: float, beta: float, age: int, rounding: str, moment: str) -> float:
    if age == 0:
        return 0.0  # a state at zero takes any non-zero update
    if moment == "m":
        return _m_stall(rho, beta, rounding, 0.0, age)
    v_fn = _v_nearest if rounding == "nearest" else _v_stochastic
    return v_fn(rho, 1.0 - beta**age)


def reset_period(
    fmt: str | Format,
    beta: float | None = None,
    rounding: str = "stochastic",
    moment: str = "v",
    tolerance: float = DEFAULT_TOLERANCE,
) -> int:
    """Steps after a reset until ``tolerance`` stalled updates are expected (β: 0.9 m, 0.999 v)."""
    eps = get_format(fmt).eps
    check_choice("moment", moment, MOMENTS)
    beta = DEFAULT_BETAS[moment] if beta is None else check_beta(beta)
    check_choice("rounding", rounding, ROUNDINGS)
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, numbers.Real)
        or not (0.0 < tolerance < math.inf)
    ):
        raise ValueError(
            f"tolerance must be a positive number of stalled updates, got {tolerance!r}"
        )
    rho = rho_hat(eps, beta)
    stalled, age = 0.0, 0
    while beta**age >= _SETTLED:
        stalled += _stall_at_age(rho, beta, age, rounding, moment)
        age += 1
        if stalled >= tolerance:
            return int(age)
    steady = _stall_at_age(rho, beta, age, rounding, moment)
    return age + math.ceil((tolerance - stalled) / steady)
