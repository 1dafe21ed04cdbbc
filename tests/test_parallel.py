"""FSDP2 sharding, world-size-independent init and global grad clipping on real gloo ranks."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from transformers import LlamaConfig, LlamaForCausalLM

from srtrain.models import build_model, decoder_layers, init_weights
from srtrain.parallel import (
    apply_fsdp,
    clip_grad_norm_,
    compute_dtype,
    device_mesh,
)
from tensor_watch import LargestOutput

from distributed import free_port, join_gloo, leave_worker

PRESETS = ("llama-tiny", "neox-tiny")
VOCAB = 257  # odd: the embedding and head rows do not divide by 2 ranks
SEQ = 16
BATCH = 4
SEED = 7
MAX_NORM = 0.05  # small enough that clipping scales the gradients
INIT_MODELS = (*PRESETS, "micro")  # micro: rows of 3 and 4 leave 3 or 4 ranks empty shards


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _sharded_model(preset: str, mesh, **fsdp_kwargs):
    model = build_model(preset, VOCAB, SEQ)
    apply_fsdp(model, mesh, **fsdp_kwargs)
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    return model


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _run_preset(preset: str, info, mesh) -> dict:
    """Init, one forward/backward on this rank's rows, clipping, and precision variants."""
    rows = _batch().chunk(info.world_size)[info.rank]
    out = {}
    model = _sharded_model(preset, mesh, param_dtype=torch.float32)
    out["weights"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    out["loss"] = loss.item()
    out["grads"] = _full_grads(model)
    out["norm"] = clip_grad_norm_(model.parameters(), MAX_NORM, mesh).item()
    out["clipped"] = _full_grads(model)
    if info.world_size == 1:
        return out

    ac_model = _sharded_model(
        preset, mesh, param_dtype=torch.float32, activation_checkpointing=True
    )
    mlp_calls = []
    decoder_layers(ac_model)[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    ac_model(input_ids=rows, labels=rows).loss.backward()
    out["ac_mlp_calls"] = len(mlp_calls)
    out["ac_grads"] = _full_grads(ac_model)

    bf16_model = _sharded_model(preset, mesh, param_dtype=torch.bfloat16)
    bf16_model(input_ids=rows, labels=rows).loss.backward()
    out["bf16_param_dtype"] = {p.dtype for p in bf16_model.parameters()}
    out["bf16_grad_dtype"] = {p.grad.dtype for p in bf16_model.parameters()}
    out["bf16_grads"] = _full_grads(bf16_model)

    pure_model = _sharded_model(preset, mesh, bf16_params=True)
    pure_model(input_ids=rows, labels=rows).loss.backward()
    out["pure_param_dtype"] = {p.dtype for p in pure_model.parameters()}
    out["pure_grad_dtype"] = {p.grad.dtype for p in pure_model.parameters()}
    out["pure_inv_freq_dtype"] = {b.dtype for b in pure_model.buffers()}
    out["pure_weights"] = {n: p.full_tensor().clone() for n, p in pure_model.named_parameters()}
    return out


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    info = join_gloo(rank, world_size, port)
    mesh = device_mesh(info)
    results = {"info": info, "mesh_shape": tuple(mesh.shape)}
    for preset in PRESETS:
        results[preset] = _run_preset(preset, info, mesh)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world_size}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_worker()


def _spawn(world_size: int, out_dir, worker=_worker) -> dict:
    mp.spawn(worker, args=(world_size, free_port(), str(out_dir)), nprocs=world_size)
    return torch.load(out_dir / f"world{world_size}.pt", weights_only=False)


def _micro_model(device: str = "meta") -> LlamaForCausalLM:
    """A one-layer LLaMA whose parameters have 3 or 4 rows."""
    config = LlamaConfig(
        vocab_size=3,
        hidden_size=4,
        intermediate_size=3,
        num_attention_heads=1,
        num_key_value_heads=1,
        num_hidden_layers=1,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    with torch.device(device):
        return LlamaForCausalLM(config)


def _plain_model(name: str) -> torch.nn.Module:
    """An unsharded model on the CPU, initialised."""
    model = _micro_model("cpu") if name == "micro" else build_model(name, VOCAB, SEQ, device="cpu")
    init_weights(model, SEED)
    return model


def _init_sharded(name: str, mesh) -> dict:
    """Init of a model sharded over ``mesh``: the names whose full values differ from the
    unsharded init, the placements, and the largest plain tensor of init vs. the shards."""
    model = _micro_model() if name == "micro" else build_model(name, VOCAB, SEQ)
    apply_fsdp(model, mesh, param_dtype=torch.float32)
    model.to_empty(device="cpu")
    with LargestOutput() as largest:
        init_weights(model, SEED)
    plain = dict(_plain_model(name).named_parameters())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return dict(
        differ=[n for n in plain if not torch.equal(full[n], plain[n])],
        placements={tuple(p.placements) for p in model.parameters()},
        largest_init=largest.numel,
        largest_shard=max(p.to_local().numel() for p in model.parameters()),
        largest_param=max(p.numel() for p in model.parameters()),
    )


def _init_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Init only, on a 1-D mesh and, for 4 ranks, a 2x2 (replicate, shard) mesh."""
    info = join_gloo(rank, world_size, port)
    meshes = {"1d": device_mesh(info)}
    if world_size == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    mine = {
        mesh: {name: _init_sharded(name, meshes[mesh]) for name in INIT_MODELS} for mesh in meshes
    }
    ranks = [None] * world_size
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        torch.save(ranks, os.path.join(out_dir, f"world{world_size}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    leave_worker()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    out_dir = tmp_path_factory.mktemp("fsdp")
    return {world: _spawn(world, out_dir) for world in (1, 2)}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    """Unsharded single-process results for each preset, clipped with torch's clip."""
    results = {}
    for preset in PRESETS:
        model = build_model(preset, VOCAB, SEQ, device="cpu")
        init_weights(model, SEED)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = _batch()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[preset] = dict(
            weights=weights, loss=loss.item(), grads=grads, norm=norm.item(), clipped=clipped
        )
    return results


def _assert_close_dicts(got: dict, want: dict, rtol: float, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
def test_dist_info_single_and_two_ranks(runs):
    one, two = runs[1]["info"], runs[2]["info"]
    assert (one.rank, one.world_size, one.local_rank, one.backend) == (0, 1, 0, "gloo")
    assert (two.rank, two.world_size, two.backend) == (0, 2, "gloo")
    assert one.device == two.device == torch.device("cpu")
    assert runs[1]["mesh_shape"] == (1,) and runs[2]["mesh_shape"] == (2,)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_init_equals_unsharded_bitwise(runs, reference, preset, world):
    got, want = runs[world][preset]["weights"], reference[preset]["weights"]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.fixture(scope="module")
def init_runs(tmp_path_factory) -> dict[int, list[dict]]:
    """Per rank, the init results of 3 and 4 ranks."""
    out_dir = tmp_path_factory.mktemp("fsdp_init")
    return {world: _spawn(world, out_dir, _init_worker) for world in (3, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("name", INIT_MODELS)
@pytest.mark.parametrize(("world", "mesh"), [(3, "1d"), (4, "1d"), (4, "2d")])
def test_sharded_init_on_more_ranks_equals_unsharded_bitwise(init_runs, name, world, mesh):
    ranks = init_runs[world]
    assert len(ranks) == world
    for rank, results in enumerate(ranks):
        assert results[mesh][name]["differ"] == [], (rank, mesh)
    placements = {(Shard(0),)} if mesh == "1d" else {(Replicate(), Shard(0))}
    assert ranks[0][mesh][name]["placements"] == placements


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_no_rank_holds_a_full_sharded_parameter_during_init(init_runs, preset, mesh):
    for rank, results in enumerate(init_runs[4]):
        got = results[mesh][preset]
        assert got["largest_init"] <= got["largest_shard"] < got["largest_param"], (rank, got)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_rotary_buffers_match_after_to_empty(runs, preset):
    fresh = build_model(preset, VOCAB, SEQ, device="cpu")
    for name, buf in fresh.named_buffers():
        assert torch.equal(runs[2][preset]["buffers"][name], buf), name


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("world", [1, 2])
def test_loss_and_grads_match_unsharded(runs, reference, preset, world):
    got, want = runs[world][preset], reference[preset]
    assert math.isfinite(got["loss"])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    _assert_close_dicts(got["grads"], want["grads"], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("world", [1, 2])
def test_clip_matches_torch_on_unsharded_grads(runs, reference, preset, world):
    got, want = runs[world][preset], reference[preset]
    assert want["norm"] > 2 * MAX_NORM  # clipping is active
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-5)
    _assert_close_dicts(got["clipped"], want["clipped"], rtol=1e-4, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_activation_checkpointing_gives_same_grads(runs, preset):
    got = runs[2][preset]
    assert got["ac_mlp_calls"] == 2  # forward, then recomputation in backward
    _assert_close_dicts(got["ac_grads"], got["grads"], rtol=1e-5, atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_compute_keeps_fp32_master_params(runs, preset):
    got = runs[2][preset]
    assert got["bf16_param_dtype"] == {torch.float32}
    assert got["bf16_grad_dtype"] == {torch.float32}
    _assert_close_dicts(got["bf16_grads"], got["grads"], rtol=0.1, atol=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_params_are_bf16_and_rotary_stays_fp32(runs, preset):
    got = runs[2][preset]
    assert got["pure_param_dtype"] == {torch.bfloat16}
    assert got["pure_grad_dtype"] == {torch.bfloat16}
    assert got["pure_inv_freq_dtype"] == {torch.float32}


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_params_hold_the_fp32_init_rounded(runs, reference, preset):
    got, want = runs[2][preset]["pure_weights"], reference[preset]["weights"]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name].to(torch.bfloat16)), name


def test_compute_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert compute_dtype("auto", cuda) == torch.bfloat16
    assert compute_dtype("auto", cpu) == torch.float32
    assert compute_dtype("bf16", cpu) == torch.bfloat16
    assert compute_dtype("fp32", cuda) == torch.float32


def test_clip_plain_tensors_matches_torch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(params, 1.0, None)
    want = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    assert norm.dtype == torch.float32 and norm.ndim == 0
    torch.testing.assert_close(norm, want)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_mixed_dtypes_takes_float32_norms():
    """FP32 and BF16 gradients (norms taken per dtype group, in FP32) give the float64 norm
    and are scaled in their own dtype."""
    torch.manual_seed(1)
    shapes = [(7, 3), (0, 4), (11,), (2, 5, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    params = [
        torch.nn.Parameter(torch.randn(shape, dtype=dtype))
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, 1.0, None)
    want = torch.cat([g.double().flatten() for g in before]).norm()
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(want.item(), rel=1e-6)
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    for p, g in zip(params, before, strict=True):
        assert p.grad.dtype == g.dtype
        torch.testing.assert_close(p.grad, (g.float() * scale).to(g.dtype))


def test_clip_below_max_norm_leaves_grads_unchanged():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([0.3, 0.0, 0.4, 0.0])
    norm = clip_grad_norm_([p], 1.0, None)
    assert norm.item() == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.0, 0.4, 0.0]))


def test_clip_reports_non_finite_norm():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    assert not torch.isfinite(clip_grad_norm_([p], 1.0, None))
