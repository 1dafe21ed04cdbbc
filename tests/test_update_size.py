"""Re-warmup after resets, and the applied update's size measured against the learning rate."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from srtrain import trainer
from srtrain.cli import main
from srtrain.metrics import read_records
from srtrain.numerics.adamw import AdamWScalars, rewarmup_factor
from srtrain.optim import SRAdamW
from srtrain.optim.update_size import SAMPLE_EVERY, UpdateSizes, sampled_rows

from conftest import tiny_overrides
from numerics_inputs import fresh_seed


def test_rewarmup_factor_follows_the_youngest_reset_state():
    assert rewarmup_factor(step=10, age_m=10, age_v=10, steps=4) == 1.0  # never reset
    assert rewarmup_factor(step=10, age_m=1, age_v=1, steps=4) == 0.25
    assert rewarmup_factor(step=10, age_m=3, age_v=10, steps=4) == 0.75  # m-only reset
    assert rewarmup_factor(step=10, age_m=6, age_v=2, steps=4) == 0.5
    assert rewarmup_factor(step=10, age_m=5, age_v=5, steps=4) == 1.0
    assert rewarmup_factor(step=10, age_m=1, age_v=1, steps=0) == 1.0  # off


def test_scalars_scale_the_step_size_not_the_decay():
    plain = AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.1, 1, 1)
    warm = AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.1, 1, 1, rewarmup=0.25)
    assert warm.step_size == np.float32(plain.step_size * 0.25)
    assert warm.decay == plain.decay
    with pytest.raises(ValueError, match="rewarmup factor"):
        AdamWScalars.make(1e-3, 0.9, 0.999, 1e-8, 0.1, 1, 1, rewarmup=0.0)
    with pytest.raises(ValueError, match="rewarmup must be"):
        SRAdamW([torch.nn.Parameter(torch.zeros(3))], rewarmup=-1)


@pytest.mark.parametrize("first_row", [0, 1, 63, 64, 130])
def test_sampled_rows_depend_on_global_rows_only(first_row):
    whole = set(sampled_rows(0, first_row + 200).tolist())
    # a shard starting at global row first_row samples exactly the whole tensor's rows there
    shard = {first_row + i for i in sampled_rows(first_row, 200).tolist()}
    assert shard == {r for r in whole if r >= first_row}
    assert all(r % SAMPLE_EVERY == 0 for r in shard)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(300, 17), (129,), (70, 5)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(DEVICE)) for s in shapes]


def _grads(params: list[torch.Tensor], seed: int, skip: int | None = None) -> None:
    """Random gradients; parameter ``skip`` gets none (it does not step)."""
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        p.grad = None if i == skip else (torch.randn(p.shape, generator=g) * 1e-2).to(DEVICE)


def _run(
    backend: str,
    rewarmup: int,
    fmt: str,
    steps: int = 7,
    reset_after: dict[int, str] | None = None,
    idle: dict[int, int] | None = None,
) -> tuple[list, dict[int, float]]:
    """Steps of SRAdamW on three parameters, resetting after the steps of ``reset_after``
    and leaving parameter ``idle[step]`` without a gradient; the params and the update RMS
    of every step."""
    params = _params(0)
    m_fmt, v_fmt = ("fp4_e2m1", "fp4_e2m2") if fmt == "fp4" else (fmt, fmt)
    opt = SRAdamW(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
        m_format=m_fmt,
        v_format=v_fmt,
        backend=backend,
        rewarmup=rewarmup,
        eps=1e-12,
    )
    sizes = UpdateSizes(params, ["mlp", "norms", "attention"], [0, 0, 0], DEVICE)
    for step in range(1, steps + 1):
        _grads(params, step, (idle or {}).get(step))
        sizes.before_step()
        opt.step()
        sizes.after_step(step, sizes.hyperparameters(opt))
        if reset_after and step in reset_after:
            opt.reset(reset_after[step])
    return ([p.detach().cpu() for p in params], {s: v["all"] for s, v in sizes.take().items()})


def test_update_rms_is_one_after_a_reset_and_scaled_by_the_rewarmup():
    """At age 1, m̂/√v̂ = g/|g| for every element: the update's RMS is 1 (times the
    re-warmup factor), the burst a reset causes; later steps average noisy gradients."""
    _, plain = _run("torch", 0, "fp32", reset_after={4: "both"})
    _, warm = _run("torch", 4, "fp32", reset_after={4: "both"})
    assert plain[1] == pytest.approx(1.0, abs=1e-5) and plain[5] == pytest.approx(1.0, abs=1e-5)
    assert plain[4] < 0.9
    assert warm[5] == pytest.approx(0.25, abs=1e-5)
    assert warm[6] == pytest.approx(plain[6] * 0.5, rel=0.2)
    assert warm[1] == pytest.approx(1.0, abs=1e-5)  # the start is the schedule's warm-up


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_rewarmup_triton_matches_the_spec_bitwise(fmt):
    """Shards at different re-warmup factors in one launch (a parameter without a gradient
    at step 3 lags the others' step counter and ages) give the spec's bits."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    resets, idle = {2: "m", 4: "both"}, {3: 0, 6: 1}
    ref, ref_sizes = _run("torch", 3, fmt, reset_after=resets, idle=idle)
    fused, fused_sizes = _run("triton", 3, fmt, reset_after=resets, idle=idle)
    for a, b in zip(ref, fused, strict=True):
        assert torch.equal(a, b)
    assert ref_sizes == fused_sizes


@pytest.mark.slow
def test_trainer_logs_the_burst_every_step_after_a_reset(tiny_data, tmp_path, capsys, monkeypatch):
    """metrics.jsonl holds update_rms at log steps and at every step of the watch window
    after the start and after each reset; with resets.rewarmup the first step after a reset
    applies 1/rewarmup of the burst."""
    monkeypatch.setattr(trainer, "UPDATE_WATCH_STEPS", 4)

    def run(name: str, rewarmup: int) -> dict[int, float]:
        args = tiny_overrides(
            tiny_data,
            tmp_path / name,
            **{
                "train.steps": 24,
                "train.log_interval": 8,
                "resets.mode": "periodic",
                "resets.m_period": 16,
                "resets.v_period": 16,
                "resets.rewarmup": rewarmup,
                "train.val_interval": 0,
                "checkpoint.interval": 0,
            },
        )
        assert main(args) == 0
        return {
            r["step"]: r["update_rms"] for r in read_records(tmp_path / name) if "update_rms" in r
        }

    capsys.readouterr()
    plain, warm = run("plain", 0), run("warm", 8)
    assert sorted(plain) == [1, 2, 3, 4, 8, 16, 17, 18, 19, 20, 24]
    # zero-gradient elements (embedding rows of tokens absent from the batch) apply 0
    assert plain[17] > 0.9 and plain[16] < 0.8 * plain[17], plain
    assert warm[17] == pytest.approx(plain[17] / 8, rel=1e-3)
    assert warm[24] == pytest.approx(plain[24], rel=0.3)


def test_update_sizes_equal_the_per_parameter_formula():
    """Parameters of several row lengths (one 1-D, one 3-D, shards starting mid-tensor, one
    with no sampled row) in two layer groups, one at lr 0: each group's RMS is that of
    (p_before · (1 - lr·wd) - p_after) / lr over every 64th global row of the measured ones."""
    g = torch.Generator().manual_seed(fresh_seed())
    shapes = [(300, 17), (129,), (70, 5), (130, 2, 3), (40, 17), (10, 4)]
    offsets = [0, 5 * 64 * 1, 7 * 5, 0, 64 * 17, 3 * 4]  # global first element of each shard
    labels = ["mlp", "norms", "mlp", "attention", "mlp", "attention"]
    params = [(torch.randn(s, generator=g) * 0.02).to(DEVICE) for s in shapes]
    lr_decay = [(1e-2, 0.1), (1e-2, 0.0), (3e-3, 0.1), (1e-2, 0.1), (0.0, 0.1), (1e-2, 0.1)]
    sizes = UpdateSizes(params, labels, offsets, DEVICE)
    before = [p.clone() for p in params]
    sizes.before_step()
    for p in params:
        p.add_(torch.randn(p.shape, generator=g).to(DEVICE) * 1e-3)
    kept = [lr_decay[i] for i in range(len(params)) if len(_rows_of(shapes[i], offsets[i]))]
    sizes.after_step(3, kept)
    sums: dict[str, list[float]] = {}
    for shape, offset, label, b, a, (lr, wd) in zip(
        shapes, offsets, labels, before, params, lr_decay, strict=True
    ):
        rows = _rows_of(shape, offset)
        if lr <= 0 or not len(rows):
            continue
        index = torch.from_numpy(rows).to(DEVICE)
        u = (b.index_select(0, index) * np.float32(1 - lr * wd) - a.index_select(0, index)) / lr
        total = sums.setdefault(label, [0.0, 0])
        total[0] += u.double().square().sum().item()
        total[1] += u.numel()
    measured = sizes.take()[3]
    expected = {k: (sq / n) ** 0.5 for k, (sq, n) in sums.items()}
    expected["all"] = (sum(v[0] for v in sums.values()) / sum(v[1] for v in sums.values())) ** 0.5
    assert measured.keys() == expected.keys()
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=1e-6), key


def _rows_of(shape: tuple[int, ...], offset: int) -> np.ndarray:
    cols = int(np.prod(shape[1:]))
    return sampled_rows(offset // cols, shape[0])
