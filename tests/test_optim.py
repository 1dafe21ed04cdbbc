"""SRAdamW: agreement with torch AdamW, backends, resets, errors, and sharding across ranks."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from srtrain.numerics.adamw import (
    COUNT_M_SCALE_CHANGED,
    COUNT_V_SCALE_CHANGED,
    NUM_COUNTS,
    NUM_STALL_COUNTS,
)
from srtrain.optim import SRAdamW

from distributed import free_port, leave_worker
from numerics_inputs import assert_same_bits

SHAPES = [(7, 12), (12,), (5, 3, 8), (1, 40)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_params(dtype=torch.float32, seed=0, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device, dtype)) for s in SHAPES
    ]


def make_grads(step: int, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return [
        torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-4, 1, (), generator=g))
        for s in SHAPES
    ]


def run_steps(opt, params, steps, seed=0):
    for t in range(steps):
        for p, g in zip(params, make_grads(t, seed), strict=True):
            p.grad = g.to(p.device, p.dtype)
        opt.step()


def test_fp32_states_match_torch_adamw():
    params = make_params()
    ref = copy.deepcopy(params)
    opt = SRAdamW(params, lr=3e-3, weight_decay=0.1, m_format="fp32", v_format="fp32")
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.1)
    run_steps(opt, params, 25)
    run_steps(ref_opt, ref, 25)
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "m_fmt,v_fmt,p_dtype",
    [
        ("bf16", "bf16", torch.float32),
        ("fp8", "fp4_e2m2", torch.bfloat16),
        ("fp4_e2m1", "fp8", torch.float32),
    ],
)
def test_triton_and_torch_backends_agree(m_fmt, v_fmt, p_dtype):
    kw = dict(lr=1e-2, m_format=m_fmt, v_format=v_fmt, block_size=8, seed=3, shadow_sample=2)
    a, b = make_params(p_dtype, device=DEVICE), make_params(p_dtype, device=DEVICE)
    opt_a = SRAdamW(a, backend="torch", **kw)
    opt_b = SRAdamW(b, backend="triton", **kw)
    run_steps(opt_a, a, 4)
    run_steps(opt_b, b, 4)
    if DEVICE == "cuda":  # the later steps called the kernel an earlier one compiled
        assert all(launch.step._launchers for launch in opt_b._plan.launches)
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
    for p, q in zip(a, b, strict=True):
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)
    assert torch.equal(opt_a.take_stall_counts()[0], opt_b.take_stall_counts()[0])
    assert torch.equal(opt_a.shadow_sums(), opt_b.shadow_sums())  # the kernel reads them


def test_shards_whose_rows_cannot_be_vectorised_launch_apart():
    """Scaled shards with rows a multiple of 16 long keep the vectorised launch when others
    in the model are not, and rows a tile wide or more launch apart from narrower ones (on
    the GPU, whose tiles are 512 elements; the interpreter's hold every row here); all the
    launches compute what the spec backend computes."""
    shapes = [(4, 32), (3, 20), (2, 48), (5, 7), (2, 1024), (2, 600), (40,)]
    kw = dict(lr=1e-2, m_format="fp8", v_format="fp4_e2m2", block_size=16, seed=4, shadow_sample=2)
    g = torch.Generator().manual_seed(9)
    init = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    a = [torch.nn.Parameter(t.clone().to(DEVICE)) for t in init]
    b = [torch.nn.Parameter(t.clone().to(DEVICE)) for t in init]
    opt_a, opt_b = SRAdamW(a, backend="torch", **kw), SRAdamW(b, backend="triton", **kw)
    for _ in range(2):
        grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
        for params, opt in ((a, opt_a), (b, opt_b)):
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.to(DEVICE)
            opt.step()
    launches = {
        (launch.step.static_aligned, launch.step.wide): [e.param.shape for e in launch.members]
        for launch in opt_b._plan.launches
    }
    if DEVICE == "cuda":
        assert launches == {
            (True, False): [(4, 32), (2, 48)],
            (True, True): [(2, 1024)],
            (False, False): [(3, 20), (5, 7), (40,)],
            (False, True): [(2, 600)],
        }
    else:
        assert launches == {
            (True, False): [(4, 32), (2, 48), (2, 1024)],
            (False, False): [(3, 20), (5, 7), (2, 600), (40,)],
        }
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)
    assert torch.equal(opt_a.take_stall_counts()[0], opt_b.take_stall_counts()[0])
    assert torch.equal(opt_a.shadow_sums(), opt_b.shadow_sums())  # the kernel reads them


@pytest.mark.slow
def test_fused_launch_tables_follow_gradients_and_loads():
    """The cached launch tables (the shadow's too) are rebuilt when the set of gradients, a
    group's rounding or betas change or a state dict is loaded; results stay equal to the
    spec backend bit for bit."""
    kw = dict(lr=1e-2, m_format="fp8", v_format="bf16", block_size=8, seed=5, shadow_sample=2)
    a, b = make_params(device=DEVICE), make_params(device=DEVICE)
    opt_a, opt_b = SRAdamW(a, backend="torch", **kw), SRAdamW(b, backend="triton", **kw)
    for t in range(6):
        if t == 3:  # the shadow's launch follows the betas
            for opt in (opt_a, opt_b):
                opt.param_groups[0]["betas"] = (0.8, 0.99)
        if t == 4:
            for opt in (opt_a, opt_b):
                opt.param_groups[0]["m_rounding"] = "nearest"
        grads = make_grads(t, seed=2)
        for params in (a, b):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if (t == 2 and i == 1) else g.to(p.device)
        opt_a.step()
        opt_b.step()
        if t == 1:  # load a's state into both: b's tables must point at the new tensors
            saved = copy.deepcopy(opt_a.state_dict())
            opt_a.load_state_dict(copy.deepcopy(saved))
            opt_b.load_state_dict(saved)
            opt_b.param_groups[0]["backend"] = "triton"  # the load set a's
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)
    assert torch.equal(opt_a.take_stall_counts()[0], opt_b.take_stall_counts()[0])


@pytest.mark.slow
def test_prepared_step_equals_step():
    """prepare_step then step computes what step alone does, bit for bit; a new gradient
    tensor, learning rate or counter after the prepare makes the step prepare afresh, and a
    prepare without a step changes nothing."""
    kw = dict(lr=1e-2, m_format="fp8", v_format="fp4_e2m2", block_size=8, seed=6)
    a, b = make_params(device=DEVICE), make_params(device=DEVICE)
    opt_a, opt_b = SRAdamW(a, backend="triton", **kw), SRAdamW(b, backend="triton", **kw)
    stages = []
    stage = opt_b._stage
    opt_b._stage = lambda *args: stages.append(1) or stage(*args)
    for t in range(6):
        for params in (a, b):
            for p, g in zip(params, make_grads(t, seed=3), strict=True):
                p.grad = g.to(DEVICE)
        opt_b.prepare_step()
        if t == 1:
            b[2].grad = b[2].grad.clone()
        if t == 2:
            for opt in (opt_a, opt_b):
                opt.param_groups[0]["lr"] = 5e-3
        if t == 3:
            for opt in (opt_a, opt_b):
                opt.reset("m")
        if t == 4:  # skipped: the prepared step is dropped with the gradients
            opt_b.zero_grad()
            continue
        opt_a.step()
        opt_b.step()
    assert len(stages) == 1 + 2 + 2 + 2 + 1 + 1
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)
    assert torch.equal(opt_a.take_stall_counts()[0], opt_b.take_stall_counts()[0])


@pytest.mark.slow
def test_a_refused_gradient_leaves_the_step_undone():
    """A gradient whose shape no longer matches its shard stops the step before any launch:
    counters, states and parameters stay, and the next step is the one it would have been."""
    kw = dict(lr=1e-2, m_format="fp8", v_format="fp4_e2m2", block_size=8, seed=2)
    a, b = make_params(device=DEVICE), make_params(device=DEVICE)
    opt_a, opt_b = SRAdamW(a, backend="triton", **kw), SRAdamW(b, backend="triton", **kw)
    for t in range(2):
        for params in (a, b):
            for p, g in zip(params, make_grads(t, seed=5), strict=True):
                p.grad = g.to(DEVICE)
        if t == 1:
            good = b[1].grad.data
            b[1].grad.data = good[:1]  # torch checks .grad assignments, not .data swaps
            before = [p.detach().clone() for p in b]
            with pytest.raises(ValueError, match="gradient 1 is"):
                opt_b.step()
            assert all(torch.equal(p, q) for p, q in zip(b, before, strict=True))
            assert int(opt_b.state[b[0]]["step"]) == 1
            b[1].grad.data = good
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)


def test_stall_counts_accumulate_and_reset_on_take():
    params = make_params(torch.bfloat16)
    opt = SRAdamW(
        params,
        m_format="bf16",
        v_format="bf16",
        m_rounding="nearest",
        v_rounding="nearest",
        param_rounding="nearest",
    )
    run_steps(opt, params, 3)
    counts, steps, health_steps = opt.take_stall_counts()
    assert steps == 3 and counts.shape == (len(SHAPES), NUM_COUNTS)
    assert health_steps == 0  # by default no step counts the health counts
    assert int(counts[:, NUM_STALL_COUNTS:].abs().sum()) == 0
    numels = opt.local_numels()
    assert all(int(c.max()) <= 3 * n for c, n in zip(counts, numels, strict=True))
    assert int(counts[:, 2].sum()) > 0  # params changed
    assert opt.local_blocks() == [(0, 0)] * len(SHAPES)  # BF16 states have no blocks
    again, steps, _ = opt.take_stall_counts()
    assert steps == 0 and int(again.sum()) == 0


def test_scale_changes_are_counted_over_each_shards_blocks():
    """Blocks of 8 along each row (the last dim; 1-D shards are rows of one): m in FP32 has
    none; every block of v changes its scale at the first step, from zero."""
    params = make_params()
    opt = SRAdamW(params, m_format="fp32", v_format="fp8", block_size=8)
    opt.count_health = True
    blocks = [(0, 7 * 2), (0, 12), (0, 15 * 1), (0, 5)]
    assert opt.local_blocks() == blocks
    run_steps(opt, params, 1)
    counts = opt.take_stall_counts().counts
    assert counts[:, COUNT_M_SCALE_CHANGED].tolist() == [0] * len(SHAPES)
    assert counts[:, COUNT_V_SCALE_CHANGED].tolist() == [v for _, v in blocks]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_health_counts_only_on_the_steps_that_ask(backend):
    """With count_health set on steps 0 and 2 only: the same parameters, states and stall
    counts as counting on every step; the health counts of those steps, none of the others,
    and the steps that counted them."""
    kw = dict(lr=1e-2, m_format="fp8", v_format="fp4_e2m2", block_size=8, backend=backend)
    a, b = make_params(device=DEVICE), make_params(device=DEVICE)
    every, some = SRAdamW(a, **kw), SRAdamW(b, **kw)
    every.count_health = True
    stall, health = slice(0, NUM_STALL_COUNTS), slice(NUM_STALL_COUNTS, NUM_COUNTS)
    for t in range(4):
        for p, q, g in zip(a, b, make_grads(t), strict=True):
            p.grad, q.grad = g.to(DEVICE), g.to(DEVICE)
        some.count_health = t in (0, 2)
        every.step()
        some.step()
        all_counts, sampled = every.take_stall_counts(), some.take_stall_counts()
        assert (all_counts.steps, all_counts.health_steps) == (1, 1)
        assert (sampled.steps, sampled.health_steps) == (1, int(some.count_health))
        if some.count_health:
            assert torch.equal(sampled.counts, all_counts.counts), t
            assert int(sampled.counts[:, health].sum()) > 0, t
        else:
            assert torch.equal(sampled.counts[:, stall], all_counts.counts[:, stall]), t
            assert int(sampled.counts[:, health].abs().sum()) == 0, t
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in every.state[p].items():
            assert_same_bits(value, some.state[q][key], key)


def test_reset_restarts_state_and_age():
    params = make_params()
    # without re-warmup, the step after a reset is a fresh first step (test_update_size
    # covers the re-warmup's factor)
    kw = dict(
        lr=1e-2,
        m_format="fp8",
        v_format="fp8",
        m_rounding="nearest",
        v_rounding="nearest",
        rewarmup=0,
    )
    opt = SRAdamW(params, **kw)
    run_steps(opt, params, 5)
    opt.reset("v")
    st = opt.state[params[0]]
    assert int(st["v_age"]) == 0 and int(st["m_age"]) == 5 and int(st["v_codes"].abs().sum()) == 0
    opt.reset("both")
    snapshot = [p.detach().clone() for p in params]
    fresh_params = [torch.nn.Parameter(s.clone()) for s in snapshot]
    fresh = SRAdamW(fresh_params, **kw)
    for p, q, g in zip(params, fresh_params, make_grads(99), strict=True):
        p.grad, q.grad = g, g.clone()
    opt.step()
    fresh.step()
    for p, q in zip(params, fresh_params, strict=True):
        assert_same_bits(p.data, q.data, "after reset the update equals a fresh first step")
    with pytest.raises(ValueError, match="reset takes"):
        opt.reset("w")


def test_bad_inputs_name_the_problem():
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        SRAdamW([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="unknown state format 'fp5'"):
        SRAdamW(make_params(), m_format="fp5")
    with pytest.raises(ValueError, match="unsigned"):
        SRAdamW(make_params(), m_format="fp4_e2m2")
    with pytest.raises(ValueError, match="power of two"):
        SRAdamW(make_params(), block_size=48)
    with pytest.raises(ValueError, match="m_rounding"):
        SRAdamW(make_params(), m_rounding="down")
    with pytest.raises(ValueError, match="backend"):
        SRAdamW(make_params(), backend="cuda")


# --------------------------------------------------------------------- multi-rank


OPT_KW = dict(
    lr=1e-2, m_format="fp8", v_format="fp4_e2m2", block_size=8, seed=11, weight_decay=0.05
)


def _sharded_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        params = [
            torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]))
            for p in make_params(torch.bfloat16)
        ]
        opt = SRAdamW(params, **OPT_KW)
        for t in range(steps):
            for p, g in zip(params, make_grads(t), strict=True):
                p.grad = distribute_tensor(g.to(p.dtype), mesh, [Shard(0)])
            opt.step()
        counts = opt.take_stall_counts().counts
        dist.all_reduce(counts)
        full = {
            "params": [p.full_tensor() for p in params],
            "state": [
                {
                    k: v.full_tensor() if k.endswith(("codes", "scales")) else v
                    for k, v in opt.state[p].items()
                }
                for p in params
            ],
            "counts": counts,
        }
        if rank == 0:
            torch.save(full, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_worker()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_run_equals_single_process(tmp_path: Path, world: int):
    """DTensor shards on 2 or 3 gloo ranks give the single-process result bit for bit."""
    steps = 3
    params = make_params(torch.bfloat16)
    opt = SRAdamW(params, **OPT_KW)
    run_steps(opt, params, steps)
    out = str(tmp_path / "sharded.pt")
    mp.spawn(_sharded_worker, args=(world, free_port(), out, steps), nprocs=world, join=True)
    got = torch.load(out, weights_only=True)
    for p, q in zip(params, got["params"], strict=True):
        assert_same_bits(p.data, q, f"param at world {world}")
    for p, st in zip(params, got["state"], strict=True):
        for key, value in opt.state[p].items():
            assert_same_bits(value, st[key], f"{key} at world {world}")
    assert torch.equal(opt.take_stall_counts()[0], got["counts"])


def test_fused_counters_save_load_and_reset_in_place(tmp_path: Path):
    """Step and ages of fused shards (an empty shard among them) stay per-parameter tensors:
    DCP loads them in place, reset() zeroes them in place, torch.save writes them; results
    equal the spec backend's bit for bit."""
    import torch.distributed.checkpoint as dcp

    kw = dict(lr=1e-2, m_format="bf16", v_format="fp8", block_size=8, seed=7)
    a, b = (
        [*make_params(device=DEVICE), torch.nn.Parameter(torch.zeros(0, 3, device=DEVICE))]
        for _ in range(2)
    )
    opt_a, opt_b = SRAdamW(a, backend="torch", **kw), SRAdamW(b, backend="triton", **kw)

    def run(opt, params, steps, seed):
        for t in range(steps):
            for p, g in zip(params, [*make_grads(t, seed), torch.ones(0, 3)], strict=True):
                p.grad = g.to(p.device)
            opt.step()

    def tensors(opt, params):
        return {f"p{i}": {"param": p.data, **opt.state[p]} for i, p in enumerate(params)}

    run(opt_a, a, 3, seed=1)
    run(opt_b, b, 3, seed=1)
    dcp.save(tensors(opt_b, b), checkpoint_id=tmp_path / "dcp")
    torch.save(opt_b.state_dict(), tmp_path / "state.pt")
    run(opt_b, b, 2, seed=2)
    dcp.load(tensors(opt_b, b), checkpoint_id=tmp_path / "dcp")
    assert [int(opt_b.state[p]["step"]) for p in b] == [3] * len(b)
    opt_a.reset("v")
    opt_b.reset("v")
    assert [int(opt_b.state[p]["v_age"]) for p in b] == [0] * len(b)
    run(opt_a, a, 2, seed=3)
    run(opt_b, b, 2, seed=3)
    for p, q in zip(a, b, strict=True):
        assert_same_bits(p.data, q.data, "param")
        for key, value in opt_a.state[p].items():
            assert_same_bits(value, opt_b.state[q][key], key)
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["state"]
    assert [(int(s["step"]), int(s["m_age"]), int(s["v_age"])) for s in saved.values()] == [
        (3, 3, 3)
    ] * len(b)
    assert int(opt_b.state[b[0]]["step"]) == 5 and opt_b.take_stall_counts()[1] == 7


GATHER_FORMATS = [("bf16", "bf16"), ("fp8", "fp8"), ("fp4_e2m1", "fp4_e2m2")]


def _gather_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from srtrain.optim.shards import full_state

        mesh = init_device_mesh("cpu", (world,))
        result = {}
        for m_format, v_format in GATHER_FORMATS:
            params = [
                torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]))
                for p in make_params()
            ]
            opt = SRAdamW(params, **{**OPT_KW, "m_format": m_format, "v_format": v_format})
            for p, g in zip(params, make_grads(0), strict=True):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            opt.step()
            for i, p in enumerate(params):
                for key, value in opt.state[p].items():
                    if key.endswith(("codes", "scales")):
                        name = f"{m_format}/{v_format}/{i}/{key}"
                        result[name] = (value.to_local().clone(), full_state(value))
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_full_state_gathers_every_format_over_gloo(tmp_path: Path):
    """full_state of m and v (BF16's int16 codes too, which gloo cannot all-gather as such)
    is the concatenation of the ranks' local shards, bit for bit, on every rank."""
    out = str(tmp_path / "gathered")
    mp.spawn(_gather_worker, args=(2, free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    assert {name.split("/")[3] for name in ranks[0]} >= {"m_codes", "v_codes", "v_scales"}
    assert any(local.dtype == torch.int16 for local, _ in ranks[0].values())
    for name, (local, full) in ranks[0].items():
        expected = torch.cat([local, ranks[1][name][0]])
        assert full.dtype == expected.dtype and full.shape == expected.shape, name
        assert torch.equal(full.view(torch.uint8), expected.view(torch.uint8)), name
        assert torch.equal(ranks[1][name][1].view(torch.uint8), full.view(torch.uint8)), name
