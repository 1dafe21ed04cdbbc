"""Stall theory: published numbers, closed forms against Monte Carlo, simulation, reset periods."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from srtrain.numerics.formats import FORMATS, get_format
from srtrain.theory.__main__ import main
from srtrain.theory.plain import (
    DEFAULT_TOLERANCE,
    LN2,
    p_stall_at_age,
    p_stall_m_nearest,
    p_stall_m_stochastic,
    p_stall_nearest,
    p_stall_stochastic,
    reset_period,
    rho_hat,
    stall_probability,
)

SAMPLES = 2_000_000
CHI2_PDF_AT_1 = math.exp(-0.5) / math.sqrt(2 * math.pi)


def assert_mean(samples: np.ndarray, expected: float, sigmas: float = 5.0) -> None:
    """The sample mean equals ``expected`` within ``sigmas`` standard errors."""
    se = max(samples.std() / math.sqrt(samples.size), 1.0 / samples.size)
    assert abs(samples.mean() - expected) < sigmas * se, (samples.mean(), expected, se)


def tent(distance: np.ndarray, width: np.ndarray) -> np.ndarray:
    """SR stall probability: max(0, 1 - distance/width)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.clip(1.0 - np.abs(distance) / width, 0.0, None)


# ----------------------------------------------------------------------- published values


@pytest.mark.parametrize(
    ("fmt", "rounding", "expected"),
    [
        ("bf16", "nearest", 0.946),
        ("fp8", "nearest", 1.000),
        ("fp4_e2m2", "nearest", 1.000),
        ("bf16", "stochastic", 0.825),
        ("fp8", "stochastic", 0.989),
        ("fp4_e2m2", "stochastic", 0.994),
    ],
)
def test_published_stall_probabilities_of_v(fmt: str, rounding: str, expected: float) -> None:
    p = stall_probability(fmt, 0.999, rounding, "v")
    assert round(p, 3) == expected
    direct = p_stall_nearest if rounding == "nearest" else p_stall_stochastic
    assert direct(FORMATS[fmt].eps, 0.999) == p


def test_rho_hat_and_format_lookup() -> None:
    assert rho_hat(2.0**-7, 0.999) == pytest.approx(2.0**-7 * LN2 / 0.002, rel=1e-12)
    assert rho_hat(2.0**-7, 0.999) == pytest.approx(2.7076, abs=1e-4)
    by_alias = stall_probability("bfloat16", 0.999, "stochastic", "v")
    by_format = stall_probability(get_format("bf16"), 0.999, "stochastic", "v")
    assert by_alias == by_format == p_stall_stochastic(2.0**-7, 0.999)
    assert stall_probability("bf16", np.float64(0.999), "stochastic", "v") == by_format
    assert p_stall_at_age(2.0**-7, 0.999, np.int64(5), "nearest") > 0.0


def test_fp32_states_essentially_never_stall() -> None:
    for moment, beta in (("v", 0.999), ("v", 0.9999), ("m", 0.9), ("m", 0.99)):
        for rounding in ("nearest", "stochastic"):
            p = stall_probability("fp32", beta, rounding, moment)
            assert 0.0 < p < 1e-3


# ------------------------------------------------------------- closed forms vs Monte Carlo

# (eps, beta): ρ̂ from 0.008 (quadrature branch of SR) through 0.35 (a > 0) to 87.
V_CASES = [
    (2.0**-12, 0.99),
    (2.0**-10, 0.999),
    (2.0**-3, 0.5),
    (2.0**-7, 0.99),
    (2.0**-7, 0.999),
    (2.0**-2, 0.95),
    (2.0**-1, 0.9),
]


@pytest.mark.parametrize(("eps", "beta"), V_CASES)
def test_v_closed_forms_match_their_expectations(eps: float, beta: float) -> None:
    rng = np.random.default_rng(1234)
    z = rng.standard_normal(SAMPLES) ** 2
    rho = rho_hat(eps, beta)
    assert_mean((np.abs(z - 1.0) < rho).astype(float), p_stall_nearest(eps, beta))
    assert_mean(tent(z - 1.0, 2.0 * rho), p_stall_stochastic(eps, beta))


@pytest.mark.parametrize(("eps", "beta", "age"), [(2.0**-7, 0.999, 40), (2.0**-3, 0.999, 7)])
def test_v_at_age_matches_its_expectation(eps: float, beta: float, age: int) -> None:
    rng = np.random.default_rng(99)
    z = rng.standard_normal(SAMPLES) ** 2
    w, rho = 1.0 - beta**age, rho_hat(eps, beta)
    nearest = (np.abs(z - w) < rho * w).astype(float)
    assert_mean(nearest, p_stall_at_age(eps, beta, age, "nearest"))
    assert_mean(tent(z - w, 2.0 * rho * w), p_stall_at_age(eps, beta, age, "stochastic"))


def m_samples(
    eps: float, beta: float, snr: float, age: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """NR stall indicators and SR stall probabilities of m under the model, by sampling."""
    rng = np.random.default_rng(seed)
    x, z = rng.standard_normal(SAMPLES), rng.standard_normal(SAMPLES)
    decay = 0.0 if age is None else beta**age
    s = math.sqrt((1 - beta) / (1 + beta) * (1 - decay**2))
    m = snr * (1 - decay) + s * x
    d = snr * decay + z - s * x
    rho = rho_hat(eps, beta)
    return (np.abs(d) < rho * np.abs(m)).astype(float), tent(d, 2.0 * rho * np.abs(m))


@pytest.mark.parametrize(
    ("eps", "beta", "snr"),
    [
        (2.0**-7, 0.9, 0.0),
        (2.0**-3, 0.9, 0.0),
        (2.0**-1, 0.9, 0.0),
        (2.0**-1, 0.5, 0.0),
        (2.0**-2, 0.999, 0.0),
        (2.0**-7, 0.9, 0.5),
        (2.0**-3, 0.99, 0.3),
        (2.0**-1, 0.9, 2.0),
        (2.0**-2, 0.999, 0.2),
    ],
)
def test_m_model_matches_its_expectation(eps: float, beta: float, snr: float) -> None:
    nearest, stochastic = m_samples(eps, beta, snr, None, seed=7)
    assert_mean(nearest, p_stall_m_nearest(eps, beta, snr))
    assert_mean(stochastic, p_stall_m_stochastic(eps, beta, snr))
    assert p_stall_m_nearest(eps, beta, -snr) == p_stall_m_nearest(eps, beta, snr)


@pytest.mark.parametrize(("eps", "beta", "age"), [(2.0**-1, 0.9, 3), (2.0**-3, 0.99, 20)])
def test_m_at_age_matches_its_expectation(eps: float, beta: float, age: int) -> None:
    nearest, stochastic = m_samples(eps, beta, 0.0, age, seed=11)
    assert_mean(nearest, p_stall_at_age(eps, beta, age, "nearest", "m"))
    assert_mean(stochastic, p_stall_at_age(eps, beta, age, "stochastic", "m"))


def test_m_quadrature_agrees_with_the_zero_mean_closed_forms() -> None:
    # A vanishing signal takes the quadrature path; it must reproduce the closed forms.
    for eps in (2.0**-23, 2.0**-7, 2.0**-3, 2.0**-1):
        for beta in (0.5, 0.9, 0.999, 0.99999):
            for fn in (p_stall_m_nearest, p_stall_m_stochastic):
                assert fn(eps, beta, 1e-13) == pytest.approx(fn(eps, beta), rel=1e-9)


def test_small_rho_limits_and_branch_continuity() -> None:
    eps, beta = 2.0**-23, 0.999
    rho = rho_hat(eps, beta)
    for fn in (p_stall_nearest, p_stall_stochastic):
        assert fn(eps, beta) == pytest.approx(2 * rho * CHI2_PDF_AT_1, rel=1e-6)
    s = math.sqrt((1 - 0.9) / (1 + 0.9))
    limit_m = 2 * s * rho_hat(eps, 0.9) / (math.pi * (1 + s * s))
    for fn in (p_stall_m_nearest, p_stall_m_stochastic):
        assert fn(eps, 0.9) == pytest.approx(limit_m, rel=1e-6)
    # SR switches from its closed form to quadrature at 2ρ̂ = 0.05: no jump there.
    for beta in (0.9, 0.99):
        switch = 0.05 * (1 - beta) / LN2
        for fn in (p_stall_stochastic, p_stall_m_stochastic):
            below, above = fn(switch * (1 - 1e-7), beta), fn(switch * (1 + 1e-7), beta)
            assert abs(above - below) < 1e-6 * below


# ----------------------------------------------------------------- rounded-grid simulation


def round_to_grid(x: np.ndarray, bits: int, rounding: str, rng: np.random.Generator) -> np.ndarray:
    """Round to a float grid with ``bits`` fraction bits and unbounded exponent."""
    _, exp = np.frexp(x)
    step = np.ldexp(1.0, exp - 1 - bits)
    steps = x / step
    if rounding == "nearest":
        return np.rint(steps) * step
    low = np.floor(steps)
    return (low + (rng.random(x.shape) < steps - low)) * step


def simulated_stalls(
    bits: int, beta: float, rounding: str, updates: int, chains: int, square: bool, snr: float
) -> np.ndarray:
    """Stall indicators (updates × chains) of s ← round(β·s + (1-β)·x) from s = 0."""
    rng = np.random.default_rng(2024)
    state, stalls = np.zeros(chains), np.empty((updates, chains))
    for j in range(updates):
        g = snr + rng.standard_normal(chains)
        new = round_to_grid(
            beta * state + (1 - beta) * (g * g if square else g), bits, rounding, rng
        )
        stalls[j] = new == state
        state = new
    return stalls


@pytest.mark.parametrize(
    ("bits", "snr", "rounding"),
    [
        (7, 0.5, "nearest"),
        (3, 0.0, "nearest"),
        (3, 0.0, "stochastic"),
        (2, 0.5, "stochastic"),
        (1, 0.0, "stochastic"),
    ],
)
def test_m_model_matches_simulated_rounded_recursion(bits: int, snr: float, rounding: str) -> None:
    beta, burn_in = 0.9, 80
    stalls = simulated_stalls(bits, beta, rounding, burn_in + 200, 20_000, False, snr)
    per_chain = stalls[burn_in:].mean(axis=0)
    fn = p_stall_m_nearest if rounding == "nearest" else p_stall_m_stochastic
    model = fn(2.0**-bits, beta, snr)
    se = per_chain.std() / math.sqrt(per_chain.size)
    # The geometric-grid model is within 5% of the float grid's stall rate here.
    assert abs(per_chain.mean() - model) < 0.05 * model + 4 * se


@pytest.mark.parametrize(
    ("bits", "rounding"), [(7, "stochastic"), (3, "stochastic"), (2, "nearest")]
)
def test_v_startup_matches_simulated_rounded_recursion(bits: int, rounding: str) -> None:
    beta, updates = 0.999, 300
    stalls = simulated_stalls(bits, beta, rounding, updates, 10_000, True, 0.0)
    simulated = stalls.sum(axis=0)
    model = sum(p_stall_at_age(2.0**-bits, beta, age, rounding) for age in range(updates))
    se = simulated.std() / math.sqrt(simulated.size)
    assert stalls[0].sum() == 0.0
    assert abs(simulated.mean() - model) < 0.03 * model + 4 * se


# ------------------------------------------------------------------------------ monotonicity


@pytest.mark.parametrize("moment", ["m", "v"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_stalls_grow_with_eps_and_beta(moment: str, rounding: str) -> None:
    names = ["fp32", "bf16", "fp8", "fp4_e2m2", "fp4_e2m1"]
    betas = [0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9999]
    table = np.array([[stall_probability(n, b, rounding, moment) for b in betas] for n in names])
    assert np.all(np.diff(table, axis=0) >= -1e-12)
    assert np.all(np.diff(table, axis=1) >= -1e-12)
    assert np.all((table >= 0) & (table <= 1))


@pytest.mark.parametrize(("moment", "beta"), [("v", 0.999), ("m", 0.9)])
def test_stalls_climb_with_age_to_the_steady_state(moment: str, beta: float) -> None:
    for name in ("bf16", "fp8", "fp4_e2m2"):
        eps = FORMATS[name].eps
        for rounding in ("nearest", "stochastic"):
            ages = [p_stall_at_age(eps, beta, a, rounding, moment) for a in range(0, 3000, 50)]
            assert ages[0] == 0.0
            assert np.all(np.diff(ages) >= -1e-12)
            steady = stall_probability(name, beta, rounding, moment)
            late = p_stall_at_age(eps, beta, 40_000, rounding, moment)
            assert late == pytest.approx(steady, rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- reset periods


def test_reset_periods_order_and_neighbourhood_of_published_runs() -> None:
    published = {"bf16": 1000, "fp8": 300, "fp4_e2m2": 200}
    for rounding in ("nearest", "stochastic"):
        periods = {n: reset_period(n, 0.999, rounding) for n in published}
        assert periods["bf16"] > periods["fp8"] > periods["fp4_e2m2"]
        for name, period in periods.items():
            assert published[name] / 3 < period < published[name] * 1.5
    documented = {"bf16": 409, "fp8": 239, "fp4_e2m2": 223}
    assert {n: reset_period(n) for n in documented} == documented


def test_reset_period_is_where_expected_stalls_reach_the_tolerance() -> None:
    eps, tolerance = FORMATS["fp8"].eps, 150.0
    period = reset_period("fp8", 0.999, "stochastic", "v", tolerance)
    stalled = np.cumsum([p_stall_at_age(eps, 0.999, a, "stochastic") for a in range(period)])
    assert stalled[-1] >= tolerance > stalled[-2]


def test_reset_periods_for_m_and_unstalled_formats() -> None:
    assert reset_period("fp8", moment="m") == reset_period("fp8", 0.9, "stochastic", "m")
    for name in ("bf16", "fp8", "fp4_e2m1", "fp4_e2m2"):
        assert reset_period(name, 0.9, "stochastic", "m") > reset_period(name, 0.999)
    m_periods = [reset_period(n, 0.9, "stochastic", "m") for n in ("fp4_e2m1", "fp4_e2m2", "fp8")]
    assert m_periods == sorted(m_periods)
    assert reset_period("fp32") > 10**6
    assert reset_period("fp32", 0.9, "nearest", "m") > 10**8
    # Past the startup window each step adds the steady stall probability.
    long = reset_period("bf16", tolerance=100 * DEFAULT_TOLERANCE)
    steady = stall_probability("bf16", 0.999, "stochastic", "v")
    assert long == pytest.approx(100 * DEFAULT_TOLERANCE / steady, rel=0.05)


# --------------------------------------------------------------------------------------- CLI


def test_cli_prints_every_format_and_highlights_the_selected_one(capsys) -> None:
    assert main(["--format", "fp8", "--beta1", "0.9", "--beta2", "0.999"]) == 0
    out = capsys.readouterr().out
    for name in FORMATS:
        assert name in out
    assert "* fp8" in out
    assert "0.946" in out and "0.825" in out and "0.994" in out
    assert "reset v every 239 steps" in out


def test_cli_rejects_bad_values(capsys) -> None:
    assert main(["--format", "fp16"]) == 2
    assert "'fp16'" in capsys.readouterr().err
    assert main(["--beta2", "1.0"]) == 2
    assert "beta" in capsys.readouterr().err
    assert main(["--tolerance", "0"]) == 2
    assert "tolerance" in capsys.readouterr().err


@pytest.mark.slow
def test_module_runs_as_a_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "srtrain.theory", "--format", "fp4_e2m2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "* fp4_e2m2" in result.stdout


# ------------------------------------------------------------------------------------ errors


def test_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="fp16"):
        stall_probability("fp16", 0.999, "nearest", "v")
    with pytest.raises(ValueError, match="rounding 'round'"):
        stall_probability("bf16", 0.999, "round", "v")
    with pytest.raises(ValueError, match="moment 'w'"):
        stall_probability("bf16", 0.999, "nearest", "w")
    for beta in (0.0, 1.0, -0.5, 1.5, math.nan, True, "0.9"):
        with pytest.raises(ValueError, match="beta must be a number in"):
            stall_probability("bf16", beta, "nearest", "v")
    with pytest.raises(ValueError, match="eps"):
        rho_hat(0.0, 0.9)
    with pytest.raises(ValueError, match="age"):
        p_stall_at_age(2.0**-7, 0.999, -1, "nearest")
    with pytest.raises(ValueError, match="snr"):
        p_stall_m_nearest(2.0**-7, 0.9, math.nan)
    for tolerance in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="tolerance"):
            reset_period("bf16", tolerance=tolerance)
    with pytest.raises(ValueError, match="moment 'x'"):
        reset_period("bf16", moment="x")
