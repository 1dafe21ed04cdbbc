"""Triton kernels (interpreter on CPU, CUDA when present) against the PyTorch spec, bit for bit."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from srtrain.kernels.cast import quantize_triton, sr_cast_bf16_triton, unfilled_state
from srtrain.kernels.launch import StepItem, fused_adamw_triton
from srtrain.numerics.adamw import (
    COUNT_M_SATURATED,
    COUNT_M_SCALE_CHANGED,
    COUNT_M_UNDERFLOW,
    COUNT_V_SATURATED,
    COUNT_V_SCALE_CHANGED,
    COUNT_V_UNDERFLOW,
    NUM_COUNTS,
    NUM_STALL_COUNTS,
    AdamWScalars,
    RoundingPlan,
    adamw_step_reference,
)
from srtrain.numerics.formats import get_format
from srtrain.numerics.rounding import (
    StoredState,
    dequantize,
    largest_magnitudes,
    quantize,
    rng_key,
    sr_cast_bf16,
)

from numerics_inputs import assert_same_bits, fresh_seed, nasty_values

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
M_FORMATS = ["fp32", "bf16", "fp8", "fp4_e2m1"]
V_FORMATS = ["fp32", "bf16", "fp8", "fp4_e2m2"]
SHAPES = [(37, 45), (301,), (16, 64), (3, 5, 11), (2, 67)]


def clone_state(s: StoredState) -> StoredState:
    scales = None if s.scales is None else s.scales.clone()
    return StoredState(s.fmt, s.codes.clone(), scales, s.shape, s.block_size)


def assert_same_state(a: StoredState, b: StoredState, what: str) -> None:
    assert_same_bits(a.codes, b.codes, f"{what} codes")
    if a.scales is not None:
        assert_same_bits(a.scales, b.scales, f"{what} scales")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4_e2m1", "fp4_e2m2"])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_cast_kernel_matches_spec(fmt, mode):
    seed = fresh_seed()
    for shape, block in ((37, 45), 16), ((301,), 32), ((5, 7, 9), 8), ((7,), 8), ((64,), 8):
        x = nasty_values(shape, seed).to(DEVICE)
        if fmt == "fp4_e2m2":
            x = x.abs()
        key = rng_key(seed, 9, 2, 1)
        for keep in (False, True):
            want = quantize(x, fmt, block, mode, key, offset=12345, keep_positive=keep)
            got = quantize_triton(x, fmt, block, mode, key, offset=12345, keep_positive=keep)
            assert_same_state(want, got, f"{fmt} {mode} {shape} keep {keep} seed {seed}")


def test_cast_rejects_a_tile_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        quantize_triton(torch.ones(8, device=DEVICE), "bf16", tile=100)


def _wide_blocks(n_blocks: int, block: int, seed: int) -> torch.Tensor:
    """Blocks whose largest element sets the scale and whose others lie 0–40 binades below
    it, with exact ties and grid points among them, so rounding meets every regime."""
    g = torch.Generator().manual_seed(seed)
    top = torch.exp2(torch.randint(-130, 120, (n_blocks, 1), generator=g).float())
    depth = torch.rand(n_blocks, block, generator=g) * 40
    x = (
        top
        * torch.exp2(-depth)
        * torch.where(torch.rand(n_blocks, block, generator=g) < 0.5, -1.0, 1.0)
    )
    # multiples of small powers of two: grid points and halfway points of coarse grids
    steps = torch.exp2(-torch.randint(0, 14, (n_blocks, block), generator=g).float())
    snapped = torch.round(x / (top * steps)) * (top * steps) / 2
    x = torch.where(torch.rand(n_blocks, block, generator=g) < 0.3, snapped, x)
    x[:, 0] = top[:, 0] * (1 + torch.rand(n_blocks, generator=g))
    return x.to(DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "fp4_e2m1", "fp4_e2m2"])
def test_cast_kernel_rounds_every_regime(fmt):
    """Scaled rounding on values from the block maximum down to far below the smallest
    grid step: nearest (ties included) and stochastic, bit for bit with the spec; tiles
    of several narrow rows, and rows (of odd length too) cut into several tiles."""
    seed = fresh_seed()
    x = _wide_blocks(512, 32, seed)
    if fmt == "fp4_e2m2":
        x = x.abs()
    key = rng_key(seed, 3, 1, 0)
    for mode, shape, tile in itertools.product(
        ("nearest", "stochastic"), ((512, 32), (4, 4096), (16, 1023)), (None, 256)
    ):
        xs = x.view(-1)[: shape[0] * shape[1]].view(shape)
        want = quantize(xs, fmt, 32, mode, key, offset=7, keep_positive=True)
        got = quantize_triton(xs, fmt, 32, mode, key, offset=7, keep_positive=True, tile=tile)
        assert_same_state(want, got, f"{fmt} {mode} {shape} tile {tile} seed {seed}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4_e2m1"])
def test_cast_kernel_writes_every_byte(fmt, monkeypatch):
    """quantize_triton leaves its output unfilled: outputs pre-filled with garbage still come
    back equal to the spec (odd rows, so FP4 rows end in a padding nibble)."""
    from srtrain.kernels import cast

    def garbage_state(*args):
        state = unfilled_state(*args)
        state.codes.view(torch.uint8).fill_(0xAB)
        if state.scales is not None:
            state.scales.fill_(0xAB)
        return state

    monkeypatch.setattr(cast, "unfilled_state", garbage_state)
    seed = fresh_seed()
    x = nasty_values((37, 45), seed).to(DEVICE)
    key = rng_key(seed, 2, 0, 1)
    for mode in ("nearest", "stochastic"):
        assert_same_state(
            quantize(x, fmt, 16, mode, key, 5),
            quantize_triton(x, fmt, 16, mode, key, 5),
            f"{fmt} {mode} seed {seed}",
        )


def test_sr_cast_bf16_kernel_matches_spec():
    """The SR cast at a global offset past 2**32, and at one whose indices cross 2**32
    (their high word changes inside the tensor)."""
    seed = fresh_seed()
    x = nasty_values((1000, 33), seed).to(DEVICE)
    key = rng_key(seed, 1, 0, 0)
    for offset, tile in itertools.product((2**33, 2**32 - 5000), (None, 2048)):
        assert_same_bits(
            sr_cast_bf16_triton(x, key, offset, tile=tile),
            sr_cast_bf16(x, key, offset),
            f"sr cast offset {offset} tile {tile} seed {seed}",
        )


def assert_launch_equals_spec(refs, items, counts_ref, counts_ker, what: str) -> None:
    """Each launched item's parameter and states equal the spec's (``refs``: parameter, m and
    v after the spec's step), and so do the counts."""
    for (param, m, v), item in zip(refs, items, strict=True):
        where = f"{what} {tuple(param.shape)}"
        assert_same_bits(param, item.param, f"param {where}")
        assert_same_state(m, item.m, f"m {where}")
        assert_same_state(v, item.v, f"v {where}")
    assert torch.equal(counts_ref, counts_ker)


def _step_case(seed, shape, m_fmt, v_fmt, p_dtype, g_dtype, stochastic, block):
    g = torch.Generator().manual_seed(seed)
    param = (torch.randn(shape, generator=g) * 0.05).to(p_dtype).to(DEVICE)
    grad = nasty_values(shape, seed + 1, scale=1e-2).to(g_dtype).to(DEVICE)
    m = quantize(torch.randn(shape, generator=g).to(DEVICE) * 1e-3, m_fmt, block)
    v = quantize(torch.rand(shape, generator=g).to(DEVICE) * 1e-6, v_fmt, block)
    scalars = AdamWScalars.make(3e-3, 0.9, 0.999, 1e-8, 0.1, age_m=7, age_v=3)
    plan = RoundingPlan(
        stochastic, stochastic, stochastic, rng_key(seed, 7, 5, 1), rng_key(seed, 7, 5, 3)
    )
    return param, grad, m, v, scalars, plan


@pytest.mark.parametrize("m_fmt", M_FORMATS)
@pytest.mark.parametrize("v_fmt", V_FORMATS)
def test_fused_step_matches_spec(m_fmt, v_fmt):
    """Every format pair × rounding × param dtype × grad dtype, odd shapes, nasty grads."""
    seed = fresh_seed()
    cases = itertools.product(
        [torch.float32, torch.bfloat16], [torch.float32, torch.bfloat16], [False, True]
    )
    for i, (p_dtype, g_dtype, stochastic) in enumerate(cases):
        shape = SHAPES[i % len(SHAPES)]
        what = f"{m_fmt}/{v_fmt} {p_dtype} grad {g_dtype} sr={stochastic} {shape} seed {seed}"
        case = _step_case(seed + i, shape, m_fmt, v_fmt, p_dtype, g_dtype, stochastic, block=16)
        _check_fused_step(*case, offset=1000 + i, what=what)


@pytest.mark.parametrize(
    "m_fmt,v_fmt", [("bf16", "bf16"), ("fp8", "fp8"), ("fp4_e2m1", "fp4_e2m2"), ("fp8", "fp4_e2m2")]
)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_step_on_aligned_rows_matches_spec(m_fmt, v_fmt, stochastic):
    """Rows a multiple of 16 long at 16-byte addresses, the layout of most real shards, take
    the vectorised loads and stores: narrow and wide rows, FP32 and BF16 parameters."""
    from srtrain.kernels.layout import aligned_shard

    seed = fresh_seed()
    for i, (shape, p_dtype, block) in enumerate(
        (
            ((48, 64), torch.float32, 32),
            ((3, 4096), torch.float32, 32),
            ((16, 512), torch.bfloat16, 16),
        )
    ):
        what = f"{m_fmt}/{v_fmt} {p_dtype} sr={stochastic} {shape} seed {seed}"
        case = _step_case(seed + i, shape, m_fmt, v_fmt, p_dtype, torch.float32, stochastic, block)
        assert aligned_shard(case[0], case[2], case[3]), what
        _check_fused_step(*case, offset=7 * i, what=what)


def _shifted(t: torch.Tensor, skip: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose first element lies ``skip`` elements past the start
    of its (16-byte aligned) buffer."""
    buffer = torch.empty(t.numel() + skip, dtype=t.dtype, device=t.device)
    copy = buffer[skip:].view(t.shape)
    copy.copy_(t)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    "m_fmt,v_fmt", [("fp8", "fp8"), ("fp4_e2m1", "fp4_e2m2"), ("fp8", "fp4_e2m2")]
)
@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_step_on_unaligned_rows_matches_spec(m_fmt, v_fmt, stochastic):
    """Rows a tile wide or more whose length is not a multiple of 16, so that rows start at
    every place in a 16-byte window, and parameters and gradients whose first element lies
    off a 16-byte boundary: full tiles and each row's last tile, one element at a time."""
    seed = fresh_seed()
    for i, (shape, p_skip, g_skip) in enumerate(
        (((7, 5461), 0, 0), ((6, 1029), 1, 3), ((5, 1030), 2, 1), ((3, 2051), 3, 2))
    ):
        what = f"{m_fmt}/{v_fmt} sr={stochastic} {shape} skips {p_skip}, {g_skip} seed {seed}"
        case = list(
            _step_case(seed + i, shape, m_fmt, v_fmt, torch.float32, torch.float32, stochastic, 32)
        )
        case[0], case[1] = _shifted(case[0], p_skip), _shifted(case[1], g_skip)
        _check_fused_step(*case, offset=11 * i, what=what)


@pytest.mark.parametrize("m_sr,v_sr", [(False, True), (True, False)])
def test_fused_step_with_one_stochastic_state_matches_spec(m_sr, v_sr):
    """One state rounds stochastically and the other to nearest: the stochastic one still
    takes its own half of the shared draw."""
    seed = fresh_seed()
    for i, (m_fmt, v_fmt) in enumerate((("fp8", "fp4_e2m2"), ("bf16", "fp8"), ("bf16", "bf16"))):
        case = list(
            _step_case(seed + i, (9, 70), m_fmt, v_fmt, torch.bfloat16, torch.float32, True, 16)
        )
        case[5] = dataclasses.replace(case[5], m_stochastic=m_sr, v_stochastic=v_sr)
        _check_fused_step(*case, offset=3, what=f"{m_fmt}/{v_fmt} m_sr={m_sr} seed {seed}")


def _check_fused_step(param, grad, m, v, scalars, plan, offset: int, what: str) -> None:
    """The fused step equals the spec bit for bit, and its counts compare the old and new
    stored values directly."""
    p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
    m_old, v_old = dequantize(m), dequantize(v)
    old_scales = [None if s.scales is None else s.scales.clone() for s in (m, v)]
    c_ref = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    c_ker = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    adamw_step_reference(param, grad, m, v, scalars, plan, offset, c_ref)
    fused_adamw_triton(p2, grad, m2, v2, scalars, plan, offset, c_ker)
    assert_same_bits(param, p2, f"param {what}")
    assert_same_state(m, m2, f"m {what}")
    assert_same_state(v, v2, f"v {what}")
    assert torch.equal(c_ref, c_ker), f"counts {c_ref.tolist()} vs {c_ker.tolist()} {what}"
    direct = [
        int((dequantize(m2) == m_old).sum()),
        int((dequantize(v2) == v_old).sum()),
        int((~torch.isfinite(grad.float())).sum()),
        int((dequantize(m2).abs() == largest_magnitudes(m2)).sum()),
        int((dequantize(v2).abs() == largest_magnitudes(v2)).sum()),
        0 if m.scales is None else int((m2.scales != old_scales[0]).sum()),
        0 if v.scales is None else int((v2.scales != old_scales[1]).sum()),
    ]
    counted = [c_ker[i] for i in (0, 1, 3, COUNT_M_SATURATED, COUNT_V_SATURATED)]
    counted += [c_ker[COUNT_M_SCALE_CHANGED], c_ker[COUNT_V_SCALE_CHANGED]]
    assert [int(c) for c in counted] == direct, what


def _extra_counts(counts: torch.Tensor) -> dict[str, int]:
    """The underflow, saturation and scale counts of a counts row, by name."""
    names = {
        "m_underflow": COUNT_M_UNDERFLOW,
        "v_underflow": COUNT_V_UNDERFLOW,
        "m_saturated": COUNT_M_SATURATED,
        "v_saturated": COUNT_V_SATURATED,
        "m_scale_changed": COUNT_M_SCALE_CHANGED,
        "v_scale_changed": COUNT_V_SCALE_CHANGED,
    }
    return {name: int(counts[i]) for name, i in names.items()}


def _count_case(m_fmt: str, v_fmt: str, which: str, stochastic: bool):
    """A hand-built step on two rows of one block (8 elements) each; ``which`` sets up m's or
    v's counts.

    m (β1 = 0, so m' = g, from m = 0): row 0 holds ±the largest value (saturated), 2**-140
    (below every format's smallest step but float32's: underflows to 0 under nearest
    rounding) and a 1; row 1 stays 0 (its scale too). Its v is non-finite in row 0 (g²
    overflows) or 0.

    v (β2 = 0.999, g = 0 but two): row 0 starts at the largest value, which decays by 0.1%
    (nearest rounding keeps the largest value: saturated) beside 0.001·2**-128 (under
    BF16's smallest step: underflows; block-scaled v keeps it positive); row 1 starts at 0
    and gets g = 1 (its scale changes).
    """
    m_f, v_f = get_format(m_fmt), get_format(v_fmt)
    g = torch.zeros(2, 8)
    m0, v0 = torch.zeros(2, 8), torch.zeros(2, 8)
    if which == "m":
        g[0, :4] = torch.tensor([m_f.max_value, -m_f.max_value, 2.0**-140, 1.0])
        beta1, beta2 = 0.0, 0.999
    else:
        v0[0, 0] = v_f.max_value
        g[0, 1], g[1, 0] = 2.0**-64, 1.0
        beta1, beta2 = 0.9, 0.999
    param = torch.zeros(2, 8).to(DEVICE)
    m = quantize(m0.to(DEVICE), m_fmt, 8)
    v = quantize(v0.to(DEVICE), v_fmt, 8)
    scalars = AdamWScalars.make(1e-3, beta1, beta2, 1e-8, 0.0, age_m=1, age_v=1)
    plan = RoundingPlan(
        stochastic, stochastic, stochastic, rng_key(3, 1, 0, 1), rng_key(3, 1, 0, 3)
    )
    return param, g.to(DEVICE), m, v, scalars, plan


@pytest.mark.parametrize("m_fmt", M_FORMATS)
def test_reference_counts_underflow_saturation_and_scale_changes_of_m(m_fmt):
    """Under nearest rounding: one underflow (none in FP32, which stores its proposal), two
    saturated elements, one block whose scale changed (block-scaled formats only); v's
    non-finite row counts as a scale change only."""
    v_fmt = "fp8"
    counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    adamw_step_reference(*_count_case(m_fmt, v_fmt, "m", False), 0, counts)
    scaled = get_format(m_fmt).scaled
    assert _extra_counts(counts) == {
        "m_underflow": 0 if m_fmt == "fp32" else 1,
        "v_underflow": 0,
        "m_saturated": 2,
        "v_saturated": 0,
        "m_scale_changed": 1 if scaled else 0,
        "v_scale_changed": 1,  # row 0 holds Inf: its block turns NaN
    }


@pytest.mark.parametrize("v_fmt", V_FORMATS)
def test_reference_counts_underflow_saturation_and_scale_changes_of_v(v_fmt):
    """Under nearest rounding: BF16 v underflows once and saturates once; block-scaled v
    never underflows (a positive v keeps its smallest step), saturates once, and changes one
    block's scale; FP32 v counts nothing."""
    counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    adamw_step_reference(*_count_case("fp32", v_fmt, "v", False), 0, counts)
    scaled = get_format(v_fmt).scaled
    assert _extra_counts(counts) == {
        "m_underflow": 0,
        "v_underflow": 1 if v_fmt == "bf16" else 0,
        "m_saturated": 0,
        "v_saturated": 0 if v_fmt == "fp32" else 1,
        "m_scale_changed": 0,
        "v_scale_changed": 1 if scaled else 0,
    }


@pytest.mark.parametrize("m_fmt", M_FORMATS)
@pytest.mark.parametrize("v_fmt", V_FORMATS)
def test_fused_step_counts_hand_built_cases_as_the_spec(m_fmt, v_fmt):
    """The hand-built cases of the reference's count tests, both rounding modes: the fused
    step equals the spec, counts included."""
    for which, stochastic in itertools.product(("m", "v"), (False, True)):
        what = f"{m_fmt}/{v_fmt} {which} sr={stochastic}"
        _check_fused_step(*_count_case(m_fmt, v_fmt, which, stochastic), offset=0, what=what)


@pytest.mark.parametrize(
    "m_fmt,v_fmt,p_dtype",
    [
        ("bf16", "bf16", torch.float32),
        ("fp32", "fp8", torch.bfloat16),
        ("fp8", "fp4_e2m2", torch.float32),
        ("fp4_e2m1", "fp4_e2m2", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("stochastic", [False, True])
def test_launch_without_health_counts_equals_the_spec_without(m_fmt, v_fmt, p_dtype, stochastic):
    """A launch without the health counts (shards of several tiles, runs across shards)
    equals the spec without them: the same parameters, states and stall counts as a step
    with them, and the health columns of every row left as they were."""
    from srtrain.kernels.launch import StepItem, fused_adamw_multi_triton

    seed = fresh_seed()
    shapes = [(37, 45), (4, 128), (301,), (2, 67)]
    rows = len(shapes)
    before = torch.arange(rows * NUM_COUNTS, device=DEVICE).view(rows, NUM_COUNTS) * 1000
    counts = {key: before.clone() for key in ("ref", "ker", "ref_health")}
    refs, items = [], []
    for i, shape in enumerate(shapes):
        param, grad, m, v, scalars, plan = _step_case(
            seed + i, shape, m_fmt, v_fmt, p_dtype, p_dtype, stochastic, block=16
        )
        p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
        p3, m3, v3 = param.clone(), clone_state(m), clone_state(v)
        adamw_step_reference(param, grad, m, v, scalars, plan, 50 * i, counts["ref"][i], False)
        adamw_step_reference(p3, grad, m3, v3, scalars, plan, 50 * i, counts["ref_health"][i])
        assert_same_bits(param, p3, f"param {shape}: health changes no result")
        refs.append((param, m, v))
        items.append(StepItem(p2, grad, m2, v2, scalars, plan, 50 * i, i))
    fused_adamw_multi_triton(items, counts["ker"], health=False, tile=64)
    what = f"{m_fmt}/{v_fmt} {p_dtype} sr={stochastic} seed {seed}"
    assert_launch_equals_spec(refs, items, counts["ref"], counts["ker"], what)
    stall = slice(0, NUM_STALL_COUNTS)
    health = slice(NUM_STALL_COUNTS, NUM_COUNTS)
    assert torch.equal(counts["ker"][:, health], before[:, health]), what
    assert torch.equal(counts["ker"][:, stall], counts["ref_health"][:, stall]), what


def test_fused_step_sharded_equals_whole():
    """Row shards updated with their global offsets equal one whole-tensor update."""
    seed = fresh_seed()
    shape = (23, 40)
    base = _step_case(seed, shape, "fp8", "fp4_e2m2", torch.bfloat16, torch.float32, True, 16)
    param, grad, m, v, scalars, plan = base
    whole_p, whole_m, whole_v = param.clone(), clone_state(m), clone_state(v)
    fused_adamw_triton(
        whole_p,
        grad,
        whole_m,
        whole_v,
        scalars,
        plan,
        0,
        torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE),
    )
    for parts in (2, 3):
        out = []
        for rows in torch.arange(shape[0]).chunk(parts):
            sl = slice(int(rows[0]), int(rows[-1]) + 1)
            p = param[sl].clone()
            ms = StoredState(m.fmt, m.codes[sl].clone(), m.scales[sl].clone(), tuple(p.shape), 16)
            vs = StoredState(v.fmt, v.codes[sl].clone(), v.scales[sl].clone(), tuple(p.shape), 16)
            fused_adamw_triton(
                p,
                grad[sl].contiguous(),
                ms,
                vs,
                scalars,
                plan,
                sl.start * 40,
                torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE),
            )
            out.append((p, ms, vs))
        assert_same_bits(torch.cat([o[0] for o in out]), whole_p, f"param {parts} shards")
        assert_same_bits(torch.cat([o[1].codes for o in out]), whole_m.codes, "m codes")
        assert_same_bits(torch.cat([o[2].scales for o in out]), whole_v.scales, "v scales")


@pytest.mark.parametrize("step", [adamw_step_reference, fused_adamw_triton])
def test_step_rejects_mismatched_inputs(step):
    param, grad, m, v, scalars, plan = _step_case(
        1, (4, 8), "fp8", "bf16", torch.float32, torch.float32, False, 8
    )
    counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="counts must be"):
        step(param, grad, m, v, scalars, plan, 0, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="gradient shape"):
        step(param, grad[:, :5], m, v, scalars, plan, 0, counts)
    with pytest.raises(ValueError, match="state m has shape"):
        step(param[:2], grad[:2], m, v, scalars, plan, 0, counts)
    with pytest.raises(TypeError, match="parameters must be"):
        step(param.to(torch.float16), grad, m, v, scalars, plan, 0, counts)
    with pytest.raises(TypeError, match="gradients must be"):
        step(param, grad.to(torch.int32), m, v, scalars, plan, 0, counts)
    with pytest.raises(ValueError, match="must be on the parameter's device"):
        step(param, grad.to("meta"), m, v, scalars, plan, 0, counts)


# Gates of a gated step: finite ones scale the gradients (a subnormal and 0 among them),
# non-finite ones skip it.
GATES = [1.0, 0.37, 2.0**-140, 0.0, float("nan"), float("inf"), float("-inf")]


def _addresses(tensors: list[torch.Tensor]) -> np.ndarray:
    """The tensors' data addresses, as the shadow update takes them."""
    return np.array([t.data_ptr() for t in tensors], dtype=np.uint64)


def _gate(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


def _counts_before(rows: int) -> torch.Tensor:
    """Counts rows already holding distinct values, so that a skipped step's are seen."""
    return torch.arange(rows * NUM_COUNTS, device=DEVICE).view(rows, NUM_COUNTS) * 1000 + 7


@pytest.mark.parametrize("value", GATES)
def test_gated_spec_steps_on_the_scaled_gradient_or_not_at_all(value):
    """The spec under a finite gate is the spec on the gradient times the gate (float32),
    counts included; under a non-finite one it changes nothing, counts included."""
    seed = fresh_seed()
    for i, (p_dtype, g_dtype) in enumerate(
        itertools.product([torch.float32, torch.bfloat16], repeat=2)
    ):
        case = _step_case(seed + i, (37, 45), "fp8", "fp4_e2m2", p_dtype, g_dtype, True, 16)
        param, grad, m, v, scalars, plan = case
        p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
        p0, m0, v0 = param.clone(), clone_state(m), clone_state(v)
        counts, counts_scaled = _counts_before(1)[0], _counts_before(1)[0]
        adamw_step_reference(param, grad, m, v, scalars, plan, 9, counts, grad_scale=_gate(value))
        what = f"gate {value} {p_dtype} grad {g_dtype} seed {seed + i}"
        if math.isfinite(value):
            scaled = grad.float() * _gate(value)
            adamw_step_reference(p2, scaled, m2, v2, scalars, plan, 9, counts_scaled)
        assert_same_bits(param, p2, f"param {what}")
        assert_same_state(m, m2, f"m {what}")
        assert_same_state(v, v2, f"v {what}")
        assert torch.equal(counts, counts_scaled), what
        if not math.isfinite(value):
            assert_same_bits(param, p0, f"param {what}")
            assert_same_state(m, m0, f"m {what}")
            assert_same_state(v, v0, f"v {what}")


def _gated_launch(items, refs, counts_ref, gate, health=True, **launch):
    """Step the spec on ``refs`` and the fused launch on ``items`` under ``gate``, each
    adding to its counts (rows ``item.counts_row``); returns the launch's counts."""
    from srtrain.kernels.launch import fused_adamw_multi_triton

    counts_ker = counts_ref.clone()
    for (param, m, v), item in zip(refs, items, strict=True):
        row = counts_ref[item.counts_row]
        adamw_step_reference(
            param, item.grad, m, v, item.scalars, item.plan, item.offset, row, health, gate
        )
    fused_adamw_multi_triton(items, counts_ker, health=health, grad_scale=gate, **launch)
    return counts_ker


def _gated_items(seed, shapes, m_fmt, v_fmt, p_dtype, g_dtype, stochastic, base=0):
    """The spec's copies (param, m, v) and the launch's items of a step over ``shapes``."""
    refs, items = [], []
    for i, shape in enumerate(shapes):
        param, grad, m, v, scalars, plan = _step_case(
            seed + i, shape, m_fmt, v_fmt, p_dtype, g_dtype, stochastic, block=16
        )
        refs.append((param.clone(), clone_state(m), clone_state(v)))
        items.append(StepItem(param, grad, m, v, scalars, plan, base + 100 * i, i))
    return refs, items


def _assert_unchanged(before, items, what):
    for (param, m, v), item in zip(before, items, strict=True):
        assert_same_bits(param, item.param, f"skipped param {what}")
        assert_same_state(m, item.m, f"skipped m {what}")
        assert_same_state(v, item.v, f"skipped v {what}")


@pytest.mark.parametrize("m_fmt", M_FORMATS)
@pytest.mark.parametrize("v_fmt", V_FORMATS)
def test_gated_launch_matches_gated_spec(m_fmt, v_fmt):
    """Every gate on a launch over shards of odd shapes with NaN and ±Inf among the
    gradients, FP32 and BF16 parameters and gradients, nearest and stochastic rounding: the
    gated kernel equals the gated spec bit for bit, counts included; a non-finite gate
    leaves parameters, codes, scales and counts as they were."""
    seed = fresh_seed()
    dtypes = list(itertools.product([torch.float32, torch.bfloat16], repeat=2))
    shapes = [(37, 45), (301,), (3, 5, 11)]
    for i, value in enumerate(GATES):
        p_dtype, g_dtype = dtypes[(i + M_FORMATS.index(m_fmt)) % len(dtypes)]
        stochastic = (i + V_FORMATS.index(v_fmt)) % 2 == 1
        what = f"{m_fmt}/{v_fmt} gate {value} {p_dtype} grad {g_dtype} sr={stochastic}"
        what += f" seed {seed + 10 * i}"
        refs, items = _gated_items(
            seed + 10 * i, shapes, m_fmt, v_fmt, p_dtype, g_dtype, stochastic
        )
        before = [(p.clone(), clone_state(m), clone_state(v)) for p, m, v in refs]
        counts_ref = _counts_before(len(shapes))
        counts_ker = _gated_launch(items, refs, counts_ref, _gate(value))
        assert_launch_equals_spec(refs, items, counts_ref, counts_ker, what)
        if not math.isfinite(value):
            _assert_unchanged(before, items, what)
            assert torch.equal(counts_ker, _counts_before(len(shapes))), what


@pytest.mark.parametrize(
    "m_fmt,v_fmt,p_dtype,tile,rows",
    [
        ("bf16", "bf16", torch.float32, 64, "aligned"),
        ("fp8", "fp4_e2m2", torch.bfloat16, 64, "aligned"),
        ("fp4_e2m1", "fp4_e2m2", torch.float32, 64, "wide"),
        ("fp32", "fp8", torch.float32, None, "carry"),
        ("fp8", "fp8", torch.bfloat16, None, "odd"),
    ],
)
def test_gated_launches_alternate_with_ungated_ones(m_fmt, v_fmt, p_dtype, tile, rows):
    """One MultiStep steps the same shards ungated, gated shut (NaN, then -Inf), gated at
    0.37, and ungated again, each step equal to the spec's: aligned rows, rows a tile wide,
    indices across 2**32, programs across several shards; the health counts off once."""
    from srtrain.kernels.launch import MultiStep, Shard, step_tables

    seed = fresh_seed()
    shapes = {
        "aligned": [(4, 64), (2, 128), (8, 16)],
        "wide": [(3, 64), (2, 131)],
        "carry": [(37, 45), (301,)],
        "odd": [(37, 45), (301,), (2, 67)],
    }[rows]
    base = 2**32 - 300 if rows == "carry" else 0
    refs, items = _gated_items(seed, shapes, m_fmt, v_fmt, p_dtype, p_dtype, True, base)
    step = MultiStep(
        [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items],
        p_dtype,
        True,
        True,
        True,
        tile=tile,
    )
    assert step.static_aligned == (rows == "aligned") and step.carry == (rows == "carry")
    assert step.wide or rows != "wide"
    counts_ref = _counts_before(len(shapes))
    counts_ker = counts_ref.clone()
    keys, floats = step_tables(items)
    for n, (value, health) in enumerate(
        ((None, True), (float("nan"), True), (0.37, False), (float("-inf"), True), (None, True))
    ):
        gate = None if value is None else _gate(value)
        what = f"{m_fmt}/{v_fmt} {p_dtype} {rows} step {n} gate {value} seed {seed}"
        before = [(i.param.clone(), clone_state(i.m), clone_state(i.v)) for i in items]
        counts_then = counts_ker.clone()
        for (param, m, v), item in zip(refs, items, strict=True):
            row = counts_ref[item.counts_row]
            adamw_step_reference(
                param, item.grad, m, v, item.scalars, item.plan, item.offset, row, health, gate
            )
        staged = step.stage([i.grad for i in items], keys, floats, gate=gate)
        assert staged.gated == (gate is not None), what
        assert step.kernel_constexprs(staged.aligned, health, staged.gated)["STEP"].GATED is (
            gate is not None
        )
        step.run(staged, counts_ker, health)
        assert_launch_equals_spec(refs, items, counts_ref, counts_ker, what)
        if value is not None and not math.isfinite(value):
            _assert_unchanged(before, items, what)
            assert torch.equal(counts_ker, counts_then), what


def test_gates_are_checked():
    """A gate is a 0-d float32 tensor (on the launch's device for the kernels)."""
    from srtrain.kernels.launch import MultiStep, Shard, step_tables

    param, grad, m, v, scalars, plan = _step_case(
        1, (4, 8), "fp8", "bf16", torch.float32, torch.float32, False, 8
    )
    counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    item = StepItem(param, grad, m, v, scalars, plan, 0, 0)
    step = MultiStep([Shard(param, m, v, 0, 0)], torch.float32, False, False, False)
    for bad in (torch.ones(1, device=DEVICE), torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(ValueError, match="a gate must be a 0-d float32 tensor"):
            adamw_step_reference(param, grad, m, v, scalars, plan, 0, counts, grad_scale=bad)
        with pytest.raises(ValueError, match="a gate must be a 0-d float32 tensor"):
            step.stage([grad], *step_tables([item]), gate=bad)
    with pytest.raises(TypeError, match="a gate must be a 0-d float32 tensor"):
        adamw_step_reference(param, grad, m, v, scalars, plan, 0, counts, grad_scale=0.5)
    with pytest.raises(ValueError, match="the gate is on meta"):
        step.stage([grad], *step_tables([item]), gate=torch.tensor(1.0, device="meta"))


def test_wide_rows_are_those_a_tile_wide():
    """A tile of 512 (16 blocks of 32) holds part of one row, or one row masked past its end,
    where rows are over 8 blocks long; shorter rows and 1-D shards (rows of one) share their
    tiles between rows; unscaled states run flat."""
    from srtrain.kernels.launch import MultiStep, Shard, wide_rows

    fp8, fp4, bf16 = get_format("fp8"), get_format("fp4_e2m2"), get_format("bf16")
    for shape, wide in (
        ((4, 512), True),
        ((2, 5461), True),
        ((8, 480), True),
        ((8, 257), True),
        ((4, 256), False),
        ((3, 100), False),
        ((2048,), False),
    ):
        assert wide_rows(shape, (fp8, fp4), 32, tile=512) is wide, shape
        shard = Shard(
            torch.zeros(shape),
            quantize(torch.zeros(shape), "fp8", 32),
            quantize(torch.zeros(shape), "fp4_e2m2", 32),
            0,
            0,
        )
        launch = MultiStep([shard], torch.float32, False, False, False, tile=512)
        assert launch.wide is wide, shape  # the launch compiles by the same rule
    assert wide_rows((2, 64), (fp8, fp8), 16, tile=64)  # four blocks of 16: one tile
    assert not wide_rows((4, 512), (bf16, bf16), 32, tile=512)


def test_tile_spans():
    """A shard draws through span words where every tile starts at a multiple of a power of
    two above every offset in a tile: row tiles of power-of-two extent, flat tiles, not rows
    whose tiles start between multiples; a launch does where all its shards, placed at
    multiples of their spans, do and no index crosses 2**32."""
    from srtrain.kernels.launch import MultiStep, Shard
    from srtrain.kernels.layout import tile_span

    # (rows, cols, bs, blocks a tile, flat) -> span
    assert tile_span(8, 64, 16, 4, False) == 64  # one row a tile
    assert tile_span(3, 128, 16, 4, False) == 64  # two tiles a row
    assert tile_span(16, 16, 16, 4, False) == 64  # four rows a tile
    assert tile_span(5, 32, 16, 4, False) == 64  # two rows a tile
    assert tile_span(1, 40, 16, 4, False) == 64  # one tile, masked past the row
    assert tile_span(2, 48, 16, 4, False) == 0  # the second row starts at 48
    assert tile_span(2, 5461, 32, 16, False) == 0  # row parts start 5461 apart
    assert tile_span(24, 2048, 32, 16, False) == 512
    assert tile_span(1, 300, 256, 1, True) == 256 and tile_span(1, 200, 256, 1, True) == 256
    assert tile_span(1, 5, 256, 1, True) == 8 and tile_span(1, 1, 256, 1, True) == 1
    assert tile_span(1, 2**20, 16384, 8, True) == 0  # tiles over 2**16
    shape = (8, 64)
    # the last: a multiple of the span whose shard's indices cross 2**32
    for offsets, spans in (
        ((0, 2**16, 64), True),
        ((0, 2**16, 32), False),
        ((0, 2**32 - 64), False),
    ):
        shards = [
            Shard(
                torch.zeros(shape),
                quantize(torch.zeros(shape), "fp8", 16),
                quantize(torch.zeros(shape), "fp8", 16),
                offset,
                i,
            )
            for i, offset in enumerate(offsets)
        ]
        assert MultiStep(shards, torch.float32, True, True, True, tile=64).spans is spans, offsets


@pytest.mark.slow
@pytest.mark.parametrize(
    "m_fmt,v_fmt,p_dtype,tile",
    [
        ("fp8", "fp4_e2m2", torch.bfloat16, 64),
        ("bf16", "bf16", torch.float32, 64),
        ("fp4_e2m1", "fp4_e2m2", torch.float32, None),
        ("fp8", "fp8", torch.bfloat16, None),
    ],
)
def test_launch_through_span_words_matches_spec(m_fmt, v_fmt, p_dtype, tile):
    """Stochastic launches whose shards sit at multiples of their spans draw through span
    words (one xor an element before the mixer's tail) and equal the spec."""
    from srtrain.kernels.launch import MultiStep, Shard, StepItem, fused_adamw_multi_triton

    seed = fresh_seed()
    shapes = [(8, 64), (3, 128), (256,), (2, 4096), (16, 16), (5, 32), (1, 40)]
    counts_ref = torch.zeros(len(shapes), NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    counts_ker = torch.zeros_like(counts_ref)
    refs, items = [], []
    for i, shape in enumerate(shapes):
        param, grad, m, v, scalars, plan = _step_case(
            seed + i, shape, m_fmt, v_fmt, p_dtype, torch.float32, True, block=16
        )
        p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
        offset = (3 * i + 1) << 16
        adamw_step_reference(param, grad, m, v, scalars, plan, offset, counts_ref[i])
        refs.append((param, m, v))
        items.append(StepItem(p2, grad, m2, v2, scalars, plan, offset, i))
    launch = MultiStep(
        [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items],
        torch.float32,
        True,
        True,
        True,
        tile=tile,
    )
    assert launch.spans, f"{m_fmt}/{v_fmt} tile {tile}"
    fused_adamw_multi_triton(items, counts_ker, tile=tile)
    assert_launch_equals_spec(
        refs, items, counts_ref, counts_ker, f"{m_fmt}/{v_fmt} {p_dtype} tile {tile} seed {seed}"
    )


def test_count_forms_and_run_lengths():
    """Block-scaled steps sum counts per thread over the lanes each thread holds along a
    tile row; unscaled steps keep per-lane count words."""
    from srtrain.kernels.launch_plan import run_length
    from srtrain.kernels.state_codes import FAMILIES
    from srtrain.kernels.tile import packed_counts
    from srtrain.numerics.formats import get_format

    def packed(m_fmt, v_fmt):
        m, v = get_format(m_fmt), get_format(v_fmt)
        return packed_counts(FAMILIES[m.family], FAMILIES[v.family])

    assert not packed("fp8", "fp8") and not packed("bf16", "fp8")
    assert packed("fp32", "fp32") and packed("bf16", "bf16")
    assert not packed("fp8", "fp4_e2m2") and not packed("fp4_e2m1", "fp4_e2m2")
    assert run_length(16, 32, 2) == 8  # 512-element tiles of 2 warps: eight a thread
    assert run_length(4, 256, 8) == 4  # unscaled 1024-element tiles of 8 warps
    assert run_length(2, 16, 2) == 1  # fewer elements than threads
    assert run_length(64, 16, 1) == 16  # no more than a row


def test_resident_programs_floor_warps_to_fours():
    """A multiprocessor holds the programs whose warps fit in whole fours: each scheduler
    owns a quarter of the register file."""
    from srtrain.kernels.launch import resident_programs

    assert resident_programs(128, 2) == 8  # 16 warps of 4096 registers
    assert resident_programs(126, 2) == 8  # allocated as 128
    assert resident_programs(112, 2) == 8  # 18 warps' registers, 16 warps
    assert resident_programs(104, 2) == 8
    assert resident_programs(96, 2) == 10  # 21 warps' registers, 20 warps
    assert resident_programs(80, 8) == 3  # 24 warps
    assert resident_programs(32, 2) == 32  # the programs' limit
    assert resident_programs(16, 8) == 8  # the threads' limit
    assert resident_programs(255, 8) == 1  # never none


@pytest.mark.slow
@pytest.mark.parametrize(
    "m_fmt,v_fmt,p_dtype,stochastic,tile,tuning",
    [
        ("bf16", "bf16", torch.float32, True, None, {}),
        ("fp8", "fp4_e2m2", torch.bfloat16, True, None, {}),
        ("fp4_e2m1", "fp8", torch.float32, False, None, {}),
        ("fp32", "bf16", torch.bfloat16, False, None, {}),
        ("bf16", "bf16", torch.float32, True, 256, {}),
        ("fp8", "fp4_e2m2", torch.float32, True, 64, {}),
        ("fp4_e2m1", "fp4_e2m2", torch.bfloat16, True, 32, {}),
        ("fp4_e2m1", "fp4_e2m2", torch.float32, True, "aligned", {}),
        ("fp8", "fp8", torch.float32, False, "aligned", {"l2_every_thread": True}),
        ("fp8", "fp4_e2m2", torch.bfloat16, True, "wide", {}),
        ("fp4_e2m1", "fp4_e2m2", torch.float32, False, None, {"num_warps": 4, "max_registers": 80}),
        ("fp8", "fp8", torch.float32, True, 2048, {"num_warps": 8, "max_registers": 128}),
        ("fp8", "fp8", torch.float32, True, "wide", {"line_stores": True}),
        ("fp4_e2m1", "fp4_e2m2", torch.float32, False, "wide", {"line_stores": False}),
    ],
)
def test_multi_tensor_launch_matches_spec(m_fmt, v_fmt, p_dtype, stochastic, tile, tuning):
    """One launch over shards of different shapes equals the spec on each, counts per row;
    small tiles make programs run across several tiles and shards. "aligned" launches shards
    whose rows all allow the vectorised accesses, in tiles of 64 elements; "wide" launches
    shards whose rows are all at least a tile long. Some stochastic launches place their
    shards where global indices cross 2**32 (the index's high word changes inside a shard).
    ``tuning`` makes launch plan choices away from the plan's own, which must not change
    results."""
    from srtrain.kernels.launch import (
        MultiStep,
        Shard,
        StepItem,
        fused_adamw_multi_triton,
        shards_plan,
    )
    from srtrain.kernels.launch_plan import keeps_table
    from srtrain.kernels.layout import aligned_shard

    seed = fresh_seed()
    shapes = [(37, 45), (301,), (0, 8), (3, 5, 11), (4, 128), (2, 67), (1,)]
    aligned = tile == "aligned"
    wide = tile == "wide"
    if aligned:
        shapes, tile = [(16, 64), (4, 128), (0, 16), (2, 4096), (8, 16)], 64
    if wide:
        shapes, tile = [(3, 64), (2, 200), (5, 131), (1, 97)], 64
    base = 2**32 - 300 if stochastic and tile in (None, 64) else 0
    counts_ref = torch.zeros(len(shapes), NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    counts_ker = torch.zeros_like(counts_ref)
    refs, items = [], []
    for i, shape in enumerate(shapes):
        param, grad, m, v, scalars, _ = _step_case(
            seed + i, shape, m_fmt, v_fmt, p_dtype, p_dtype, stochastic, block=16
        )
        scalars = AdamWScalars.make(3e-3, 0.9, 0.999, 1e-8, 0.1 * i, age_m=i + 1, age_v=2 * i + 1)
        plan = RoundingPlan(
            stochastic, stochastic, stochastic, rng_key(seed, 4, i, 1), rng_key(seed, 4, i, 3)
        )
        p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
        adamw_step_reference(param, grad, m, v, scalars, plan, base + 100 * i, counts_ref[i])
        refs.append((param, m, v))
        items.append(StepItem(p2, grad, m2, v2, scalars, plan, base + 100 * i, i))
        assert not aligned or aligned_shard(p2, m2, v2)
    launch = MultiStep(
        [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items],
        p_dtype,
        stochastic,
        stochastic,
        stochastic,
        tile=tile,
    )
    assert launch.wide == wide and launch.carry == (base > 0)
    scaled = get_format(m_fmt).scaled or get_format(v_fmt).scaled
    assert (launch.plan.num_warps, launch.plan.max_registers) == ((2, 128) if scaled else (8, 80))
    uncapped = shards_plan(launch.shards, p_dtype, stochastic, num_warps=2, max_registers=None)
    assert (
        MultiStep(launch.shards, p_dtype, stochastic, stochastic, stochastic, plan=uncapped).plan
        == uncapped
    )
    assert (uncapped.num_warps, uncapped.max_registers) == (2, None)
    assert launch.flat == (not scaled)  # flat launches load each tile a tile ahead
    four_bit = "fp4" in m_fmt + v_fmt
    for aligned_rows in (True, False):
        assert keeps_table(scaled, stochastic, 80, four_bit, aligned_rows) == (
            not scaled or stochastic
        )
        assert keeps_table(scaled, stochastic, 64, four_bit, aligned_rows) == (not scaled)
        assert keeps_table(scaled, stochastic, 128, four_bit, aligned_rows) == (
            not scaled or stochastic or (aligned_rows and not four_bit)
        )
    with pytest.raises(ValueError, match="num_warps must be"):
        shards_plan(launch.shards, p_dtype, True, num_warps="few")
    with pytest.raises(ValueError, match="max_registers must be"):
        shards_plan(launch.shards, p_dtype, True, max_registers="many")
    for removed in ("prefetch", "full_tiles"):
        with pytest.raises(ValueError, match=f"unknown launch choice '{removed}'"):
            shards_plan(launch.shards, p_dtype, True, **{removed: True})
    with pytest.raises(ValueError, match="a tile or a plan"):
        MultiStep(launch.shards, p_dtype, True, True, True, tile=64, plan=uncapped)
    if tuning:
        fused_adamw_multi_triton(
            items,
            counts_ker,
            plan=shards_plan(launch.shards, p_dtype, stochastic, tile=tile, **tuning),
        )
    else:
        fused_adamw_multi_triton(items, counts_ker, tile=tile)
    assert_launch_equals_spec(
        refs, items, counts_ref, counts_ker, f"{m_fmt}/{v_fmt} {p_dtype} tile {tile} seed {seed}"
    )


def _launch_flag(
    flag: str,
    shape: tuple[int, ...],
    m_fmt: str,
    v_fmt: str,
    dtype: torch.dtype,
    stochastic: bool,
    **launch,
) -> tuple:
    """A compile-time flag of a one-shard launch of ``shape`` for rows with the vectorised
    accesses and for rows without."""
    from srtrain.kernels.launch import MultiStep, Shard, shards_plan

    shard = Shard(
        torch.zeros(shape, dtype=dtype, device=DEVICE),
        quantize(torch.zeros(shape, device=DEVICE), m_fmt, 32),
        quantize(torch.zeros(shape, device=DEVICE), v_fmt, 32),
        0,
        0,
    )
    plan = shards_plan([shard], dtype, stochastic, **launch) if launch else None
    step = MultiStep([shard], dtype, stochastic, stochastic, stochastic, plan=plan)
    return (
        getattr(step.kernel_constexprs(True)["ACCESS"], flag),
        getattr(step.kernel_constexprs(False)["ACCESS"], flag),
    )


def test_quad_loads_go_to_aligned_block_scaled_launches_of_float32_parameters():
    """16-byte PTX loads of the parameter and gradient: compiled GPU launches of aligned
    block-scaled rows of FP32 parameters (the default) or as asked; never unscaled,
    unaligned or interpreted launches, and never BF16 values."""
    from srtrain.kernels.triton_numerics import interpreted

    def quads(m_fmt, v_fmt, dtype=torch.float32, **kw):
        return _launch_flag("quad_loads", (4, 64), m_fmt, v_fmt, dtype, True, **kw)

    gpu = not interpreted()
    assert quads("fp4_e2m1", "fp4_e2m2") == (gpu, False)
    assert quads("fp8", "fp4_e2m2") == (gpu, False)
    assert quads("fp8", "fp8") == (gpu, False)
    assert quads("fp8", "fp8", quad_loads=False) == (False, False)
    assert quads("fp4_e2m1", "fp4_e2m2", torch.bfloat16) == (False, False)
    assert quads("fp8", "fp8", torch.bfloat16, quad_loads=True) == (False, False)
    assert quads("bf16", "bf16", quad_loads=True) == (False, False)
    with pytest.raises(ValueError, match="quad_loads must be"):
        quads("fp8", "fp8", quad_loads=1)


def test_line_stores_go_to_unaligned_launches_of_float32_parameters():
    """A float32 parameter stored through tl.store: compiled GPU launches of block-scaled
    rows without the vectorised accesses, with nearest rounding (the default) or as asked;
    never aligned, unscaled or interpreted launches, nor BF16 parameters."""
    from srtrain.kernels.triton_numerics import interpreted

    def lines(m_fmt, v_fmt, stochastic, dtype=torch.float32, **kw):
        return _launch_flag("line_stores", (2, 512), m_fmt, v_fmt, dtype, stochastic, **kw)

    gpu = not interpreted()
    assert lines("fp8", "fp8", False) == (False, gpu)
    assert lines("fp4_e2m1", "fp4_e2m2", False) == (False, gpu)
    assert lines("fp8", "fp8", True) == (False, False)
    assert lines("fp8", "fp8", True, line_stores=True) == (False, gpu)
    assert lines("fp8", "fp8", False, line_stores=False) == (False, False)
    assert lines("fp8", "fp8", False, torch.bfloat16, line_stores=True) == (False, False)
    assert lines("bf16", "bf16", False) == (False, False)
    with pytest.raises(ValueError, match="line_stores must be"):
        lines("fp8", "fp8", False, line_stores=1)


def test_run_accesses_go_to_full_tiles_of_unaligned_launches():
    """Runs of eight float32 elements in 8-byte pieces: compiled GPU launches of block-scaled
    rows without the vectorised accesses, but for stochastic steps of a 4-bit state (the
    default) or as asked; never aligned, unscaled or interpreted launches, nor launches of
    no float32 values, nor launches without full tiles."""
    from srtrain.kernels.triton_numerics import interpreted

    def runs(m_fmt, v_fmt, stochastic, dtype=torch.float32, **kw):
        return _launch_flag("run_accesses", (2, 512), m_fmt, v_fmt, dtype, stochastic, **kw)

    gpu = not interpreted()
    assert runs("fp8", "fp8", False) == (False, gpu)
    assert runs("fp8", "fp8", True) == (False, gpu)
    assert runs("fp4_e2m1", "fp4_e2m2", False) == (False, gpu)
    assert runs("fp4_e2m1", "fp4_e2m2", True) == (False, False)
    assert runs("fp8", "fp4_e2m2", True) == (False, False)
    assert runs("fp4_e2m1", "fp4_e2m2", True, run_accesses=True) == (False, gpu)
    assert runs("fp8", "fp8", False, run_accesses=False) == (False, False)
    with pytest.raises(ValueError, match="unknown launch choice 'full_tiles'"):
        runs("fp8", "fp8", False, full_tiles=False)  # every launch runs full tiles unmasked
    assert runs("fp8", "fp8", False, torch.bfloat16, run_accesses=True) == (False, False)
    assert runs("bf16", "bf16", False, run_accesses=True) == (False, False)
    with pytest.raises(ValueError, match="run_accesses must be"):
        runs("fp8", "fp8", False, run_accesses="yes")


def test_run_pieces_split_a_run_into_aligned_accesses():
    """Each place a run of eight 4-byte elements can start in an 8-byte window splits it
    into accesses that cover it once, in order, each of two elements 8-byte aligned."""
    from srtrain.kernels.memory import run_access_ptx, run_pieces

    for place in (0, 4):
        pieces = run_pieces(place)
        covered = [first + i for first, count in pieces for i in range(count)]
        assert covered == list(range(8)), place
        assert all((place + 4 * first) % 8 == 0 for first, count in pieces if count == 2)
        assert all(count in (1, 2) for _, count in pieces)
    for store in (False, True):
        ptx = run_access_ptx(store)
        assert ptx.count("st.global" if store else "ld.global") == 9
        assert ("ld.global" in ptx) != store


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
def test_run_accesses_equal_the_spec_and_fall_back_when_refused(monkeypatch):
    """Asked for on stochastic FP4 rows of odd length (not the default), the run accesses
    give the spec's bits from every place in a 16-byte window; a compiled kernel whose runs
    the layout check refuses warns and launches one element at a time, with the same
    bits."""
    from srtrain.kernels import launch as launch_module
    from srtrain.kernels.launch import MultiStep, Shard, StepItem, shards_plan, step_tables

    seed = fresh_seed()
    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(launch_module, "runs_in_order", lambda ttgir: False)
        for i, (shape, p_skip, g_skip) in enumerate((((3, 2051), 1, 2), ((2, 1029), 3, 0))):
            what = f"{shape} refused={refuse} seed {seed}"
            param, grad, m, v, scalars, plan = _step_case(
                seed + i,
                shape,
                "fp4_e2m1",
                "fp4_e2m2",
                torch.float32,
                torch.float32,
                True,
                block=32,
            )
            param, grad = _shifted(param, p_skip), _shifted(grad, g_skip)
            counts_ref = torch.zeros(1, NUM_COUNTS, dtype=torch.int64, device=DEVICE)
            counts_ker = torch.zeros_like(counts_ref)
            p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
            adamw_step_reference(param, grad, m, v, scalars, plan, 0, counts_ref[0])
            item = StepItem(p2, grad, m2, v2, scalars, plan, 0, 0)
            shard = Shard(p2, m2, v2, 0, 0)
            step = MultiStep(
                [shard],
                torch.float32,
                True,
                True,
                True,
                plan=shards_plan([shard], torch.float32, True, run_accesses=True),
            )
            if refuse:
                with pytest.warns(RuntimeWarning, match="run_accesses=False"):
                    step.launch([grad], *step_tables([item]), counts_ker)
            else:
                step.launch([grad], *step_tables([item]), counts_ker)
            assert step.plan.unaligned.run_accesses != refuse
            assert_launch_equals_spec([(param, m, v)], [item], counts_ref, counts_ker, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
def test_quad_loads_refused_fall_back_to_tl_load(monkeypatch):
    """A compiled kernel whose 16-byte PTX loads the layout check refuses is not launched: a
    warning, and the launch with tl.load equals the spec. The check is made to refuse every
    layout (the compiler's own layouts pass it; the bench tests refuse a real kernel's IR
    whose loads are laid out one element a thread)."""
    from srtrain.kernels import launch as launch_module
    from srtrain.kernels.launch import MultiStep, Shard, StepItem, shards_plan, step_tables

    seed = fresh_seed()
    param, grad, m, v, scalars, plan = _step_case(
        seed, (64, 256), "fp4_e2m1", "fp4_e2m2", torch.float32, torch.float32, True, block=32
    )
    counts_ref = torch.zeros(1, NUM_COUNTS, dtype=torch.int64, device=DEVICE)
    counts_ker = torch.zeros_like(counts_ref)
    p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
    p3, m3, v3 = param.clone(), clone_state(m), clone_state(v)
    adamw_step_reference(param, grad, m, v, scalars, plan, 0, counts_ref[0])
    item = StepItem(p2, grad, m2, v2, scalars, plan, 0, 0)
    shard = Shard(p2, m2, v2, 0, 0)
    step = MultiStep(
        [shard],
        torch.float32,
        True,
        True,
        True,
        plan=shards_plan([shard], torch.float32, True, quad_loads=True),
    )
    monkeypatch.setattr(launch_module, "quads_in_order", lambda ttgir: False)
    with pytest.warns(RuntimeWarning, match="quad_loads=False"):
        step.launch([grad], *step_tables([item]), counts_ker)
    assert not step.plan.aligned.quad_loads
    assert_launch_equals_spec(
        [(param, m, v)], [item], counts_ref, counts_ker, f"fp4 quad loads refused, seed {seed}"
    )
    # the default takes the fallback without a word
    item = StepItem(p3, grad, m3, v3, scalars, plan, 0, 0)
    quiet = MultiStep([Shard(p3, m3, v3, 0, 0)], torch.float32, True, True, True)
    assert quiet.plan.aligned.quad_loads
    counts_quiet = torch.zeros_like(counts_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.launch([grad], *step_tables([item]), counts_quiet)
    assert not quiet.plan.aligned.quad_loads
    assert_launch_equals_spec(
        [(param, m, v)],
        [item],
        counts_ref,
        counts_quiet,
        f"fp4 quad loads refused quietly, seed {seed}",
    )


@pytest.mark.parametrize(
    "m_fmt,v_fmt", [("fp32", "fp32"), ("fp8", "fp8"), ("fp4_e2m1", "fp4_e2m2")]
)
def test_square_roots_four_at_a_time_equal_the_spec(m_fmt, v_fmt):
    """Launches take square roots four at a time (one range test, one branch to the
    correctly rounded instruction for all four) and equal the spec, where the second moments
    of neighbouring elements mix values inside the fast range with zeros, subnormals, values
    under 2**-101, ±Inf and NaN."""
    from srtrain.kernels.launch import Shard, StepItem, fused_adamw_multi_triton, shards_plan

    seed = fresh_seed()
    shape = (8, 64)
    # g**2 * (1 - beta2) over zero states: 0, subnormal, under 2**-101, in range, Inf, NaN
    specials = torch.tensor([0.0, 1e-20, 1e-15, 1e-3, 3e-18, float("inf"), float("nan"), 2e19])
    for stochastic in (False, True):
        param, grad, m, v, scalars, plan = _step_case(
            seed, shape, m_fmt, v_fmt, torch.float32, torch.float32, stochastic, block=16
        )
        g = torch.Generator().manual_seed(seed + 1)
        picks = torch.randint(0, len(specials), shape, generator=g)
        keep = torch.rand(shape, generator=g) < 0.5
        grad = torch.where(
            keep.to(DEVICE),
            grad,
            (specials[picks] * torch.sign(torch.randn(shape, generator=g))).to(DEVICE),
        )
        m = quantize(torch.zeros(shape, device=DEVICE), m_fmt, 16)
        v = quantize(torch.zeros(shape, device=DEVICE), v_fmt, 16)
        counts_ref = torch.zeros(1, NUM_COUNTS, dtype=torch.int64, device=DEVICE)
        counts_ker = torch.zeros_like(counts_ref)
        p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
        adamw_step_reference(param, grad, m, v, scalars, plan, 0, counts_ref[0])
        item = StepItem(p2, grad, m2, v2, scalars, plan, 0, 0)
        fused_adamw_multi_triton([item], counts_ker)
        assert_launch_equals_spec(
            [(param, m, v)],
            [item],
            counts_ref,
            counts_ker,
            f"{m_fmt}/{v_fmt} sr={stochastic} seed {seed}",
        )
    with pytest.raises(ValueError, match="unknown launch choice 'grouped_sqrt'"):
        shards_plan([Shard(p2, m2, v2, 0, 0)], torch.float32, False, grouped_sqrt=False)


def test_l2_prefetch_ranges_and_defaults():
    """Each tile's L2 prefetch covers its bytes: bulk prefetches of the tile's length where
    the launch promises 16-byte alignment, else a range from the aligned 16 bytes holding
    the first byte through those holding the last; scale bytes by their lines. Only
    block-scaled launches of FP32 parameters prefetch by default, on aligned rows and, with
    nearest rounding, on rows of odd length; from every thread where they round a 4-bit
    state stochastically."""
    import re

    from srtrain.kernels.launch import Shard, shards_plan
    from srtrain.kernels.launch_plan import launch_plan
    from srtrain.kernels.memory import tile_prefetch_ptx

    def default_l2_ahead(scaled, dtype, aligned, stochastic):
        fmt = get_format("fp8" if scaled else "bf16")
        plan = launch_plan([(4, 4096)], dtype, dtype, fmt, fmt, 32, stochastic, hardware=True)
        return int(plan.access(aligned).l2_ahead)

    def default_l2_every_thread(stochastic, m_bits, v_bits):
        fmts = {4: ("fp4_e2m1", "fp4_e2m2"), 8: ("fp8", "fp8")}
        return launch_plan(
            [(4, 4096)],
            torch.float32,
            torch.float32,
            get_format(fmts[m_bits][0]),
            get_format(fmts[v_bits][1]),
            32,
            stochastic,
            hardware=True,
        ).l2_every_thread

    for stochastic in (False, True):
        assert default_l2_ahead(True, torch.float32, True, stochastic) == 1
        assert default_l2_ahead(True, torch.bfloat16, True, stochastic) == 0
        assert default_l2_ahead(False, torch.float32, True, stochastic) == 0
    assert default_l2_ahead(True, torch.float32, False, False) == 1
    assert default_l2_ahead(True, torch.float32, False, True) == 0
    assert default_l2_every_thread(True, 4, 4) and default_l2_every_thread(True, 8, 4)
    assert not any(
        default_l2_every_thread(stochastic, m_bits, v_bits)
        for stochastic, m_bits, v_bits in (
            (False, 4, 4),
            (True, 8, 8),
            (False, 8, 4),
            (False, 8, 8),
        )
    )
    fp8, fp4, bf16 = get_format("fp8"), get_format("fp4_e2m2"), get_format("bf16")
    aligned = tile_prefetch_ptx(16, 32, 4, 4, fp8, fp8, True)
    for operand, size in ((1, 2048), (2, 2048), (3, 512), (5, 512)):
        assert f"@q cp.async.bulk.prefetch.L2.global [${operand}], {size};" in aligned
    for operand in (4, 6):  # 16 scale bytes: the lines of the first and the last
        assert f"prefetch.global.L2 [${operand}]; @q prefetch.global.L2 [${operand}+15];" in aligned
    every = tile_prefetch_ptx(16, 32, 4, 4, fp8, fp8, True, every_thread=True)
    assert "@q" not in every and "setp" not in every
    assert every.replace(" ", "") == re.sub(r"setp\.eq\.u32 q, t, \d; |@q ", "", aligned).replace(
        " ", ""
    )
    flat = tile_prefetch_ptx(4, 256, 2, 2, bf16, bf16, True)
    assert "$4" not in flat and "$6" not in flat and "[$3], 2048;" in flat
    for ptx, sizes in (
        (tile_prefetch_ptx(16, 32, 4, 2, fp4, fp8, True), {256}),
        (tile_prefetch_ptx(16, 32, 2, 2, fp8, fp4, False), {1024, 512, 256}),
    ):
        pads = {int(n) - 15 for n in re.findall(r"add\.u32 s, o, (\d+);", ptx)}
        assert pads == sizes
        for size in sizes:
            for address in range(64, 96):
                first = address & -16
                length = (address - first + size + 15) & -16
                assert first <= address and address + size <= first + length
                assert first + length == ((address + size - 1) | 15) + 1
    shard = Shard(
        torch.zeros(4, 64),
        quantize(torch.zeros(4, 64), "fp8", 32),
        quantize(torch.zeros(4, 64), "fp8", 32),
        0,
        0,
    )
    for bad in (-1, True, "far", 2):  # one tile ahead or none
        with pytest.raises(ValueError, match="l2_ahead must be"):
            shards_plan([shard], torch.float32, False, l2_ahead=bad)
    with pytest.raises(ValueError, match="l2_every_thread must be"):
        shards_plan([shard], torch.float32, False, l2_every_thread=1)


@pytest.mark.skipif(DEVICE != "cuda", reason="L2 prefetches are GPU instructions")
@pytest.mark.parametrize(
    "m_fmt,v_fmt,stochastic",
    [
        ("fp8", "fp8", False),
        ("fp8", "fp8", True),
        ("fp4_e2m1", "fp4_e2m2", True),
        ("fp8", "fp4_e2m2", False),
    ],
)
def test_l2_prefetch_leaves_results_unchanged(m_fmt, v_fmt, stochastic):
    """Launches that prefetch the next tile, from one thread per array or from every
    thread, equal the spec, over programs that run many tiles of several shards, rows that
    end inside a tile (their prefetch runs on into the next row) and shards whose last tile
    is partial."""
    from srtrain.kernels.launch import (
        MultiStep,
        Shard,
        StepItem,
        fused_adamw_multi_triton,
        shards_plan,
    )

    seed = fresh_seed()
    shapes = [(300, 1040), (77, 4096), (5, 64), (129, 96), (33, 80)]
    for ahead, every_thread in ((1, False), (1, True)):
        counts_ref = torch.zeros(len(shapes), NUM_COUNTS, dtype=torch.int64, device=DEVICE)
        counts_ker = torch.zeros_like(counts_ref)
        refs, items = [], []
        for i, shape in enumerate(shapes):
            param, grad, m, v, scalars, plan = _step_case(
                seed + i, shape, m_fmt, v_fmt, torch.float32, torch.float32, stochastic, block=16
            )
            p2, m2, v2 = param.clone(), clone_state(m), clone_state(v)
            adamw_step_reference(param, grad, m, v, scalars, plan, 10**6 * i, counts_ref[i])
            refs.append((param, m, v))
            items.append(StepItem(p2, grad, m2, v2, scalars, plan, 10**6 * i, i))
        shards = [Shard(i.param, i.m, i.v, i.offset, i.counts_row) for i in items]
        plan = shards_plan(
            shards, torch.float32, stochastic, tile=64, l2_ahead=ahead, l2_every_thread=every_thread
        )
        launch = MultiStep(shards, torch.float32, stochastic, stochastic, stochastic, plan=plan)
        assert launch.wide and launch.kernel_constexprs(True)["ACCESS"].l2_ahead == ahead
        assert MultiStep(
            launch.shards, torch.float32, stochastic, stochastic, stochastic, tile=64
        ).plan.aligned.l2_ahead
        fused_adamw_multi_triton(items, counts_ker, plan=plan)
        assert_launch_equals_spec(
            refs,
            items,
            counts_ref,
            counts_ker,
            f"{m_fmt}/{v_fmt} ahead {ahead} every thread {every_thread} seed {seed}",
        )


def test_a_format_the_kernels_do_not_implement_is_refused_at_construction():
    """An E5M2 state (a registry outsider, or one posing under the name fp8) is refused
    with one line before a launch is built, never decoded as E4M3; so is its cast."""
    from dataclasses import replace

    from srtrain.kernels.cast import quantize_triton
    from srtrain.kernels.launch import MultiStep, Shard
    from srtrain.numerics.formats import Format
    from srtrain.numerics.rounding import empty_state

    e5m2 = Format("fp8_e5m2", "e5m2", 8, 2, -14, 15, 3, signed=True, scaled=True)
    posing = replace(get_format("fp8"), fraction_bits=2, min_exp=-14, max_exp=15, max_fraction=3)
    shape = (4, 64)
    for fmt in (e5m2, posing):
        shard = Shard(
            torch.zeros(shape),
            empty_state(fmt, shape, 32, "cpu"),
            empty_state("fp8", shape, 32, "cpu"),
            0,
            0,
        )
        with pytest.raises(ValueError, match=f"no codes for state format {fmt.name} ") as err:
            MultiStep([shard], torch.float32, True, True, True)
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError, match="no codes for state format"):
            quantize_triton(torch.zeros(shape), fmt, 32)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_shadow_update_kernel_matches_spec(grad_dtype):
    """One launch over parameters of odd sizes and samples (one past a program's BLOCK, one
    empty) with NaN, ±Inf, subnormals and zeros in gradients and moments, each group's betas."""
    from srtrain.kernels.shadow_update import BLOCK, ShadowUpdate
    from srtrain.numerics.adamw import shadow_moments_reference

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    numels, samples = [37 * 45, 301, 5000, 64], [45, 7, BLOCK + 13, 0]
    betas = [(0.9, 0.999), (0.8, 0.95), (0.9, 0.999), (0.5, 0.5)]
    grads = [nasty_values((n,), seed + i).to(grad_dtype).to(DEVICE) for i, n in enumerate(numels)]
    indices = [
        torch.randperm(n, generator=g)[:k].sort().values.to(DEVICE)
        for n, k in zip(numels, samples, strict=True)
    ]
    ms = [nasty_values((k + 3,), seed + 10 + i).to(DEVICE) for i, k in enumerate(samples)]
    vs = [nasty_values((k + 3,), seed + 20 + i).abs().to(DEVICE) for i, k in enumerate(samples)]
    expected_m, expected_v = [m.clone() for m in ms], [v.clone() for v in vs]
    for i, (b1, b2) in enumerate(betas):
        k = samples[i]
        shadow_moments_reference(
            [grads[i][indices[i]]], [expected_m[i][:k]], [expected_v[i][:k]], b1, b2
        )
    update = ShadowUpdate(indices, ms, vs, betas, [grad_dtype] * len(grads))
    update.run(_addresses(grads))
    for i in range(len(numels)):
        assert_same_bits(ms[i], expected_m[i], f"m {i} (seed {seed})")
        assert_same_bits(vs[i], expected_v[i], f"v {i} (seed {seed})")


def test_shadow_update_refuses_what_it_cannot_run():
    from srtrain.kernels.shadow_update import ShadowUpdate

    index = torch.arange(4, device=DEVICE)
    m, v = torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE)
    fp32 = [torch.float32]
    with pytest.raises(ValueError, match="float32 over the sample"):
        ShadowUpdate([index], [m[:3]], [v], [(0.9, 0.999)], fp32)
    with pytest.raises(ValueError, match="int64"):
        ShadowUpdate([index.int()], [m], [v], [(0.9, 0.999)], fp32)
    with pytest.raises(ValueError, match="gradient dtype per parameter"):
        ShadowUpdate([index], [m], [v], [(0.9, 0.999)], [])
    for dtype in (torch.float64, torch.float16):
        with pytest.raises(ValueError, match=str(dtype).split(".")[-1]):
            ShadowUpdate([index], [m], [v], [(0.9, 0.999)], [dtype])
    update = ShadowUpdate([index], [m], [v], [(0.9, 0.999)], fp32)
    with pytest.raises(ValueError, match="needs 1 gradient addresses"):
        update.run(_addresses([]))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_gated_shadow_update_matches_gated_spec(grad_dtype):
    """Every gate on one launch over parameters of odd samples (one past a program's BLOCK,
    one empty) with NaN and ±Inf among the gradients: the kernel equals the gated spec bit
    for bit, a non-finite gate leaves every shadow as it was, and no gate equals the
    ungated spec."""
    from srtrain.kernels.shadow_update import BLOCK, ShadowUpdate
    from srtrain.numerics.adamw import shadow_moments_reference

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    numels, samples = [37 * 45, 5000, 64], [45, BLOCK + 13, 0]
    betas = [(0.9, 0.999), (0.8, 0.95), (0.5, 0.5)]
    grads = [nasty_values((n,), seed + i).to(grad_dtype).to(DEVICE) for i, n in enumerate(numels)]
    indices = [
        torch.randperm(n, generator=g)[:k].sort().values.to(DEVICE)
        for n, k in zip(numels, samples, strict=True)
    ]
    ms = [nasty_values((k + 3,), seed + 10 + i).to(DEVICE) for i, k in enumerate(samples)]
    vs = [nasty_values((k + 3,), seed + 20 + i).abs().to(DEVICE) for i, k in enumerate(samples)]
    expected_m, expected_v = [m.clone() for m in ms], [v.clone() for v in vs]
    update = ShadowUpdate(indices, ms, vs, betas, [grad_dtype] * len(grads))
    for value in [None, *GATES]:
        gate = None if value is None else _gate(value)
        before = [t.clone() for t in ms + vs]
        for i, (b1, b2) in enumerate(betas):
            k = samples[i]
            shadow_moments_reference(
                [grads[i][indices[i]]], [expected_m[i][:k]], [expected_v[i][:k]], b1, b2, gate
            )
        update.run(_addresses(grads), gate=gate)
        for i in range(len(numels)):
            assert_same_bits(ms[i], expected_m[i], f"m {i} gate {value} (seed {seed})")
            assert_same_bits(vs[i], expected_v[i], f"v {i} gate {value} (seed {seed})")
        if value is not None and not math.isfinite(value):
            for old, new in zip(before, ms + vs, strict=True):
                assert_same_bits(new, old, f"gate {value} (seed {seed})")
    with pytest.raises(ValueError, match="a gate must be a 0-d float32 tensor"):
        update.run(_addresses(grads), gate=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="the gate is on meta"):
        update.run(_addresses(grads), gate=torch.tensor(1.0, device="meta"))


def test_sampled_states_read_matches_dequantize():
    """One reader over every state pair (a launch each), parameters of odd shapes (1-D, rows
    of odd length, a sample one past a program's BLOCK, an empty one) and block sizes, with
    NaN blocks, zeros, subnormal and huge values: the decoded values at the sampled elements
    are those of the spec's dequantize, and the shadows come beside them; a second read sees
    states changed in place."""
    from srtrain.kernels.sampled_states import BLOCK, SampledRead, SampledStates
    from srtrain.numerics.formats import SCALE_BIAS, STATE_PAIRS

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 45), (301,), (2, BLOCK + 40), (3, 5, 33), (6, 7)]
    reads, expected = [], [[], [], [], []]
    for i, (m_fmt, v_fmt) in enumerate(STATE_PAIRS):
        shape = shapes[i % len(shapes)]
        block_size = (8, 32, 16)[i % 3]
        numel = math.prod(shape)
        count = numel if i % 5 == 2 else int(torch.randint(1, numel, (1,), generator=g))
        count = 0 if i == 4 else count
        elements = torch.randperm(numel, generator=g)[:count].sort().values
        states = [
            quantize(
                nasty_values(shape, seed + 2 * i + j).abs()
                if j
                else nasty_values(shape, seed + 2 * i),
                fmt,
                block_size,
                "stochastic",
                rng_key(seed, i, j, 0),
            )
            for j, fmt in enumerate((m_fmt, v_fmt))
        ]
        shadows = [nasty_values((count + 3,), seed + 100 + 2 * i + j) for j in range(2)]
        for j, state in enumerate(states):
            expected[j].append(dequantize(state).reshape(-1)[elements])
            expected[2 + j].append(shadows[j][:count])
        on_device = [
            StoredState(
                s.fmt,
                s.codes.to(DEVICE),
                None if s.scales is None else s.scales.to(DEVICE),
                s.shape,
                s.block_size,
            )
            for s in states
        ]
        reads.append(SampledRead(elements.to(DEVICE), *on_device, *(s.to(DEVICE) for s in shadows)))
    reader = SampledStates(reads)
    values = reader.read().cpu()
    names = ("m", "v", "shadow m", "shadow v")
    for row, (name, column) in enumerate(zip(names, expected, strict=True)):
        assert_same_bits(values[row], torch.cat(column), f"{name} (seed {seed})")
    for read in reads:
        read.m.codes.zero_()
        if read.m.scales is not None:
            read.m.scales.fill_(SCALE_BIAS)  # scale 1: no NaN block
        read.shadow_v.fill_(2.0)
    values = reader.read()
    assert torch.all(values[0] == 0) and torch.all(values[3] == 2.0)


def test_sampled_states_read_refuses_what_it_cannot_read():
    from srtrain.kernels.sampled_states import SampledRead, SampledStates

    state = quantize(torch.ones(4, 8), "fp8", 8)
    other = quantize(torch.ones(4, 8), "fp8", 16)
    index, shadow = torch.arange(3), torch.zeros(3)
    with pytest.raises(ValueError, match="at least one"):
        SampledStates([])
    with pytest.raises(ValueError, match="int64"):
        SampledStates([SampledRead(index.int(), state, state, shadow, shadow)])
    with pytest.raises(ValueError, match="float32 over the sample"):
        SampledStates([SampledRead(index, state, state, shadow[:2], shadow)])
    with pytest.raises(ValueError, match="block size"):
        SampledStates([SampledRead(index, state, other, shadow, shadow)])
