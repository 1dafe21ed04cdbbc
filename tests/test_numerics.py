"""The PyTorch rounding spec: grids, torch's casts, unbiasedness, specials, sharding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from srtrain.numerics.formats import (
    BF16,
    FORMATS,
    FP4_E2M1,
    FP4_E2M2,
    FP8_E4M3,
    bits_float,
    check_block_size,
    decode_grid,
    encode_grid,
    float_bits,
    get_format,
)
from srtrain.numerics.rounding import (
    bf16_bits,
    dequantize,
    draw,
    quantize,
    rng_key,
    rng_keys,
    round_bits,
    round_to_format,
    split_draw,
)

from numerics_inputs import fresh_seed, nasty_values

LOWP = ["bf16", "fp8", "fp4_e2m1", "fp4_e2m2"]


def grid_values(fmt) -> torch.Tensor:
    """Every finite value of a scaled format at scale 2**0 (non-negative half)."""
    mag_bits = fmt.bits - 1 if fmt.signed else fmt.bits
    codes = torch.arange(2**mag_bits, dtype=torch.int64)
    values = decode_grid(codes, torch.zeros_like(codes), fmt)
    return values[values <= fmt.max_value]


def test_format_table():
    assert BF16.eps == 2**-7 and FP8_E4M3.eps == 2**-3 and FP4_E2M2.eps == 2**-2
    assert FP4_E2M1.eps == 2**-1
    assert FP8_E4M3.max_value == 448 and FP8_E4M3.min_subnormal == 2**-9
    assert FP4_E2M1.max_value == 6 and FP4_E2M1.min_subnormal == 0.5
    assert FP4_E2M2.max_value == 7 and FP4_E2M2.min_subnormal == 0.25
    assert BF16.max_value == pytest.approx(3.3895313892515355e38)
    assert grid_values(FP4_E2M1).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert grid_values(FP4_E2M2).tolist() == [
        0,
        0.25,
        0.5,
        0.75,
        1,
        1.25,
        1.5,
        1.75,
        2,
        2.5,
        3,
        3.5,
        4,
        5,
        6,
        7,
    ]
    e4m3 = torch.arange(256, dtype=torch.int64)
    torch_values = e4m3.to(torch.uint8).view(torch.float8_e4m3fn).float()
    ours = decode_grid(e4m3, torch.zeros_like(e4m3), FP8_E4M3)
    finite = ~torch.isnan(torch_values)
    assert torch.equal(ours[finite], torch_values[finite])


def test_nearest_matches_torch_bf16_cast():
    seed = fresh_seed()
    x = nasty_values((4099,), seed)
    x = x[x.abs() < 3.38e38]  # torch overflows to inf past the largest bf16; we saturate
    ours = round_to_format(x, "bf16")
    theirs = x.to(torch.bfloat16).float()
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    assert same.all(), f"seed {seed}"


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_bits_is_round_bits_for_bf16(stochastic):
    """The bf16 path equals the general rule on every kind of float32: uniform bit
    patterns (NaN, ±Inf, subnormals and zeros among them), the largest finite values,
    halfway ties, and draws in both halves of a split draw."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    uniform = torch.randint(0, 2**32, (200_003,), generator=g, dtype=torch.int64)
    near_max = torch.arange(0x7F7F0000, 0x7F800000 + 2, dtype=torch.int64)
    ties = (torch.randint(0, 2**16, (5000,), generator=g) << 16) | 0x8000
    bits = torch.cat([uniform, near_max, near_max | 2**31, ties, ties | 0xFFFF])
    x = torch.cat([bits_float(bits), nasty_values((5001,), seed)])
    draws = split_draw(torch.randint(0, 2**32, x.shape, generator=g, dtype=torch.int64))
    for rand in draws if stochastic else (None,):
        expected = round_bits(x, BF16, 0, stochastic, rand)
        assert torch.equal(bf16_bits(x, stochastic, rand), expected), f"seed {seed}"


def test_nearest_matches_torch_fp8_cast():
    seed = fresh_seed()
    x = nasty_values((5001,), seed, scale=1.0)
    x = x[torch.isfinite(x) & (x.abs() < 448)]
    r = round_bits(x, FP8_E4M3, 0, stochastic=False)
    theirs = x.to(torch.float8_e4m3fn)
    assert torch.equal(bits_float(r), theirs.float()), f"seed {seed}"
    codes = encode_grid(r, torch.zeros_like(r), FP8_E4M3)
    assert torch.equal(codes, theirs.view(torch.uint8).to(torch.int64)), f"seed {seed}"


@pytest.mark.parametrize("fmt", LOWP)
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_rounding_lands_on_a_neighbour(fmt, mode):
    """Every rounded value is one of the two grid neighbours; grid values never move."""
    seed = fresh_seed()
    f = get_format(fmt)
    x = nasty_values((61, 33), seed)
    if not f.signed:
        x = x.abs()
    state = quantize(x, f, 16, mode, rng_key(seed, 1, 0, 1), offset=7)
    y = dequantize(state)
    kmax = f.max_scale_exp if f.scaled else 0
    keep = ~torch.isnan(y) & (x.abs() <= f.max_value * 2.0**kmax)
    xs, ys = x[keep].double(), y[keep].double()
    spacing = _spacing(xs, state, f, keep)
    lower = torch.floor(xs / spacing) * spacing
    upper = lower + spacing
    on_grid = (xs / spacing) == torch.floor(xs / spacing)
    ok = (ys == lower) | (ys == upper) | (on_grid & (ys == xs))
    assert ok.all(), f"seed {seed}: {xs[~ok][:4]} -> {ys[~ok][:4]}"
    assert (ys[on_grid] == xs[on_grid]).all(), f"seed {seed}: grid values moved"
    if mode == "nearest":
        err = (ys - xs).abs()
        assert (err <= spacing / 2).all(), f"seed {seed}"


def _spacing(xs, state, fmt, keep):
    """Grid spacing at each kept element under its block's scale."""
    from srtrain.numerics.formats import row_layout

    rows, cols = row_layout(state.shape)
    k = state.scales.to(torch.int64) - 127 if fmt.scaled else None
    if fmt.scaled:
        k = k.reshape(rows, -1).repeat_interleave(state.block_size, dim=1)[:, :cols]
        k = k.reshape(state.shape)[keep]
    else:
        k = torch.zeros(xs.shape, dtype=torch.int64)
    e = torch.floor(torch.log2(xs.abs().double().clamp(min=1e-300))).to(torch.int64)
    grid_exp = torch.maximum(e, fmt.min_exp + k) - fmt.fraction_bits
    return torch.pow(2.0, grid_exp.double())


@pytest.mark.parametrize("fmt", LOWP)
def test_stochastic_rounding_is_unbiased(fmt):
    """Mean over many independent draws equals x within 5 sigma of the rounding variance."""
    f = get_format(fmt)
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    n_values, n_draws = 64, 4000
    base = torch.rand(n_values, generator=g) * 3 + 0.1
    if f.scaled:
        base[0] = 6.0 if f.max_value == 6 else 7.0  # pins the block scale at 2**0
    x = base.repeat(n_draws, 1)
    state = quantize(x, f, 64, "stochastic", rng_key(seed, 5, 1, 2))
    y = dequantize(state).double()
    lo = quantize(x[:1], f, 64, "nearest")
    spacing = _spacing(x[:1].reshape(-1), lo, f, torch.ones(1, 64, dtype=torch.bool))
    frac = (base.double() / spacing.double()) - torch.floor(base.double() / spacing.double())
    sigma = spacing.double() * torch.sqrt(frac * (1 - frac)) / math.sqrt(n_draws)
    err = (y.mean(0) - base.double()).abs()
    assert (err <= 5 * sigma + 1e-12).all(), f"seed {seed}: {(err / sigma).max()}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4_e2m2"])
def test_split_draw_gives_two_unbiased_independent_decisions(fmt):
    """The two halves of one draw round values up with the right probabilities (within
    2**-16 of a step for formats that drop more than 16 bits), and the two decisions of an
    element are uncorrelated (5 sigma)."""
    f = get_format(fmt)
    seed = fresh_seed()
    n = 200_000
    whole = draw(rng_key(seed, 3, 7, 1), torch.arange(n))
    rand_m, rand_v = split_draw(whole)
    assert torch.equal(rand_m >> 16, whole >> 16) and torch.equal(rand_v >> 16, whole & 0xFFFF)
    assert int(((rand_m | rand_v) & 0xFFFF).max()) == 0 and int(rand_v.max()) < 2**32
    step = 2.0**-f.fraction_bits
    up = {}
    for name, rand, p in (("m", rand_m, 0.3), ("v", rand_v, 0.7)):
        x = torch.ones(n) + p * step
        up[name] = bits_float(round_bits(x, f, 0, True, rand)) > 1.0
        tolerance = 5 * math.sqrt(p * (1 - p) / n) + 2.0**-16
        assert abs(up[name].double().mean().item() - p) < tolerance, seed
    corr = np.corrcoef(up["m"].numpy(), up["v"].numpy())[0, 1]
    assert abs(corr) < 5 / math.sqrt(n), f"seed {seed}: correlation {corr}"


def test_split_draw_rounds_up_within_a_sixteenth_bit_of_a_step():
    """On a 16-bit draw, the up-probability of a value a fraction f of an FP8 step above the
    grid is ceil(f·2**16)/2**16, counted over all 2**16 draws; grid values never move."""
    everything = torch.arange(2**16, dtype=torch.int64) << 16
    fp8 = get_format("fp8")
    for f in (0.0, 2.0**-20, 0.3, 0.5, 1 - 2.0**-20):
        x = torch.full((2**16,), 1.0 + f * 2.0**-fp8.fraction_bits)
        ups = int((bits_float(round_bits(x, fp8, 0, True, everything)) > 1.0).sum())
        assert ups == math.ceil(f * 2**16), (f, ups)


def test_nonfinite_and_saturation():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 0.0, -0.0])
    for mode in ("nearest", "stochastic"):
        y = round_to_format(x, "bf16", mode, rng_key(0, 0, 0, 0))
        assert torch.isnan(y[0]) and y[1] == float("inf") and y[2] == float("-inf")
        assert y[3] == BF16.max_value and y[4] == -BF16.max_value
        assert float_bits(y[5:]).tolist() == [0, 0x80000000]
    block = torch.tensor([[1.0, 2.0, float("inf"), 4.0, 5.0, 6.0, 7.0, 8.0]])
    for fmt in ("fp8", "fp4_e2m1"):
        state = quantize(block, fmt, 4)
        y = dequantize(state)
        assert torch.isnan(y[0, :4]).all() and torch.isfinite(y[0, 4:]).all()
    # unsigned format clamps negatives to zero
    y = dequantize(quantize(torch.tensor([[-1.0, 2.0]]), "fp4_e2m2", 2))
    assert y.tolist() == [[0.0, 2.0]]


def test_vectorised_keys_equal_scalar_keys():
    rng = np.random.default_rng(fresh_seed())
    # mostly shared steps, as an optimizer's shards have, and some of their own
    steps = np.concatenate([rng.choice(rng.integers(0, 2**40, 3), 40), rng.integers(0, 2**40, 10)])
    streams = rng.integers(0, 2**20, 50)
    seed = int(rng.integers(0, 2**40))
    one_step = np.full(50, steps[0])  # every shard at one step: hashed once, the same keys
    for steps_now in (steps, one_step):
        k0, k1 = rng_keys(seed, steps_now, streams, (1, 2, 3))
        assert k0.shape == (50,) and k1.shape == (50, 3)
        for i in range(50):
            for j, state in enumerate((1, 2, 3)):
                assert (int(k0[i]), int(k1[i, j])) == rng_key(
                    seed, int(steps_now[i]), int(streams[i]), state
                )
    with pytest.raises(ValueError, match="non-negative"):
        rng_keys(0, [-1], [0], (1,))
    with pytest.raises(ValueError, match="one step per stream"):
        rng_keys(0, [1, 2], [0], (1,))


def test_hash_keys_and_streams():
    idx = torch.arange(0, 1 << 16, dtype=torch.int64)
    a = draw(rng_key(1, 2, 3, 1), idx)
    b = draw(rng_key(2, 2, 3, 1), idx)
    # seeds give different streams, not shifted copies of one
    for shift in (1, 2, 3, 1000):
        assert (a[shift:] == b[:-shift]).float().mean() < 1e-3
    assert (a == b).float().mean() < 1e-3
    # roughly uniform 32-bit output
    u = a.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # indices past 2**32 are distinct from their low words
    hi = draw(rng_key(1, 2, 3, 1), idx + (1 << 32))
    assert (hi == a).float().mean() < 1e-3
    # Python-int and tensor mixers agree
    from srtrain.numerics.rounding import mix32

    assert all(mix32(int(i)) == int(mix32(torch.tensor(int(i)))) for i in (0, 1, 2**31, 2**32 - 1))


def test_draws_are_uniform_and_uncorrelated():
    """One mixing round under a span key: every bit is balanced, the top byte is uniform
    (chi-square), and draws are uncorrelated between neighbouring elements and between the
    keys of the next step, the other state, another parameter and another seed, in both
    16-bit halves (5 sigma); a span crossing 2**32 included."""
    seed = fresh_seed()
    n = 1 << 17
    rng = np.random.default_rng(seed)
    start = int(rng.integers(0, 2**40)) if seed % 2 else 2**32 - n // 2
    index = torch.arange(start, start + n, dtype=torch.int64)
    step, stream = int(rng.integers(0, 2**30)), int(rng.integers(0, 2**20))
    base = draw(rng_key(seed, step, stream, 1), index)
    others = [
        draw(rng_key(*k), index)
        for k in (
            (seed, step + 1, stream, 1),
            (seed, step, stream, 2),
            (seed, step, stream + 1, 1),
            (seed + 1, step, stream, 1),
        )
    ]
    bits = ((base[:, None] >> torch.arange(32)) & 1).double().mean(0)
    assert ((bits - 0.5).abs() < 5 * 0.5 / math.sqrt(n)).all(), f"seed {seed}: {bits}"
    counts = torch.bincount(base >> 24, minlength=256).double()
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 255 + 5 * math.sqrt(2 * 255), f"seed {seed}: chi2 {chi2}"
    limit = 5 / math.sqrt(n)
    for half in (lambda d: d >> 16, lambda d: d & 0xFFFF):
        u = half(base).double().numpy()
        pairs = [(u[:-1], u[1:])] + [(u, half(o).double().numpy()) for o in others]
        for a, b in pairs:
            corr = np.corrcoef(a, b)[0, 1]
            assert abs(corr) < limit, f"seed {seed}: correlation {corr}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4_e2m1"])
def test_sharded_rounding_equals_whole(fmt):
    """Row shards rounded with their global offsets equal the whole tensor rounded at once."""
    seed = fresh_seed()
    x = nasty_values((29, 37), seed)
    key = rng_key(seed, 3, 4, 1)
    whole = quantize(x, fmt, 8, "stochastic", key)
    for parts in (2, 3):
        pieces = []
        for rows in torch.arange(29).chunk(parts):
            start = int(rows[0])
            pieces.append(dequantize(quantize(x[rows], fmt, 8, "stochastic", key, start * 37)))
        got = torch.cat(pieces)
        want = dequantize(whole)
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), f"seed {seed}, {parts} shards"


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown state format 'fp6'"):
        get_format("fp6")
    with pytest.raises(ValueError, match="power of two"):
        check_block_size(24)
    with pytest.raises(ValueError, match="unknown rounding"):
        round_to_format(torch.ones(3), "bf16", "up")
    with pytest.raises(ValueError, match="needs a key"):
        round_to_format(torch.ones(3), "bf16", "stochastic")
    assert set(FORMATS) == {"fp32", "bf16", "fp8", "fp4_e2m1", "fp4_e2m2"}


@pytest.mark.parametrize("fmt", ["fp8", "fp4_e2m2"])
def test_keep_positive_never_stores_zero_for_positive_values(fmt):
    f = get_format(fmt)
    x = torch.tensor([[f.max_value, 1e-30, 0.0, 3e-3, -0.0, 1e-8, 2.0, 5e-6]])
    plain = dequantize(quantize(x, f, 8, "nearest"))
    kept = dequantize(quantize(x, f, 8, "nearest", keep_positive=True))
    smallest = f.min_subnormal
    assert plain[0, 1] == 0 and kept[0, 1] == smallest
    assert kept[0, 2] == 0 and kept[0, 4] == 0  # zeros stay zero
    positive = x > 0
    assert (kept[positive] > 0).all()
    assert torch.equal(kept[plain != 0], plain[plain != 0])  # only flushed values change


def test_state_pairs_are_one_registry():
    """Every allowed (m, v) pair is in STATE_PAIRS, and only those pass the moment check; the
    named pairs are among them and "fp4" names signed E2M1 for m, unsigned E2M2 for v."""
    from srtrain.numerics.formats import (
        FORMATS,
        M_FORMATS,
        NAMED_PAIRS,
        STATE_PAIRS,
        V_FORMATS,
        check_moment_formats,
    )

    for m in FORMATS.values():
        for v in FORMATS.values():
            if (m, v) in STATE_PAIRS:
                assert check_moment_formats(m.name, v.name) == (m, v)
            else:
                with pytest.raises(ValueError, match="format"):
                    check_moment_formats(m.name, v.name)
    assert len(STATE_PAIRS) == len(M_FORMATS) * len(V_FORMATS) == 16
    assert all(m.signed for m in M_FORMATS) and "fp4_e2m1" not in {v.name for v in V_FORMATS}
    assert set(NAMED_PAIRS.values()) <= set(STATE_PAIRS)
    assert [f.name for f in NAMED_PAIRS["fp4"]] == ["fp4_e2m1", "fp4_e2m2"]
    assert {f.family for f in FORMATS.values()} == {"fp32", "bf16", "e4m3", "fp4"}
