"""Block-scaled stall model: grids, its expectation by sampling, the rounded recursion
(the real block quantizer), NR v's drift, and the study's recorded measurements."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from srtrain.numerics.formats import FORMATS, get_format
from srtrain.numerics.rounding import dequantize, quantize
from srtrain.theory import (
    DEFAULT_SPREAD,
    block_stall_at_age,
    block_stall_probability,
    p_stall_at_age,
    relative_step,
    stall_probability,
)
from srtrain.theory.blocks import _drift

from conftest import figures_module

DATA = Path(__file__).resolve().parents[1] / "docs" / "results" / "data"


def normal_cdf(x: np.ndarray) -> np.ndarray:
    return torch.special.ndtr(torch.as_tensor(x, dtype=torch.float64)).numpy()


# -------------------------------------------------------------------------------- grids


def test_relative_step_is_the_format_grid_over_the_value() -> None:
    q = np.array([0.1, 0.3, 0.75, 1.0, 1.5, 2.5, 4.5, 6.0])
    # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 — step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    expected = np.array([0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 2.0, 2.0]) / q
    assert np.allclose(relative_step("fp4_e2m1", q), expected)
    # E4M3 normal binades keep 2**-3 relative spacing at their bottom
    assert np.allclose(relative_step("fp8", np.array([1.0, 256.0])), 0.125)
    assert relative_step("fp8", np.array([2.0**-8]))[0] == pytest.approx(2.0**-9 / 2.0**-8)


@pytest.mark.parametrize("moment", ["m", "v"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_unscaled_formats_keep_the_plain_model(moment: str, rounding: str) -> None:
    beta = 0.9 if moment == "m" else 0.999
    for name in ("fp32", "bf16"):
        assert block_stall_probability(name, beta, rounding, moment) == stall_probability(
            name, beta, rounding, moment
        )
        if moment == "m" or rounding == "stochastic":
            assert block_stall_at_age(name, beta, 37, rounding, moment) == p_stall_at_age(
                get_format(name).eps, beta, 37, rounding, moment
            )


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e2m2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_v_of_identical_elements_equals_the_plain_model(fmt: str, rounding: str) -> None:
    # a block of equal v: q is log-uniform over the top octave, whose mean 1/η is the plain one
    block = block_stall_probability(fmt, 0.999, rounding, "v", 32, spread=0.0)
    assert block == pytest.approx(stall_probability(fmt, 0.999, rounding, "v"), abs=2e-4)


def test_m_stalls_more_on_block_grids_and_with_spread() -> None:
    for rounding in ("nearest", "stochastic"):
        plain = stall_probability("fp4_e2m1", 0.9, rounding, "m")
        by_spread = [
            block_stall_probability("fp4_e2m1", 0.9, rounding, "m", 32, s)
            for s in (0.0, 0.2, 0.4, 0.8)
        ]
        assert plain < by_spread[0] and all(np.diff(by_spread) > 0)
        # a larger block has a larger maximum, so its other elements sit lower on the grid
        assert (
            block_stall_probability("fp4_e2m1", 0.9, rounding, "m", 8, 0.0)
            < by_spread[0]
            < block_stall_probability("fp4_e2m1", 0.9, rounding, "m", 256, 0.0)
        )
    # FP8's 17 binades leave the block scale nearly irrelevant
    fp8 = block_stall_probability("fp8", 0.9, "stochastic", "m")
    assert abs(fp8 - stall_probability("fp8", 0.9, "stochastic", "m")) < 0.005


# ------------------------------------------------------------- the model's expectation


def sampled_m_stall(
    fmt: str,
    beta: float,
    rounding: str,
    block: int,
    spread: float,
    blocks: int,
    rng: np.random.Generator,
    std_scale: float = 1.0,
) -> np.ndarray:
    """Per-element stall probability of m drawn from the block model's stated law."""
    f = get_format(fmt)
    s = math.sqrt((1 - beta) / (1 + beta)) * std_scale
    x = rng.standard_normal((blocks, block))
    m = s * np.exp(spread * rng.standard_normal((blocks, block))) * x  # m_i = s·σ_i·X_i
    size = 2.0 ** rng.random((blocks, 1))  # log-uniform block size against powers of two
    absmax = np.abs(m * size).max(axis=1, keepdims=True)
    scale = 2.0 ** np.ceil(np.log2(absmax / f.max_value))
    q = np.abs(m * size) / scale
    t = s * np.abs(x) * relative_step(f, q) / (2 * (1 - beta))
    delta = s * np.abs(x)  # units of σ_i
    if rounding == "nearest":
        return normal_cdf(t - delta) - normal_cdf(-t - delta)
    w = 2 * t

    def stop_loss(y: np.ndarray) -> np.ndarray:
        return y * normal_cdf(y) + np.exp(-0.5 * y * y) / math.sqrt(2 * math.pi)

    return (stop_loss(delta + w) - 2 * stop_loss(delta) + stop_loss(delta - w)) / w


@pytest.mark.parametrize(
    ("fmt", "spread"), [("fp4_e2m1", 0.0), ("fp4_e2m1", 0.4), ("fp8", 0.4), ("fp4_e2m1", 1.0)]
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_m_quadrature_matches_sampling_its_law(fmt: str, spread: float, rounding: str) -> None:
    rng = np.random.default_rng(7)
    p = sampled_m_stall(fmt, 0.9, rounding, 32, spread, 20_000, rng)
    per_block = p.mean(axis=1)
    se = per_block.std() / math.sqrt(per_block.size)
    model = block_stall_probability(fmt, 0.9, rounding, "m", 32, spread)
    assert abs(per_block.mean() - model) < 5 * se + 2e-3, (per_block.mean(), model, se)


def test_m_at_age_matches_sampling_its_law() -> None:
    rng = np.random.default_rng(8)
    for age in (1, 3, 10):
        scale = math.sqrt(1 - 0.9 ** (2 * age))
        p = sampled_m_stall("fp4_e2m1", 0.9, "stochastic", 32, 0.4, 20_000, rng, scale)
        model = block_stall_at_age("fp4_e2m1", 0.9, age, "stochastic", "m", 32, 0.4)
        se = p.mean(axis=1).std() / math.sqrt(p.shape[0])
        assert abs(p.mean() - model) < 5 * se + 2e-3, (age, p.mean(), model)
    assert block_stall_at_age("fp4_e2m1", 0.9, 0, "stochastic", "m") == 0.0
    steady = block_stall_probability("fp4_e2m1", 0.9, "stochastic", "m")
    assert block_stall_at_age("fp4_e2m1", 0.9, 400, "stochastic", "m") == steady


# ------------------------------------------------------------- the rounded recursion


def simulated_block_m(
    fmt: str, rounding: str, spread: float, rows: int = 400, updates: int = 160, burn_in: int = 60
) -> float:
    """Stalled fraction of m ← round(0.9·m + 0.1·g) in the real block quantizer (blocks of 32),
    g_i ~ N(0, σ_i²) with σ_i log-normal of spread ``spread`` and fixed in time."""
    gen = torch.Generator().manual_seed(11)
    sigma = torch.exp(spread * torch.randn(rows, 32, generator=gen, dtype=torch.float64))
    zeros = torch.zeros(rows, 32)
    state = quantize(zeros, fmt, 32, "nearest")
    stalled = []
    for step in range(updates):
        g = (sigma * torch.randn(rows, 32, generator=gen, dtype=torch.float64)).float()
        old = dequantize(state)
        rand = None
        if rounding == "stochastic":
            rand = torch.randint(0, 2**32, (rows * 32,), generator=gen, dtype=torch.int64)
        state = quantize(old * 0.9 + g * 0.1, fmt, 32, rounding, rand=rand)
        if step >= burn_in:
            stalled.append((dequantize(state) == old).double().mean().item())
    return float(np.mean(stalled))


@pytest.mark.parametrize("spread", [0.0, 0.4])
def test_m_model_against_the_rounded_block_recursion(spread: float) -> None:
    """SR within 0.02; NR overstated by at most 0.045, since a stalled NR state leaves the
    full-precision law the model assumes (as in the plain model)."""
    for rounding, below, above in (("stochastic", 0.02, 0.02), ("nearest", 0.0, 0.045)):
        simulated = simulated_block_m("fp4_e2m1", rounding, spread)
        model = block_stall_probability("fp4_e2m1", 0.9, rounding, "m", 32, spread)
        plain = stall_probability("fp4_e2m1", 0.9, rounding, "m")
        assert -below <= model - simulated <= above, (rounding, model, simulated)
        assert abs(model - simulated) < abs(plain - simulated), (rounding, plain, simulated)


def test_nearest_v_drift_against_the_rounded_recursion() -> None:
    """BF16 NR v at β₂ = 0.999 only grows; its stall over ages 1600–2000 is above the plain
    at-age law and close to a simulation of the rounded recursion."""
    gen = torch.Generator().manual_seed(5)
    v, stalled = torch.zeros(8000), []
    for age in range(2000):
        g = torch.randn(8000, generator=gen)
        new = dequantize(quantize(v * 0.999 + g * g * 0.001, "bf16", 32, "nearest"))
        if age >= 1600:
            stalled.append((new == v).double().mean().item())
        v = new
    simulated = float(np.mean(stalled))
    ages = range(1600, 2000)
    model = np.mean([block_stall_at_age("bf16", 0.999, a, "nearest", "v") for a in ages])
    plain = np.mean([p_stall_at_age(2.0**-7, 0.999, a, "nearest", "v") for a in ages])
    assert plain < model < simulated and simulated - model < 0.015, (plain, model, simulated)
    # SR is unbiased: its at-age law is the plain one
    assert block_stall_at_age("bf16", 0.999, 1700, "stochastic", "v") == p_stall_at_age(
        2.0**-7, 0.999, 1700, "stochastic", "v"
    )
    # coarse formats start on the plain law (the drift's mean field lags 1-β^j there)
    assert float(_drift("fp8", 0.999, 32, 0.0).at(50).max()) < 1 - 0.999**50
    assert block_stall_at_age("fp8", 0.999, 50, "nearest", "v", 32, 0.0) == pytest.approx(
        p_stall_at_age(0.125, 0.999, 50, "nearest", "v"), abs=5e-3
    )


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="spread"):
        block_stall_probability("fp8", 0.9, "nearest", "m", 32, -0.1)
    with pytest.raises(ValueError, match="block_size"):
        block_stall_probability("fp8", 0.9, "nearest", "m", 0)
    with pytest.raises(ValueError, match="moment"):
        block_stall_probability("fp8", 0.9, "nearest", "w")
    with pytest.raises(ValueError, match="age"):
        block_stall_at_age("fp8", 0.9, -1, "nearest", "m")
    assert set(DEFAULT_SPREAD) == {"m", "v"} and set(FORMATS) >= {"fp8", "fp4_e2m1"}


# ------------------------------------------------------------- the study's measurements

# The README's stall table: dense-weight stall of runs without resets, last 20% of steps.
README_CELLS = [
    (grid, run)
    for grid, runs in (
        ("ablation", ("bf16-nr", "bf16-sr", "fp8-nr", "fp8-sr", "fp4-nr", "fp4-sr")),
        ("neox", ("bf16-nr", "bf16-sr", "fp8-nr", "fp8-sr", "fp4-sr")),
    )
    for run in runs
]
# Cells the block model misses by more than 0.02 (see srtrain.theory.blocks, "Where it
# misses"): FP4 m on LLaMA-60M, whose NR-SR gap (0.069) is three times the model's (0.023).
KNOWN_MISSES = {("ablation", "fp4-nr", "m"), ("ablation", "fp4-sr", "m")}


def recorded_runs(grid: str) -> dict[str, dict]:
    summary = json.loads((DATA / grid / "summary.json").read_text())
    return {r["name"]: r for r in summary["runs"]}


@pytest.mark.parametrize(("grid", "run"), README_CELLS)
def test_recorded_stalls_against_the_block_model(grid: str, run: str) -> None:
    entry = recorded_runs(grid)[run]
    for state in ("m", "v"):
        stall = entry["stall"][state]
        measured, predicted = stall["measured_dense"], stall["predicted_at_age"]
        beta = 0.9 if state == "m" else 0.999
        # the recorded predictions are the current model's
        assert stall["predicted_steady"] == pytest.approx(
            block_stall_probability(
                stall["format"], beta, stall["rounding"], state, stall["block_size"]
            ),
            abs=1e-9,
        )
        assert stall["predicted_plain_steady"] == pytest.approx(
            stall_probability(stall["format"], beta, stall["rounding"], state), abs=1e-12
        )
        miss = abs(measured - predicted)
        if (grid, run, state) in KNOWN_MISSES:
            assert 0.02 < miss < 0.03, (state, measured, predicted)
            # the block model still closes most of the plain model's gap
            assert miss < 0.2 * abs(measured - stall["predicted_plain_at_age"])
        else:
            assert miss <= 0.02, (state, measured, predicted)


def _figures():
    """``tools/figures.py``: the cells and the band README's stall sentence is rendered from."""
    return figures_module()


# README: on the grids recorded after λ_m was fitted, the model is within the band in every
# cell but FP4 m under SR, which it overpredicts.
HELD_OUT_MISSES = {("fp4_e2m1", "m", "stochastic")}


@pytest.mark.parametrize("grid", ["lean", "resets", "resets-2", "health"])
def test_held_out_stalls_against_the_band_readme_states(grid: str) -> None:
    figures = _figures()
    assert grid in figures.HELD_OUT
    band = figures.STALL_BAND
    cells = [c for c in figures.held_out_cells() if c.grid == grid]
    assert cells
    entries = recorded_runs(grid)
    for cell in cells:
        stall = entries[cell.run]["stall"][cell.state]
        beta = 0.9 if cell.state == "m" else 0.999
        assert stall["predicted_steady"] == pytest.approx(
            block_stall_probability(cell.fmt, beta, cell.rounding, cell.state, 32), abs=1e-9
        )
        if (cell.fmt, cell.state, cell.rounding) in HELD_OUT_MISSES:
            assert cell.miss < -band, cell  # overpredicted, by more than the band
            # the block model still closes most of the plain model's gap
            assert abs(cell.miss) < 0.3 * abs(cell.measured - stall["predicted_plain_at_age"])
        else:
            assert abs(cell.miss) <= band, cell


def test_trainer_predicts_with_the_block_model() -> None:
    from srtrain.config import load_config
    from srtrain.trainer import predicted_stalls

    cfg = load_config(
        None,
        [
            "optim.m_format=fp4_e2m1",
            "optim.v_format=fp4_e2m2",
            "optim.m_rounding=nearest",
            "optim.block_size=64",
        ],
    )
    assert predicted_stalls(cfg) == {
        "m": block_stall_probability("fp4_e2m1", 0.9, "nearest", "m", 64),
        "v": block_stall_probability("fp4_e2m2", 0.999, "stochastic", "v", 64),
    }
    assert predicted_stalls(load_config(None, []))["v"] == stall_probability(
        "bf16", 0.999, "stochastic", "v"
    )
