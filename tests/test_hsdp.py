"""HSDP (``parallel.replicas`` > 1) on real gloo ranks: replicas stay bit-identical, the run
matches plain FSDP, sums over shards count each element once, and DCP checkpoints move
between HSDP and plain FSDP at another world size.

Contracts tested (llama-tiny, SRAdamW with FP8 m and FP4 v rounded stochastically, FP32 and
BF16 parameters, the latter rounded stochastically too):

- the two replicas of a 2×2 run hold bitwise identical parameter shards and optimizer
  states (codes, scales, step and ages) after every step;
- a 2×2 run whose replicas see the same rows equals, bit for bit, a 2-rank FSDP run fed
  those rows (averaging two identical gradients is exact, and every draw keys on the global
  element index);
- a 2×2 run with distinct rows per rank equals a 1-D 4-rank FSDP run fed the same rows up to
  the order of the FP32 gradient sums: grad norms agree to 1e-5, stall counts are over the
  same element-steps (once, not once per replica), state bytes per rank are the same, and
  parameters agree closely;
- a checkpoint saved at 2×2 loads into 1-D FSDP on 2 ranks, and one saved there loads into
  2×2, each restoring parameters and states bit for bit.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard

from srtrain.checkpoint import CheckpointManager, latest, load
from srtrain.metrics import StallAggregator
from srtrain.models import build_model, count_params, init_weights, param_group_of
from srtrain.optim import SRAdamW
from srtrain.optim.sradamw import shard_offset
from srtrain.parallel import (
    apply_fsdp,
    clip_grad_norm_,
    device_mesh,
    init_distributed,
    shard_group,
)

pytestmark = pytest.mark.slow

PRESET = "llama-tiny"
VOCAB = 257  # odd: rows do not divide evenly between shards
SEQ = 16
BATCH = 8  # rows per step over all ranks
STEPS = 4
MORE_STEPS = 2  # after loading a checkpoint
SEED = 7
MAX_NORM = 0.05  # small enough that clipping scales every step's gradients
PARAMS = {"fp32": False, "bf16": True}  # name → bf16_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _build(mesh, bf16_params: bool) -> tuple[torch.nn.Module, SRAdamW]:
    model = build_model(PRESET, VOCAB, SEQ)
    apply_fsdp(model, mesh, param_dtype=torch.float32, bf16_params=bf16_params)
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    optimizer = SRAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, m_format="fp8",
                        v_format="fp4_e2m2", seed=11)
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
    return {"norms": norms, "element_steps": report.element_steps,
            "stalled": report.stalled, "state_bytes": int(total)}


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


def _four_ranks(rank: int, out: Path, phase: str) -> dict:
    """4 ranks. Phase "train": 2×2 runs (same rows per replica, distinct rows) and a 1-D
    4-rank run; the distinct-rows 2×2 run is saved. Phase "load": a 1-D checkpoint loaded
    into 2×2, then trained further."""
    info = init_distributed("cpu")
    hsdp, flat = device_mesh(info, 2), device_mesh(info, 1)
    results: dict = {"mesh": (tuple(hsdp.shape), hsdp.mesh_dim_names,
                              dist.get_process_group_ranks(shard_group(hsdp)))}
    for params, bf16 in PARAMS.items():
        if phase == "train":
            model, optimizer = _build(hsdp, bf16)
            p = next(iter(model.parameters()))
            results[f"placements-{params}"] = tuple(p.placements)
            results[f"offset-{params}"] = shard_offset(p)
            _train(model, optimizer, hsdp, range(STEPS), _rows(rank, 2))  # replicas: same rows
            results[f"same-{params}"] = _tensors(model, optimizer, full=True)
            results[f"same-{params}-local"] = _tensors(model, optimizer, full=False)

            model, optimizer = _build(hsdp, bf16)
            results[f"hsdp-{params}-stats"] = _train(model, optimizer, hsdp, range(STEPS),
                                                     _rows(rank, 4))
            results[f"hsdp-{params}"] = _tensors(model, optimizer, full=True)
            results[f"hsdp-{params}-local"] = _tensors(model, optimizer, full=False)
            _checkpoint(model, optimizer, out / f"ckpt-hsdp-{params}", STEPS)

            model, optimizer = _build(flat, bf16)
            results[f"flat4-{params}-stats"] = _train(model, optimizer, flat, range(STEPS),
                                                      _rows(rank, 4))
            results[f"flat4-{params}"] = _tensors(model, optimizer, full=True)
        else:
            model, optimizer = _build(hsdp, bf16)
            load(latest(out / f"ckpt-flat2-{params}"), model, optimizer)
            results[f"loaded-{params}"] = _tensors(model, optimizer, full=True)
            steps = range(STEPS + MORE_STEPS, STEPS + 2 * MORE_STEPS)
            _train(model, optimizer, hsdp, steps, _rows(rank, 4))
            results[f"continued-{params}-local"] = _tensors(model, optimizer, full=False)
    return results


def _two_ranks(rank: int, out: Path) -> dict:
    """2 ranks, 1-D: the run that 2×2 with the same rows per replica must equal; the 2×2
    checkpoint loaded and trained further, then saved."""
    info = init_distributed("cpu")
    flat = device_mesh(info, 1)
    results: dict = {}
    for params, bf16 in PARAMS.items():
        model, optimizer = _build(flat, bf16)
        _train(model, optimizer, flat, range(STEPS), _rows(rank, 2))
        results[f"flat2-{params}"] = _tensors(model, optimizer, full=True)

        model, optimizer = _build(flat, bf16)
        load(latest(out / f"ckpt-hsdp-{params}"), model, optimizer)
        results[f"loaded-{params}"] = _tensors(model, optimizer, full=True)
        _train(model, optimizer, flat, range(STEPS, STEPS + MORE_STEPS), _rows(rank, 2))
        results[f"flat2-after-{params}"] = _tensors(model, optimizer, full=True)
        _checkpoint(model, optimizer, out / f"ckpt-flat2-{params}", STEPS + MORE_STEPS)
    return results


def _worker(rank: int, world_size: int, port: int, out: str, phase: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out_dir = Path(out)
    results = _four_ranks(rank, out_dir, phase) if world_size == 4 else _two_ranks(rank, out_dir)
    torch.save(results, out_dir / f"{phase}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world_size: int, out: Path, phase: str) -> list[dict]:
    mp.spawn(_worker, args=(world_size, _free_port(), str(out), phase), nprocs=world_size)
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False)
            for r in range(world_size)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("hsdp")
    train = _spawn(4, out, "train")
    two = _spawn(2, out, "two")
    return {"train": train, "two": two, "load": _spawn(4, out, "load")}


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_mesh_shards_consecutive_ranks_and_offsets_are_global(runs):
    for rank, result in enumerate(runs["train"]):
        shape, names, group = result["mesh"]
        assert shape == (2, 2) and names == ("replicate", "shard")
        assert group == [rank // 2 * 2, rank // 2 * 2 + 1]  # one node's ranks
        for params in PARAMS:
            assert result[f"placements-{params}"] == (Replicate(), Shard(0))
    # the first parameter (embeddings, 257 rows of 128): shard 1 starts at row 129
    offsets = [result["offset-fp32"] for result in runs["train"]]
    assert offsets == [0, 129 * 128, 0, 129 * 128]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("run", ["same", "hsdp"])
def test_replicas_are_bitwise_identical(runs, run, params):
    ranks = runs["train"]
    for shard in (0, 1):
        _assert_equal(ranks[shard + 2][f"{run}-{params}-local"],
                      ranks[shard][f"{run}-{params}-local"])


@pytest.mark.parametrize("params", PARAMS)
def test_hsdp_with_same_rows_per_replica_equals_fsdp_bitwise(runs, params):
    _assert_equal(runs["train"][0][f"same-{params}"], runs["two"][0][f"flat2-{params}"])


@pytest.mark.parametrize("params", PARAMS)
def test_grad_norm_and_stalls_match_flat_fsdp(runs, params):
    hsdp = runs["train"][0][f"hsdp-{params}-stats"]
    flat = runs["train"][0][f"flat4-{params}-stats"]
    for result in runs["train"]:  # the same report on every rank
        assert result[f"hsdp-{params}-stats"] == hsdp
    assert hsdp["norms"] == pytest.approx(flat["norms"], rel=1e-5)
    assert all(norm > 2 * MAX_NORM for norm in hsdp["norms"])  # clipping is active
    numel = count_params(build_model(PRESET, VOCAB, SEQ, device="meta"))
    assert hsdp["element_steps"] == flat["element_steps"] == numel * STEPS
    for state in ("m", "v"):
        assert hsdp["stalled"][state] == pytest.approx(flat["stalled"][state], abs=1e-3)
    assert hsdp["state_bytes"] == flat["state_bytes"]


@pytest.mark.parametrize("params", PARAMS)
def test_hsdp_params_match_flat_fsdp(runs, params):
    hsdp, flat = runs["train"][0][f"hsdp-{params}"], runs["train"][0][f"flat4-{params}"]
    assert hsdp.keys() == flat.keys()
    for name in hsdp:
        if ":" not in name:
            torch.testing.assert_close(hsdp[name], flat[name], rtol=0, atol=1e-2, msg=name)


@pytest.mark.parametrize("params", PARAMS)
def test_checkpoint_moves_between_hsdp_and_fsdp(runs, params):
    train, two, again = runs["train"], runs["two"], runs["load"]
    _assert_equal(two[0][f"loaded-{params}"], train[0][f"hsdp-{params}"])  # 2×2 → 1-D × 2
    _assert_equal(again[0][f"loaded-{params}"], two[0][f"flat2-after-{params}"])  # → 2×2
    for shard in (0, 1):  # replicas continue in lockstep after loading
        _assert_equal(again[shard + 2][f"continued-{params}-local"],
                      again[shard][f"continued-{params}-local"])
