"""The optimizer step inside backward (``optim.step_in_backward``).

Contracts tested:

- ``SRAdamW.step_unit`` over a partition of the parameters, gate None or 1.0, equals
  ``step()`` bit for bit (parameters, codes, scales, counters, stall counts, shadows);
- a non-finite gate leaves its unit's parameters, states and counts as they were, and after
  ``end_unit_steps`` its counters too: the run equals one whose step left that unit out;
- :class:`StepInBackward` on real FSDP2 gloo ranks (2-rank FSDP, 2×1 HSDP, and 2×2 HSDP on
  4 ranks) with clipping off equals the ordinary step bit for bit over several steps, FP32
  and BF16 parameters, and frees every gradient during backward;
- clipping by the previous step's norm scales each step's gradients by the coefficient of
  the previous norm (bit for bit against clipping by hand), leaves the first step unclipped,
  and a unit with a non-finite gradient (on one rank only) is skipped on every rank;
- the trainer with ``optim.step_in_backward`` trains, resumes bit for bit (lagged norm
  included), says so in its first line, and refuses what needs every gradient at once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from srtrain import trainer
from srtrain.config import ConfigError, load_config, validate_world
from srtrain.metrics import read_records
from srtrain.models import build_model, init_weights
from srtrain.optim import SRAdamW
from srtrain.optim.in_backward import StepInBackward
from srtrain.parallel import (
    apply_fsdp,
    device_mesh,
    fsdp_units,
    init_distributed,
    shard_group,
    sum_of_squares,
)

from conftest import tiny_overrides
from distributed import free_port, leave_worker, set_worker_env

PRESET = "llama-tiny"
VOCAB = 257
SEQ = 16
BATCH = 8
STEPS = 3
FORMATS = {"m_format": "fp8", "v_format": "fp4_e2m2"}


def _snapshot(params, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(params):
        local = p.to_local() if isinstance(p, DTensor) else p
        out[f"{i}"] = local.detach().clone()
        for key, value in optimizer.state[p].items():
            value = value.to_local() if isinstance(value, DTensor) else value
            out[f"{i}:{key}"] = value.detach().clone()
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


# --------------------------------------------------------------- SRAdamW.step_unit


def _device(backend: str) -> torch.device:
    """Where a backend's tensors live: the fused path on CUDA where there is one (else the
    Triton interpreter on the CPU), the spec on the CPU."""
    cuda = backend == "triton" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def _params(seed: int, dtype=torch.float32, device="cpu") -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 33), (33,), (5, 64), (1,), (3, 3, 5)]
    return [nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def _grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in params]


UNITS = [[0, 2], [1], [3, 4]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", [None, 1.0])
def test_step_unit_equals_step(dtype, gate, backend):
    """On the spec path and the fused one (the Triton interpreter on a CPU)."""
    device = _device(backend)
    a, b = _params(3, dtype, device), _params(3, dtype, device)
    kwargs = dict(lr=0.01, seed=5, shadow_sample=2, backend=backend, **FORMATS)
    opt_a, opt_b = SRAdamW(a, **kwargs), SRAdamW(b, **kwargs)
    for step in range(STEPS):
        for params in (a, b):
            for p, grad in zip(params, _grads(params, step), strict=True):
                p.grad = grad
        opt_a.step()
        for unit in UNITS:
            gated = None if gate is None else torch.tensor(gate, device=device)
            opt_b.step_unit([b[i] for i in unit], gated)
        opt_b.end_unit_steps()
        _assert_equal(_snapshot(b, opt_b), _snapshot(a, opt_a))
        got, want = opt_b.take_stall_counts(), opt_a.take_stall_counts()
        assert torch.equal(got.counts, want.counts) and got.steps == want.steps == 1
    assert torch.equal(opt_b.shadow_sums(), opt_a.shadow_sums())


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gate_skips_its_unit_as_if_left_out(bad, backend):
    """Step 1 skips unit 1 (its gradient held NaN); the ordinary optimizer steps that step
    without unit 1's gradient. Both then continue alike."""
    device = _device(backend)
    a, b = _params(4, device=device), _params(4, device=device)
    kwargs = dict(lr=0.01, shadow_sample=2, backend=backend, **FORMATS)
    opt_a, opt_b = SRAdamW(a, **kwargs), SRAdamW(b, **kwargs)
    skipped = [b[i] for i in UNITS[1]]
    for step in range(STEPS):
        for params in (a, b):
            for p, grad in zip(params, _grads(params, step), strict=True):
                p.grad = grad
        if step == 1:
            for i in UNITS[1]:
                a[i].grad = None
            before = _snapshot(skipped, opt_b)
        opt_a.step()
        for u, unit in enumerate(UNITS):
            gate = bad if (step == 1 and u == 1) else 1.0
            opt_b.step_unit([b[i] for i in unit], torch.tensor(gate, device=device))
        if step == 1:
            after = _snapshot(skipped, opt_b)
            for key in before:  # counters advance until end_unit_steps gives them back
                if not key.endswith(("step", "_age")):
                    assert torch.equal(after[key], before[key]), key
        opt_b.end_unit_steps([skipped] if step == 1 else [])
        _assert_equal(_snapshot(b, opt_b), _snapshot(a, opt_a))
        assert torch.equal(opt_b.take_stall_counts().counts, opt_a.take_stall_counts().counts)


def test_step_unit_refuses_a_parameter_it_does_not_hold():
    opt = SRAdamW(_params(1), lr=0.01)
    with pytest.raises(ValueError, match="does not hold"):
        opt.step_unit([nn.Parameter(torch.zeros(2))])


# -------------------------------------------------------- StepInBackward, one process


class _TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.first = nn.Linear(6, 5)
        self.second = nn.Linear(5, 3)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _loss(model, step: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    return model(x.to(model.first.weight.device)).square().sum()


def _norm(model: _TwoUnits) -> torch.Tensor:
    """The global gradient norm summed unit by unit, as StepInBackward sums it."""
    device = model.first.weight.device
    units = (model.first.parameters(), model.second.parameters())
    return torch.stack([sum_of_squares([p.grad for p in u], device) for u in units]).sum().sqrt()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lagged_clipping_equals_clipping_by_hand(backend):
    """Plain tensors (the hooks run from autograd): step 0 unclipped, step t scaled by the
    coefficient of step t-1's norm, exactly as a loop scaling the gradients by hand."""
    max_norm = 0.05
    device = _device(backend)
    a, b = _TwoUnits().to(device), _TwoUnits().to(device)
    opt_a = SRAdamW(a.parameters(), lr=0.01, backend=backend, **FORMATS)
    opt_b = SRAdamW(b.parameters(), lr=0.01, backend=backend, **FORMATS)
    units = [list(b.first.parameters()), list(b.second.parameters())]
    inside = StepInBackward(opt_b, units, max_norm, None, device)
    previous = None
    coefficients = []
    for step in range(4):
        _loss(a, step).backward()
        grads = [p.grad for p in a.parameters()]
        norm = _norm(a)
        if previous is not None:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (previous + 1e-6), max=1.0))
        previous = norm
        opt_a.step()
        opt_a.zero_grad()

        inside.begin()
        _loss(b, step).backward()
        assert all(p.grad is None for p in b.parameters())  # freed inside backward
        done = inside.finish()
        coefficients.append(done.clip_coefficient)
        assert done.skipped_units == []
        assert torch.equal(done.grad_norm, norm)
        _assert_equal(
            _snapshot(list(b.parameters()), opt_b), _snapshot(list(a.parameters()), opt_a)
        )
    assert coefficients[0] == 1.0 and all(c < 1.0 for c in coefficients[1:])


def test_non_finite_unit_is_skipped_and_reported():
    model = _TwoUnits()
    opt = SRAdamW(model.parameters(), lr=0.01, **FORMATS)
    units = [list(model.first.parameters()), list(model.second.parameters())]
    inside = StepInBackward(opt, units, 1.0, None, torch.device("cpu"))
    inside.begin()
    _loss(model, 0).backward()
    inside.finish()
    before = _snapshot(units[0], opt)
    handle = model.first.weight.register_hook(lambda g: g * math.nan)
    inside.begin()
    _loss(model, 1).backward()
    done = inside.finish()
    handle.remove()
    assert done.skipped_units == [0]
    assert not torch.isfinite(done.grad_norm)
    _assert_equal(_snapshot(units[0], opt), before)
    assert int(opt.state[model.second.weight]["step"]) == 2
    assert math.isfinite(inside.previous_norm)  # the next step clips by the finite units


def test_units_must_cover_the_optimizer_once():
    model = _TwoUnits()
    opt = SRAdamW(model.parameters(), lr=0.01)
    first = list(model.first.parameters())
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="in no unit"):
        StepInBackward(opt, [first], 1.0, None, cpu)
    with pytest.raises(ValueError, match="two units"):
        StepInBackward(opt, [first, first, list(model.second.parameters())], 1.0, None, cpu)
    with pytest.raises(TypeError, match="needs SRAdamW"):
        StepInBackward(torch.optim.AdamW(model.parameters()), [first], 1.0, None, cpu)


# ------------------------------------------------------------ FSDP2 on gloo ranks


def _build(mesh, bf16_params: bool) -> tuple[nn.Module, SRAdamW]:
    model = build_model(PRESET, VOCAB, SEQ)
    apply_fsdp(model, mesh, param_dtype=torch.float32, bf16_params=bf16_params)
    model.to_empty(device=mesh.device_type)
    init_weights(model, 7)
    optimizer = SRAdamW(model.parameters(), lr=3e-3, seed=11, shadow_sample=4, **FORMATS)
    return model, optimizer


def _batch(step: int, rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randint(0, VOCAB, (BATCH // 2, SEQ), generator=g).to(device)


def _fsdp_job(rank: int, replicas: int, device_type: str) -> dict:
    info = init_distributed(device_type)
    mesh = device_mesh(info, replicas)
    results = {}
    for name, bf16 in {"fp32": False, "bf16": True}.items():
        model_a, opt_a = _build(mesh, bf16)
        model_b, opt_b = _build(mesh, bf16)
        units = fsdp_units(model_b)
        inside = StepInBackward(opt_b, units, math.inf, shard_group(mesh), info.device)
        freed = []
        for step in range(STEPS):
            ids = _batch(step, rank, info.device)
            model_a(input_ids=ids, labels=ids).loss.backward()
            opt_a.step()
            opt_a.zero_grad()
            inside.begin()
            model_b(input_ids=ids, labels=ids).loss.backward()
            freed.append(all(p.grad is None for p in model_b.parameters()))
            inside.finish()
        results[name] = {
            "a": _cpu(_snapshot(list(model_a.parameters()), opt_a)),
            "b": _cpu(_snapshot(list(model_b.parameters()), opt_b)),
            "counts": (
                opt_a.take_stall_counts().counts.cpu(),
                opt_b.take_stall_counts().counts.cpu(),
            ),
            "shadow": (opt_a.shadow_sums().cpu(), opt_b.shadow_sums().cpu()),
            "freed": freed,
            "units": len(units),
        }
    # a NaN in one rank's gradient of one unit (the embeddings): every rank skips the unit
    model, opt = _build(mesh, False)
    units = fsdp_units(model)
    inside = StepInBackward(opt, units, 1.0, shard_group(mesh), info.device)
    embeddings = model.get_input_embeddings()
    ids = _batch(0, rank, info.device)
    inside.begin()
    model(input_ids=ids, labels=ids).loss.backward()
    inside.finish()
    before = _snapshot(list(embeddings.parameters()), opt)
    handle = None
    if rank == 0:
        handle = embeddings.register_forward_hook(
            lambda module, args, out: out.register_hook(lambda g: g * math.nan) and None
        )
    inside.begin()
    model(input_ids=ids, labels=ids).loss.backward()
    done = inside.finish()
    if handle is not None:
        handle.remove()
    after = _snapshot(list(embeddings.parameters()), opt)
    results["nan"] = {
        "skipped": done.skipped_units,
        "unit": next(
            u for u, unit in enumerate(units) if any(p is embeddings.weight for p in unit)
        ),
        "unchanged": all(torch.equal(v, before[k]) for k, v in after.items()),
    }
    return results


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in tensors.items()}


def _worker(rank: int, world: int, replicas: int, port: int, out: str, device: str) -> None:
    set_worker_env(rank, world, port)
    torch.set_num_threads(1)
    if device == "cuda":  # the two models' backward passes must agree bit for bit
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    results = _fsdp_job(rank, replicas, device)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    leave_worker()


@pytest.mark.parametrize(
    "mesh",
    [
        "fsdp-2",
        pytest.param("hsdp-2x1", marks=pytest.mark.slow),
        pytest.param("hsdp-2x2", marks=pytest.mark.slow),
    ],
)
def test_fsdp_step_in_backward_equals_the_ordinary_step(mesh, tmp_path):
    world, replicas = {"fsdp-2": (2, 1), "hsdp-2x1": (2, 2), "hsdp-2x2": (4, 2)}[mesh]
    _check_fsdp_runs(world, replicas, "cpu", tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_in_backward_equals_the_ordinary_step(tmp_path):
    """One GPU (NCCL): the fused launches on FSDP2's reduce stream, the same bits."""
    _check_fsdp_runs(1, 1, "cuda", tmp_path)


def _check_fsdp_runs(world: int, replicas: int, device: str, tmp_path: Path) -> None:
    mp.spawn(_worker, args=(world, replicas, free_port(), str(tmp_path), device), nprocs=world)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in ("fp32", "bf16"):
            got = results[name]
            _assert_equal(got["b"], got["a"])
            assert torch.equal(got["counts"][1], got["counts"][0])
            assert torch.equal(got["shadow"][1], got["shadow"][0])
            assert got["freed"] == [True] * STEPS
            assert got["units"] == 5  # two blocks, the embeddings, the head, the root
        nan = results["nan"]
        assert nan["skipped"] == [nan["unit"]] and nan["unchanged"]


# ------------------------------------------------------------------- the trainer


def _cfg(data: str, run_dir: Path, **extra) -> object:
    return load_config(
        overrides=tiny_overrides(
            data,
            run_dir,
            **{
                "optim.step_in_backward": True,
                "train.log_interval": 2,
                "checkpoint.interval": 2,
                "train.val_interval": 0,
                **extra,
            },
        )
    )


@pytest.mark.slow
def test_trainer_trains_and_resumes_bit_for_bit(tiny_data, tmp_path, capsys):
    straight = trainer.run(_cfg(tiny_data, tmp_path / "straight", **{"train.steps": 6}))
    first = trainer.run(_cfg(tiny_data, tmp_path / "resumed", **{"train.steps": 4}))
    resumed = trainer.run(_cfg(tiny_data, tmp_path / "resumed", **{"train.steps": 6}))
    assert straight.losses == first.losses + resumed.losses
    assert all(math.isfinite(x) for x in straight.losses)
    records = read_records(tmp_path / "straight")
    assert [r["grad_norm"] for r in records if "grad_norm" in r] == [
        r["grad_norm"] for r in read_records(tmp_path / "resumed") if "grad_norm" in r
    ]
    log = capsys.readouterr().out
    assert "stepped inside backward (clipped to 1 by the previous step's gradient norm)" in log


def test_config_refuses_what_needs_every_gradient(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.step_in_backward.*torch_adamw"):
        _cfg(tiny_data, tmp_path, **{"optim.name": "torch_adamw"})
    cfg = _cfg(tiny_data, tmp_path, **{"train.micro_batch_size": 2, "train.global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"^optim\.step_in_backward: .* accumulate 4 micro"):
        validate_world(cfg, 1)


@pytest.mark.slow
def test_a_run_switches_the_mode_on_resume(tiny_data, tmp_path):
    """Ordinary steps to step 4, then inside backward to 6 (the first of them unclipped:
    the ordinary checkpoint holds no lagged norm), then ordinary again to 8."""
    run_dir = tmp_path / "switch"
    first = trainer.run(
        _cfg(tiny_data, run_dir, **{"train.steps": 4, "optim.step_in_backward": False})
    )
    second = trainer.run(_cfg(tiny_data, run_dir, **{"train.steps": 6}))
    third = trainer.run(
        _cfg(tiny_data, run_dir, **{"train.steps": 8, "optim.step_in_backward": False})
    )
    losses = first.losses + second.losses + third.losses
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
