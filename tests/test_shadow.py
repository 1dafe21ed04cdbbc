"""The sampled FP32 shadow of m and v: its sample, what it measures, and exact resume."""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from srtrain.checkpoint import checkpoint_dirs
from srtrain.cli import main
from srtrain.config import ConfigError, load_config
from srtrain.metrics import read_records
from srtrain.optim import SRAdamW
from srtrain.optim.shadow import capacity, report, sampled_blocks, sampled_elements

from conftest import tiny_overrides
from distributed import free_port

FORMATS = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp8": ("fp8", "fp8"),
    "fp4": ("fp4_e2m1", "fp4_e2m2"),
}
LABELS = ["mlp", "norms", "embeddings"]
SHADOW_KEYS = [
    "shadow_rel_err_m",
    "shadow_rel_err_v",
    "shadow_bias_m",
    "shadow_bias_v",
    "shadow_update_cosine",
]


@pytest.mark.parametrize(
    "shape,every", [((300, 70), 16), ((129,), 8), ((40, 3, 33), 4), ((512, 64), 1024)]
)
@pytest.mark.parametrize("shards", [2, 3, 7])
def test_sample_does_not_depend_on_sharding(shape, every, shards):
    """FSDP2's dim-0 chunks sample exactly the whole tensor's elements, within capacity."""
    rows, cols = (shape[0], 1) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    whole = sampled_elements(shape, 0, rows, 32, every)
    per_dim0 = rows // shape[0]
    chunk = -(-shape[0] // shards)
    found = []
    for rank in range(shards):
        first, last = min(rank * chunk, shape[0]), min((rank + 1) * chunk, shape[0])
        local = sampled_elements(shape, first * per_dim0, (last - first) * per_dim0, 32, every)
        assert len(local) <= capacity(shape, shards, 32, every)
        found.append(local + first * per_dim0 * cols)
    assert np.array_equal(np.concatenate(found), whole)
    assert len(whole) <= capacity(shape, 1, 32, every)


def test_one_block_in_every_window():
    blocks = sampled_blocks(0, 64 * 100, 64)
    assert np.array_equal(blocks // 64, np.arange(100))
    assert len(set((blocks % 64).tolist())) > 40  # positions are spread, not one column


def _run(
    fmt: str, steps: int = 60, every: int = 4, reset_at: int | None = None
) -> tuple[SRAdamW, dict]:
    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        for shape in ((96, 128), (64,), (50, 40))
    ]
    m_format, v_format = FORMATS[fmt]
    opt = SRAdamW(
        params, lr=1e-3, m_format=m_format, v_format=v_format, shadow_sample=every, backend="torch"
    )
    for step in range(1, steps + 1):
        for p, scale in zip(params, (1e-3, 1e-1, 1e-2), strict=True):
            p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()
        if step == reset_at:
            opt.reset("both")
    return opt, report(opt.shadow_sums(), LABELS)


def test_fp32_states_match_their_shadow_exactly():
    _, drift = _run("fp32", reset_at=30)
    assert set(drift) == {*LABELS, "all"}
    for values in drift.values():
        assert values == {
            "rel_err_m": 0.0,
            "rel_err_v": 0.0,
            "bias_m": 0.0,
            "bias_v": 0.0,
            "update_cosine": 1.0,
        }


def test_coarser_formats_drift_further():
    """BF16 < FP8 < FP4 in relative error, each small and nearly unbiased (stochastic
    rounding), with updates that point nearly the same way as the shadow's."""
    runs = {fmt: _run(fmt)[1] for fmt in ("bf16", "fp8", "fp4")}
    drift = {fmt: run["all"] for fmt, run in runs.items()}
    for which in ("m", "v"):
        errors = [drift[fmt][f"rel_err_{which}"] for fmt in ("bf16", "fp8", "fp4")]
        assert 0 < errors[0] < errors[1] < errors[2] < 0.6, drift
        for run in runs.values():  # 3072 sampled elements: the bias is noise, ~rel_err/40
            assert abs(run["mlp"][f"bias_{which}"]) < 0.2 * run["mlp"][f"rel_err_{which}"], run
    cosines = [drift[fmt]["update_cosine"] for fmt in ("bf16", "fp8", "fp4")]
    assert 1 > cosines[0] > cosines[1] > cosines[2] > 0.85, drift
    assert cosines[0] > 0.999


def test_reset_zeroes_the_shadow_with_the_states():
    opt, _ = _run("bf16", steps=10)
    opt.reset("m")
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert not state["shadow_m"].any() and state["shadow_v"].any()
    drift = report(opt.shadow_sums(), LABELS)["all"]
    assert drift["rel_err_m"] == 0.0 and drift["bias_m"] == 0.0


def test_state_dict_round_trip_keeps_the_shadow():
    opt, drift = _run("fp8", steps=20)
    fresh, _ = _run("fp8", steps=1)
    fresh.load_state_dict(opt.state_dict())
    assert report(fresh.shadow_sums(), LABELS) == drift


def test_off_keeps_no_shadow():
    p = torch.nn.Parameter(torch.zeros(8, 32))
    opt = SRAdamW([p], shadow_sample=0)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.shadow_sums() is None and not any(k.startswith("shadow") for k in opt.state[p])
    with pytest.raises(ValueError, match="shadow_sample"):
        SRAdamW([p], shadow_sample=-1)
    with pytest.raises(ConfigError, match=r"optim\.shadow_sample: must be >= 0"):
        load_config(None, ["optim.shadow_sample=-1"])


def _steps(params: list[torch.Tensor], opt: SRAdamW, place) -> dict:
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        for p, scale in zip(params, (1e-3, 1e-1, 1e-2), strict=True):
            p.grad = place(torch.randn(p.shape, generator=g) * scale)
        opt.step()
    return report(opt.shadow_sums(), LABELS)


def _shapes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) * 0.02 for shape in ((97, 128), (64,), (50, 40))]


def _sharded_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _shapes()]
        opt = SRAdamW(params, m_format="fp8", v_format="fp4_e2m2", shadow_sample=4)
        drift = _steps(params, opt, lambda g: distribute_tensor(g, mesh, [Shard(0)]))
        if rank == 0:
            torch.save(drift, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as in test_optim: skip gloo's teardown, which aborts now and then


@pytest.mark.slow
def test_two_ranks_measure_what_one_does(tmp_path):
    """Sharded over 2 gloo ranks (97 rows: uneven), the shadow samples the same elements and
    reports what one process does (the sums differ only in their order)."""
    out = str(tmp_path / "drift")
    mp.spawn(_sharded_worker, args=(2, free_port(), out), nprocs=2, join=True)
    params = [torch.nn.Parameter(t) for t in _shapes()]
    single = _steps(
        params, SRAdamW(params, m_format="fp8", v_format="fp4_e2m2", shadow_sample=4), lambda g: g
    )
    sharded = torch.load(out, weights_only=False)
    assert sharded.keys() == single.keys()
    for name, values in single.items():
        assert sharded[name] == pytest.approx(values, rel=1e-9, abs=1e-12), name


@pytest.mark.slow
def test_trainer_logs_the_shadow_and_resumes_it_exactly(tiny_data, tmp_path, capsys):
    """metrics.jsonl holds the shadow's values at log steps; a run resumed from its middle
    checkpoint logs the same values bit for bit."""
    kw = {
        "train.steps": 20,
        "train.log_interval": 5,
        "train.val_interval": 0,
        "checkpoint.interval": 10,
        "checkpoint.keep": 3,
        "optim.m_format": "fp8",
        "optim.v_format": "fp4_e2m2",
        "optim.shadow_sample": 64,
    }
    whole = tmp_path / "whole"
    assert main(tiny_overrides(tiny_data, whole, **kw)) == 0
    records = [r for r in read_records(whole) if "shadow_rel_err_m" in r]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for r in records:
        assert 0 < r["shadow_rel_err_m"] < 1 and 0 < r["shadow_rel_err_v"] < 1
        assert 0.5 < r["shadow_update_cosine"] < 1
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for step, path in checkpoint_dirs(resumed):
        if step > 10:
            shutil.rmtree(path)
    assert main(tiny_overrides(tiny_data, resumed, **kw)) == 0
    assert "resumed from step 10" in capsys.readouterr().out
    again = [r for r in read_records(resumed) if "shadow_rel_err_m" in r]
    assert [{k: r[k] for k in SHADOW_KEYS} for r in again] == [
        {k: r[k] for k in SHADOW_KEYS} for r in records
    ]
    # another sample cannot be restored: the shadow restarts from the loaded states
    changed = tmp_path / "changed"
    shutil.copytree(resumed, changed)
    for step, path in checkpoint_dirs(changed):
        if step > 10:
            shutil.rmtree(path)
    assert main(tiny_overrides(tiny_data, changed, **{**kw, "optim.shadow_sample": 16})) == 0
    later = {r["step"]: r for r in read_records(changed) if "shadow_rel_err_m" in r}
    assert 0 < later[15]["shadow_rel_err_m"] < records[2]["shadow_rel_err_m"] * 2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_batched_read_of_the_stored_states_equals_each_parameters(fmt):
    """The log step reads every parameter's sampled stored states in one dequantization per
    kind of row; each parameter gets the bits its own read gives."""
    m_fmt, v_fmt = FORMATS[fmt]
    g = torch.Generator().manual_seed(5)
    shapes = [(40, 96), (7, 96), (33, 50), (129,), (96,), (12, 3, 32)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = SRAdamW(params, m_format=m_fmt, v_format=v_fmt, block_size=16, shadow_sample=2)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-6, 0, ()))
        opt.step()
    group = opt.param_groups[0]
    batched = opt._sampled_stored_many([(group, p) for p in params])
    for p, (m_s, v_s) in zip(params, batched, strict=True):
        m_one, v_one = opt._sampled_stored(group, p)
        assert m_s.numel() > 0
        assert torch.equal(m_s.view(torch.int32), m_one.view(torch.int32)), p.shape
        assert torch.equal(v_s.view(torch.int32), v_one.view(torch.int32)), p.shape
