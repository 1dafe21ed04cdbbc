"""Counter-based normal samples: the definition, slices of any start and length, statistics,
distinct keys and scratch memory bounded by the chunk."""

import math

import pytest
import torch

from srtrain.numerics.normal import STATE_ANGLE, STATE_RADIUS, fill_normal_, normal_keys
from srtrain.numerics.rounding import STATE_MOMENTS, STATE_PARAM, draw, global_index, mix32
from tensor_watch import LargestOutput

KEYS = normal_keys(3, "model.layers.0.mlp.up_proj.weight")


def _normal(keys, offset: int, numel: int, chunk: int = 1 << 22) -> torch.Tensor:
    return fill_normal_(torch.empty(numel), keys, offset, 1.0, chunk)


def _definition(keys, offset: int, numel: int) -> torch.Tensor:
    """Box–Muller over ``mix32(draw(key, i) ^ key[1])``, each index drawn on its own."""
    index = global_index(offset, numel, "cpu")
    radius, angle = ((mix32(draw(key, index) ^ key[1]) >> 8) for key in keys)
    u1 = (radius + 1).to(torch.float32) * 2.0**-24
    theta = angle.to(torch.float32) * (2.0 * math.pi * 2.0**-24)
    return torch.sqrt(torch.log(u1) * -2.0) * torch.cos(theta)


@pytest.mark.parametrize("offset", [0, 2**32 - 300, 2**33 + 5])
def test_values_follow_the_definition_across_high_words(offset):
    assert torch.equal(_normal(KEYS, offset, 600, chunk=128), _definition(KEYS, offset, 600))


def test_any_slice_holds_the_whole_tensors_values_bitwise():
    n = 100_003
    whole = _normal(KEYS, 0, n)
    whole_bf16 = whole.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for _ in range(25):
        start = int(torch.randint(0, n, (1,), generator=g))
        length = int(torch.randint(0, n - start + 1, (1,), generator=g))
        chunk = int(torch.randint(100, 40_000, (1,), generator=g))
        got = _normal(KEYS, start, length, chunk)
        assert torch.equal(got, whole[start : start + length]), (start, length, chunk)
        bf16 = fill_normal_(torch.empty(length, dtype=torch.bfloat16), KEYS, start, 1.0, chunk)
        assert torch.equal(bf16, whole_bf16[start : start + length]), (start, length, chunk)


def test_std_scales_the_standard_values():
    base = _normal(KEYS, 17, 1000)
    scaled = fill_normal_(torch.empty(1000), KEYS, 17, 0.02)
    assert torch.equal(scaled, base * 0.02)


def test_samples_are_standard_normal():
    n = 1 << 21
    z = _normal(KEYS, 0, n).double()
    # Each statistic is compared with its expectation within 5 standard errors.
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 5 / math.sqrt(2 * n)
    assert abs((z**4).mean().item() - 3) < 5 * math.sqrt(96 / n)  # kurtosis of a normal
    for k in (1, 2, 3):
        p = math.erf(k / math.sqrt(2))
        frac = (z.abs() < k).double().mean().item()
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / n), k
    assert z.abs().max().item() <= math.sqrt(48 * math.log(2))
    lag1 = (z[1:] * z[:-1]).mean().item()
    assert abs(lag1) < 5 / math.sqrt(n)


def test_names_and_seeds_give_different_uncorrelated_values():
    n = 1 << 18
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")
    keys = [normal_keys(3, names[0]), normal_keys(3, names[1]), normal_keys(4, names[0])]
    assert normal_keys(3, names[0]) == keys[0]
    values = [_normal(k, 0, n).double() for k in keys]
    for i in range(3):
        for j in range(i):
            assert not torch.equal(values[i], values[j])
            assert abs((values[i] * values[j]).mean().item()) < 5 / math.sqrt(n)
    assert len({STATE_MOMENTS, STATE_PARAM, STATE_RADIUS, STATE_ANGLE}) == 4


def test_negative_seed_is_refused():
    with pytest.raises(ValueError, match="non-negative"):
        normal_keys(-1, "lm_head.weight")


def test_only_1d_tensors_and_positive_chunks():
    with pytest.raises(ValueError, match=r"1-D tensor, got shape \(2, 3\)"):
        fill_normal_(torch.empty(2, 3), KEYS, 0, 1.0)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        fill_normal_(torch.empty(3), KEYS, 0, 1.0, chunk=0)


def test_scratch_tensors_never_exceed_the_chunk():
    flat = torch.empty(20_000)
    with LargestOutput() as largest:
        fill_normal_(flat, KEYS, 7, 1.0, chunk=2048)
    assert 0 < largest.numel <= 2048
    assert torch.equal(flat, _normal(KEYS, 7, 20_000))
