"""HSDP (``parallel.replicas`` > 1) on real gloo ranks: replicas stay bit-identical, the run
matches plain FSDP, sums over shards count each element once, and DCP checkpoints move
between HSDP and plain FSDP at another world size.

Contracts tested (llama-tiny, SRAdamW with FP8 m and FP4 v rounded stochastically, FP32 and
BF16 parameters, the latter rounded stochastically too):

- the two replicas of a 2×2 run hold bitwise identical parameter shards and optimizer
  states (codes, scales, step and ages);
- a 2×2 run whose replicas see the same rows equals, bit for bit, a 2-rank FSDP run fed
  those rows (averaging two identical gradients is exact, and every draw keys on the global
  element index);
- a 2×2 run with distinct rows per rank equals a 1-D 4-rank FSDP run fed the same rows up to
  the order of the FP32 gradient sums: grad norms agree to 1e-5, stall counts are over the
  same element-steps (once, not once per replica), state bytes summed over the shard group
  are the same, and parameters agree closely;
- a checkpoint saved at 2×2 loads into 1-D FSDP on 2 ranks, and one saved by 1-D FSDP on 4
  ranks loads into 2×2, each restoring parameters and states bit for bit; the replicas
  continue in lockstep;
- ``srtrain.trainer.run`` at 2×2 resumes bit for bit, and its state bytes and stall
  element-steps are one replica's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard

from srtrain import trainer
from srtrain.checkpoint import CheckpointManager, latest, load
from srtrain.config import ConfigError, load_config, validate_world
from srtrain.metrics import StallAggregator, read_records
from srtrain.models import build_model, count_params, init_weights
from srtrain.optim import SRAdamW
from srtrain.optim.sradamw import shard_offset
from srtrain.parallel import (
    apply_fsdp,
    clip_grad_norm_,
    device_mesh,
    init_distributed,
    shard_group,
)
from srtrain.param_groups import param_group_of

from conftest import tiny_overrides
from distributed import free_port, leave_worker, set_worker_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PRESET = "llama-tiny"
VOCAB = 257  # odd: rows do not divide evenly between shards
SEQ = 16
BATCH = 8  # rows per step over all ranks
STEPS = 3
MORE_STEPS = 1  # after loading a checkpoint
SEED = 7
LR = 3e-3
MAX_NORM = 0.05  # small enough that clipping scales every step's gradients
PARAMS = {"fp32": False, "bf16": True}  # name → bf16_params


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _build(mesh, bf16_params: bool) -> tuple[torch.nn.Module, SRAdamW]:
    model = build_model(PRESET, VOCAB, SEQ)
    apply_fsdp(model, mesh, param_dtype=torch.float32, bf16_params=bf16_params)
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    optimizer = SRAdamW(
        model.parameters(), lr=LR, weight_decay=0.1, m_format="fp8", v_format="fp4_e2m2", seed=11
    )
    return model, optimizer


def _train(model, optimizer, mesh, steps: range, rows) -> dict:
    """``steps`` optimizer steps on rows ``rows`` of each step's batch; norms and stalls."""
    group = shard_group(mesh)
    labels = [param_group_of(name) for name, _ in model.named_parameters()]
    aggregator = StallAggregator(labels, optimizer.local_numels(), "cpu")
    norms = []
    for step in steps:
        ids = _batch(step)[rows]
        model(input_ids=ids, labels=ids).loss.backward()
        norms.append(clip_grad_norm_(list(model.parameters()), MAX_NORM, group).item())
        optimizer.step()
        aggregator.accumulate(*optimizer.take_stall_counts())
        optimizer.zero_grad()
    report = aggregator.reduce(group)
    total = torch.tensor([optimizer.state_bytes()])
    dist.all_reduce(total, group=group)
    return {
        "norms": norms,
        "element_steps": report.element_steps,
        "stalled": report.stalled,
        "state_bytes": int(total),
    }


def _tensors(model, optimizer, full: bool) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state by name: full tensors, or this rank's shards."""

    def get(t):
        if not isinstance(t, DTensor):
            return t.detach().clone()
        return t.full_tensor().clone() if full else t.to_local().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = get(p)
        for key, value in optimizer.state[p].items():
            out[f"{name}:{key}"] = get(value)
    return out


def _rows(rank: int, parts: int) -> slice:
    size = BATCH // parts
    return slice((rank % parts) * size, (rank % parts + 1) * size)


def _checkpoint(model, optimizer, run_dir: Path, step: int) -> None:
    with CheckpointManager(run_dir, keep=1) as manager:
        manager.save(step, model, optimizer, {"step": step})


def _four_ranks(rank: int, out: Path) -> dict:
    """4 ranks: 2×2 runs with the same rows per replica and with distinct rows, a 1-D 4-rank
    run, each run's checkpoint, and the 1-D checkpoint loaded into 2×2 and trained on."""
    info = init_distributed("cpu")
    hsdp, flat = device_mesh(info, 2), device_mesh(info, 1)
    results: dict = {
        "mesh": (
            tuple(hsdp.shape),
            hsdp.mesh_dim_names,
            dist.get_process_group_ranks(shard_group(hsdp)),
        )
    }
    for params, bf16 in PARAMS.items():
        model, optimizer = _build(hsdp, bf16)
        p = next(iter(model.parameters()))
        results[f"placements-{params}"] = tuple(p.placements)
        results[f"offset-{params}"] = shard_offset(p)
        _train(model, optimizer, hsdp, range(STEPS), _rows(rank, 2))  # replicas: same rows
        results[f"same-{params}"] = _tensors(model, optimizer, full=True)
        results[f"same-{params}-local"] = _tensors(model, optimizer, full=False)

    model, optimizer = _build(hsdp, False)
    results["hsdp-stats"] = _train(model, optimizer, hsdp, range(STEPS), _rows(rank, 4))
    results["hsdp"] = _tensors(model, optimizer, full=True)
    results["hsdp-local"] = _tensors(model, optimizer, full=False)
    _checkpoint(model, optimizer, out / "ckpt-hsdp", STEPS)

    model, optimizer = _build(flat, False)
    results["flat4-stats"] = _train(model, optimizer, flat, range(STEPS), _rows(rank, 4))
    results["flat4"] = _tensors(model, optimizer, full=True)
    _checkpoint(model, optimizer, out / "ckpt-flat4", STEPS)

    model, optimizer = _build(hsdp, False)
    load(latest(out / "ckpt-flat4"), model, optimizer)
    results["loaded"] = _tensors(model, optimizer, full=True)
    _train(model, optimizer, hsdp, range(STEPS, STEPS + MORE_STEPS), _rows(rank, 4))
    results["continued-local"] = _tensors(model, optimizer, full=False)
    return results


def _trainer_runs(rank: int, out: Path, data: str) -> dict:
    """``srtrain.trainer.run`` on 4 ranks at 2×2: straight through, and from its step-2
    checkpoint (mid adaptive-reset window) in another run dir; and 2 steps at 1-D."""

    def run(name: str, steps: int, replicas: int, start: str = ""):
        cfg = load_config(
            overrides=tiny_overrides(
                data,
                out / name,
                **{
                    "checkpoint.load": start,
                    "parallel.replicas": replicas,
                    "train.steps": steps,
                    "train.log_interval": 1,
                    "train.val_interval": 0,
                    "train.global_batch_size": 4,
                    "model.seq_len": 32,
                    "checkpoint.interval": 2,
                    "optim.m_format": "fp8",
                    "optim.v_format": "fp4",
                    "resets.mode": "adaptive",
                    "resets.threshold": 0.2,
                    "resets.window": 3,
                    "resets.min_age": 1,
                },
            )
        )
        return trainer.run(cfg)

    straight = run("straight", 4, 2)
    resumed = run("resumed", 4, 2, str(out / "straight" / "checkpoints" / "step-2"))
    flat = run("flat", 2, 1)
    return {
        "records": {name: read_records(out / name) for name in ("straight", "resumed", "flat")},
        "resets": (straight.resets, resumed.resets),
        "bytes": (straight.state_bytes_per_param, flat.state_bytes_per_param),
        "element_steps": {step: r.element_steps for step, r in straight.stall_reports.items()},
    }


def _two_ranks(rank: int, out: Path) -> dict:
    """2 ranks, 1-D: the runs that 2×2 with the same rows per replica must equal, and the
    2×2 checkpoint loaded."""
    info = init_distributed("cpu")
    flat = device_mesh(info, 1)
    results: dict = {}
    for params, bf16 in PARAMS.items():
        model, optimizer = _build(flat, bf16)
        _train(model, optimizer, flat, range(STEPS), _rows(rank, 2))
        results[f"flat2-{params}"] = _tensors(model, optimizer, full=True)
    model, optimizer = _build(flat, False)
    load(latest(out / "ckpt-hsdp"), model, optimizer)
    results["loaded"] = _tensors(model, optimizer, full=True)
    return results


JOBS = {"four": (4, _four_ranks), "two": (2, _two_ranks), "trainer": (4, _trainer_runs)}


def _worker(rank: int, job: str, port: int, out: str, data: str) -> None:
    world_size, work = JOBS[job]
    set_worker_env(rank, world_size, port)
    torch.set_num_threads(1)
    out_dir = Path(out)
    results = work(rank, out_dir, data) if job == "trainer" else work(rank, out_dir)
    torch.save(results, out_dir / f"{job}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    leave_worker()


def _spawn(job: str, out: Path, data: str = "") -> list[dict]:
    """Run one of ``JOBS`` on its ranks; each rank's results, in rank order."""
    world_size = JOBS[job][0]
    mp.spawn(_worker, args=(job, free_port(), str(out), data), nprocs=world_size)
    return [torch.load(out / f"{job}-rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hsdp")


@pytest.fixture(scope="module")
def four(out_dir) -> list[dict]:
    return _spawn("four", out_dir)


@pytest.fixture(scope="module")
def two(out_dir, four) -> list[dict]:
    return _spawn("two", out_dir)  # loads a checkpoint of ``four``


@pytest.fixture(scope="module")
def trained(out_dir, tiny_data) -> dict:
    return _spawn("trainer", out_dir, tiny_data)[0]


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_mesh_shards_consecutive_ranks_and_offsets_are_global(four):
    for rank, result in enumerate(four):
        shape, names, group = result["mesh"]
        assert shape == (2, 2) and names == ("replicate", "shard")
        assert group == [rank // 2 * 2, rank // 2 * 2 + 1]  # one node's ranks
        for params in PARAMS:
            assert result[f"placements-{params}"] == (Replicate(), Shard(0))
    # the first parameter (embeddings, 257 rows of 128): shard 1 starts at row 129
    assert [result["offset-fp32"] for result in four] == [0, 129 * 128, 0, 129 * 128]


@pytest.mark.parametrize("run", ["same-fp32", "same-bf16", "hsdp", "continued"])
def test_replicas_are_bitwise_identical(four, run):
    for shard in (0, 1):
        _assert_equal(four[shard + 2][f"{run}-local"], four[shard][f"{run}-local"])


@pytest.mark.parametrize("params", PARAMS)
def test_hsdp_with_same_rows_per_replica_equals_fsdp_bitwise(four, two, params):
    _assert_equal(four[0][f"same-{params}"], two[0][f"flat2-{params}"])


def test_grad_norm_and_stalls_match_flat_fsdp(four):
    hsdp, flat = four[0]["hsdp-stats"], four[0]["flat4-stats"]
    for result in four:  # the same report on every rank
        assert result["hsdp-stats"] == hsdp
    assert hsdp["norms"] == pytest.approx(flat["norms"], rel=1e-5)
    assert all(norm > 2 * MAX_NORM for norm in hsdp["norms"])  # clipping is active
    numel = count_params(build_model(PRESET, VOCAB, SEQ, device="meta"))
    assert hsdp["element_steps"] == flat["element_steps"] == numel * STEPS
    for state in ("m", "v"):
        assert hsdp["stalled"][state] == pytest.approx(flat["stalled"][state], abs=1e-3)
    assert hsdp["state_bytes"] == flat["state_bytes"]


def test_hsdp_params_match_flat_fsdp(four):
    """Within a tenth of one step's update (about LR): the gradient sums' order moves the
    FP32 values in their last bits, which flips a stochastic rounding here and there."""
    hsdp, flat = four[0]["hsdp"], four[0]["flat4"]
    assert hsdp.keys() == flat.keys()
    for name in hsdp:
        if ":" not in name:
            torch.testing.assert_close(hsdp[name], flat[name], rtol=0, atol=LR / 10, msg=name)


def test_checkpoint_moves_between_hsdp_and_fsdp(four, two):
    _assert_equal(two[0]["loaded"], four[0]["hsdp"])  # 2×2 → 1-D on 2 ranks
    _assert_equal(four[0]["loaded"], four[0]["flat4"])  # 1-D on 4 ranks → 2×2


def test_trainer_resumes_hsdp_bit_for_bit_and_counts_once(trained):
    """The trainer's path at 2×2: a run resumed from the step-2 checkpoint (mid adaptive-reset
    window) logs exactly what the straight run logs; state bytes and stall element-steps
    are those of one replica, the same as a 1-D run's."""
    got = trained
    records = got["records"]
    assert [r["step"] for r in records["straight"]] == [1, 2, 3, 4]
    assert records["resumed"] == records["straight"][2:]
    assert 3 in got["resets"][0]  # the window that spans the resume decided a reset
    assert got["resets"][1] == {step: due for step, due in got["resets"][0].items() if step > 2}
    assert got["bytes"][0] == got["bytes"][1] > 0
    numel = count_params(build_model(PRESET, 512, 32, device="meta"))
    assert got["element_steps"] == {step: numel for step in (1, 2, 3, 4)}
    for hsdp, flat in zip(records["straight"][:2], records["flat"], strict=True):
        assert hsdp["grad_norm"] == pytest.approx(flat["grad_norm"], rel=1e-4)
        assert hsdp["loss"] == pytest.approx(flat["loss"], rel=1e-4)


@pytest.mark.parametrize(
    ("args", "added"),
    [
        (["--config", "c.yaml", "optim.lr=1e-4"], ["parallel.replicas=3"]),
        (["parallel.replicas=1"], []),
    ],
)
def test_multi_node_launch_replicates_across_nodes_by_default(tmp_path, args, added):
    env = {**os.environ, "TORCHRUN": "echo", "NNODES": "3", "HEAD_NODE_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        [str(REPO / "launch" / "multi_node.sh"), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    words = proc.stdout.split()
    assert words[words.index("train") + 1 :] == [*args, *added]


def test_replicas_must_be_a_positive_divisor_of_the_world():
    with pytest.raises(ConfigError, match=r"^parallel\.replicas: must be > 0, got 0$"):
        load_config(overrides=["parallel.replicas=0"])
    cfg = load_config(overrides=["parallel.replicas=3", "train.global_batch_size=12"])
    validate_world(cfg, 6)
    with pytest.raises(ConfigError, match=r"^parallel\.replicas: 3 does not divide the 4 ranks"):
        validate_world(cfg, 4)
