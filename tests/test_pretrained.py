"""Pretrained weights: transformers LLaMA / GPT-NeoX safetensors into FSDP2-sharded models on
real gloo ranks, each rank reading only its rows; errors; the export → init_from round trip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

import srtrain.pretrained as pretrained
from srtrain.checkpoint import latest, read_full_model
from srtrain.config import ConfigError, load_config
from srtrain.data import BatchLoader
from srtrain.export import export
from srtrain.models import build_model, read_hf_config
from srtrain.parallel import apply_fsdp, device_mesh, init_distributed
from srtrain.pretrained import PretrainedError, load_pretrained

from conftest import tiny_overrides
from distributed import free_port, join_gloo
from forged import MALFORMED_SAFETENSORS

VOCAB = 257  # odd: embedding and head rows do not divide by 2 ranks
SEQ = 16
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=2,
    max_position_embeddings=SEQ,
)
# (family, tied embeddings in the file, sharded with an index file)
CASES = {
    "llama": ("llama", False, False),
    "llama-sharded": ("llama", False, True),
    "neox": ("neox", False, False),
    "neox-sharded": ("neox", False, True),
    "llama-tied": ("llama", True, False),
    "mistral": ("mistral", False, False),
    "qwen2-tied": ("qwen2", True, False),  # q/k/v biases
    "qwen3-sharded": ("qwen3", False, True),  # q/k norms, a head_dim wider than hidden / heads
}


def _hf_config(family: str, tied: bool = False) -> PretrainedConfig:
    if family == "llama":
        return LlamaConfig(**SHAPE, intermediate_size=48, tie_word_embeddings=tied)
    grouped = dict(intermediate_size=48, num_key_value_heads=2, tie_word_embeddings=tied)
    if family == "mistral":
        return MistralConfig(**SHAPE, **grouped, sliding_window=SEQ // 2)
    if family == "qwen2":
        return Qwen2Config(**SHAPE, **grouped)
    if family == "qwen3":
        return Qwen3Config(**SHAPE, **grouped, head_dim=12)
    return GPTNeoXConfig(
        **SHAPE,
        intermediate_size=64,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=tied,
    )


def _hf_model(family: str, tied: bool = False, seed: int = 0):
    """A tiny transformers model whose every parameter (norms and biases too) is random."""
    model = AutoModelForCausalLM.from_config(_hf_config(family, tied)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Each case's directory, its full weights (by model parameter name) and logits."""
    root = tmp_path_factory.mktemp("hf")
    cases = {}
    for case, (family, tied, sharded) in CASES.items():
        model = _hf_model(family, tied)
        kwargs = {"max_shard_size": "40KB"} if sharded else {}
        model.save_pretrained(root / case, safe_serialization=True, **kwargs)
        names = {p.name for p in (root / case).iterdir()}
        assert (pretrained.INDEX_FILE in names) == sharded
        assert (sum(n.endswith(".safetensors") for n in names) > 1) == sharded
        with torch.no_grad():
            logits = model(input_ids=_batch()).logits
        weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        cases[case] = {"dir": str(root / case), "weights": weights, "logits": logits}
    assert "lm_head.weight" not in load_file(root / "llama-tied" / pretrained.WEIGHTS_FILE)
    return cases


# ---------------------------------------------------------------- a spy on the reads


class _SpySlice:
    def __init__(self, inner, name: str, log: list) -> None:
        self._inner, self._name, self._log = inner, name, log

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, box):
        self._log.append((self._name, [(s.start, s.stop) for s in box]))
        return self._inner[box]


class _SpyFile:
    def __init__(self, inner, log: list) -> None:
        self._inner, self._log = inner, log

    def keys(self):
        return self._inner.keys()

    def get_slice(self, name: str) -> _SpySlice:
        return _SpySlice(self._inner.get_slice(name), name, self._log)

    def get_tensor(self, name: str):
        self._log.append((name, "whole"))
        return self._inner.get_tensor(name)


@contextmanager
def _spy_on_reads(log: list) -> Iterator[None]:
    """Route srtrain.pretrained's safetensors reads through a recorder (the real reads run)."""
    real = pretrained.safe_open

    @contextmanager
    def opened(path, framework):
        with real(path, framework=framework) as f:
            yield _SpyFile(f, log)

    pretrained.safe_open = opened
    try:
        yield
    finally:
        pretrained.safe_open = real


# ---------------------------------------------------------------- sharded loads


def _load_sharded(directory: str, mesh, **fsdp_kwargs):
    config = read_hf_config(directory)
    config.tie_word_embeddings = False  # FSDP2 shards the head and embeddings apart
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    apply_fsdp(model, mesh, param_dtype=torch.float32, **fsdp_kwargs)
    model.to_empty(device="cpu")
    load_pretrained(model, directory)
    return model


def _worker(rank: int, world: int, port: int, dirs: dict[str, str], out: str) -> None:
    info = join_gloo(rank, world, port)
    meshes = {"1d": device_mesh(info)}
    if world == 2:
        meshes["hsdp"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        meshes["replicas"] = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    log: list = []
    results: dict = {"weights": {}, "reads": {}, "placements": {}}
    runs = [(case, "1d", False) for case in CASES] + [("llama-sharded", "1d", True)]
    runs += [("neox", mesh, False) for mesh in meshes if mesh != "1d"]
    for case, mesh, bf16 in runs:
        log.clear()
        with _spy_on_reads(log):
            model = _load_sharded(dirs[case], meshes[mesh], bf16_params=bf16)
        key = f"{case}/{mesh}/{'bf16' if bf16 else 'fp32'}"
        results["weights"][key] = {n: p.full_tensor() for n, p in model.named_parameters()}
        results["reads"][key] = list(log)
        results["placements"][key] = {str(p.placements) for p in model.parameters()}
        if world == 1 and not bf16:
            with torch.no_grad():
                results.setdefault("logits", {})[case] = model(input_ids=_batch()).logits
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loads(saved, tmp_path_factory) -> dict[int, list[dict]]:
    """world size → each rank's results (one rank in this process, two spawned)."""
    out = tmp_path_factory.mktemp("loads")
    dirs = {case: saved[case]["dir"] for case in CASES}
    _worker(0, 1, 0, dirs, str(out / "w1"))
    mp.spawn(_worker, args=(2, free_port(), dirs, str(out / "w2")), nprocs=2, join=True)
    return {
        world: [torch.load(out / f"w{world}.{r}", weights_only=False) for r in range(world)]
        for world in (1, 2)
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_load_equals_saved_weights_bitwise(loads, saved, world, case):
    for rank_results in loads[world]:
        got = rank_results["weights"][f"{case}/1d/fp32"]
        assert got.keys() == saved[case]["weights"].keys()
        for name, tensor in got.items():
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, saved[case]["weights"][name]), name
        assert rank_results["placements"][f"{case}/1d/fp32"] == {"(Shard(dim=0),)"}


@pytest.mark.slow
def test_tied_file_fills_the_head_from_the_embedding(loads, saved):
    got = loads[2][0]["weights"]["llama-tied/1d/fp32"]
    assert torch.equal(
        got["lm_head.weight"], saved["llama-tied"]["weights"]["model.embed_tokens.weight"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_params_hold_the_bf16_cast(loads, saved, world):
    got = loads[world][0]["weights"]["llama-sharded/1d/bf16"]
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, saved["llama-sharded"]["weights"][name].bfloat16()), name


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["hsdp", "replicas"])
def test_hsdp_mesh_loads_bitwise(loads, saved, mesh):
    for rank_results in loads[2]:
        assert rank_results["placements"][f"neox/{mesh}/fp32"] == {"(Replicate(), Shard(dim=0))"}
        for name, tensor in rank_results["weights"][f"neox/{mesh}/fp32"].items():
            assert torch.equal(tensor, saved["neox"]["weights"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_loaded_model_gives_the_original_logits(loads, saved, case):
    assert torch.equal(loads[1][0]["logits"][case], saved[case]["logits"])


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The global rows [start, stop) of rank's chunk of n rows (torch.chunk, as FSDP2)."""
    chunks = torch.arange(n).chunk(world)
    chunk = chunks[rank] if rank < len(chunks) else torch.arange(0)
    return (int(chunk[0]), int(chunk[-1]) + 1) if len(chunk) else (n, n)


@pytest.mark.slow
@pytest.mark.parametrize(
    "key,shard_ranks",
    [("llama-sharded/1d/fp32", 2), ("neox/hsdp/fp32", 2), ("neox/replicas/fp32", 1)],
)
def test_each_rank_reads_only_its_rows(loads, saved, key, shard_ranks):
    """Ranks of one shard group read disjoint row ranges that cover each tensor once; replicas
    read the same rows. No tensor is read whole."""
    case = key.split("/")[0]
    shapes = {
        n: t.shape
        for file in Path(saved[case]["dir"]).glob("*.safetensors")
        for n, t in load_file(file).items()
    }
    for rank, rank_results in enumerate(loads[2]):
        reads = rank_results["reads"][key]
        assert sorted(name for name, _ in reads) == sorted(shapes)  # one read per tensor
        for name, box in reads:
            shape = shapes[name]
            want = [_rows(shape[0], shard_ranks, rank % shard_ranks)]
            want += [(0, size) for size in shape[1:]]
            assert box == want, (rank, name)
    head = "embed_out.weight" if case == "neox" else "lm_head.weight"  # as transformers saves
    boxes = [dict(r["reads"][key])[head][0] for r in loads[2]]
    assert boxes == ([(0, 129), (129, 257)] if shard_ranks == 2 else [(0, 257), (0, 257)])


# ---------------------------------------------------------------- errors and file layouts


def _plain_model(family: str = "llama"):
    cls = LlamaForCausalLM if family == "llama" else GPTNeoXForCausalLM
    with torch.device("meta"):
        model = cls(_hf_config(family))
    return model.to_empty(device="cpu")


def _write_dir(path: Path, tensors: dict[str, torch.Tensor], family: str = "llama") -> Path:
    path.mkdir()
    _hf_config(family).save_pretrained(path)
    save_file({n: t.clone() for n, t in tensors.items()}, path / pretrained.WEIGHTS_FILE)
    return path


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_legacy_names_and_stale_buffers_are_accepted(tmp_path):
    weights = _hf_model("neox").state_dict()
    stored = {("embed_out.weight" if n == "lm_head.weight" else n): t for n, t in weights.items()}
    stored["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    stored["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    stored["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)
    model = _plain_model("neox")
    load_pretrained(model, _write_dir(tmp_path / "pythia", stored, "neox"))
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[name]), name
    fresh = GPTNeoXForCausalLM(_hf_config("neox"))
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, dict(fresh.named_buffers())[name]), name


def test_tied_model_loads_with_or_without_a_stored_head(tmp_path):
    source = _hf_model("llama", tied=True)
    weights = source.state_dict()
    without_head = {n: t for n, t in weights.items() if n != "lm_head.weight"}
    for name, stored in (("with-head", weights), ("without-head", without_head)):
        model = LlamaForCausalLM(_hf_config("llama", tied=True))
        assert model.lm_head.weight is model.model.embed_tokens.weight
        load_pretrained(model, _write_dir(tmp_path / name, stored))
        for key, param in model.named_parameters():
            assert torch.equal(param, weights[key]), (name, key)
        with torch.no_grad():
            assert torch.equal(
                model(input_ids=_batch()).logits, source(input_ids=_batch()).logits
            ), name


def test_bf16_file_into_fp32_params_is_exact(tmp_path):
    weights = {n: t.bfloat16() for n, t in _hf_model("llama").state_dict().items()}
    model = _plain_model()
    load_pretrained(model, _write_dir(tmp_path / "bf16", weights))
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, weights[name].float()), name


def test_missing_unexpected_and_misshapen_tensors_are_one_line(tmp_path):
    weights = _hf_model("llama").state_dict()
    model = _plain_model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)

    missing = {n: t for n, t in weights.items() if n != "model.layers.1.mlp.up_proj.weight"}
    path = _write_dir(tmp_path / "missing", missing)
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, path)
    assert _one_line(info) == f"{path} lacks model tensor(s) model.layers.1.mlp.up_proj.weight"

    path = _write_dir(tmp_path / "extra", {**weights, "model.extra.weight": torch.zeros(3)})
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, path)
    assert _one_line(info) == f"{path} holds tensor(s) the model does not have: model.extra.weight"

    misshapen = {**weights, "model.norm.weight": torch.ones(31)}
    path = _write_dir(tmp_path / "shape", misshapen)
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, path)
    assert _one_line(info) == (
        f"{path}: shape mismatch of model.norm.weight [31] (model [32]); "
        "the model must have the shape of its config.json"
    )
    for name, param in model.named_parameters():  # refused before anything was written
        assert bool((param == 7.0).all()), name


def test_missing_paths_and_other_models_are_one_line(tmp_path):
    model = _plain_model()
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, tmp_path / "nowhere")
    assert _one_line(info) == f"pretrained model directory {tmp_path / 'nowhere'} does not exist"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as info:
        read_hf_config(tmp_path / "empty")
    assert _one_line(info).startswith(f"model config not found: {tmp_path / 'empty'}/config.json")
    _hf_config("llama").save_pretrained(tmp_path / "no-weights")
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, tmp_path / "no-weights")
    assert _one_line(info) == (
        f"no model.safetensors or model.safetensors.index.json in "
        f"{tmp_path / 'no-weights'} (only safetensors weights are read)"
    )
    lost = tmp_path / "lost-shard"
    _hf_model("llama").save_pretrained(lost, max_shard_size="40KB")
    index = json.loads((lost / pretrained.INDEX_FILE).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (lost / shard).unlink()
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, lost)
    assert _one_line(info) == (
        f"weights file {lost / shard} listed in {lost / pretrained.INDEX_FILE} is missing"
    )
    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError) as info:
        read_hf_config(tmp_path / "gpt2")
    assert _one_line(info) == (
        f"model config {tmp_path / 'gpt2' / 'config.json'}: model_type "
        "'gpt2' is not supported; allowed: llama, mistral, qwen2, qwen3, gpt_neox"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.init_from={tmp_path / 'empty'}"])
    assert _one_line(info).startswith(f"model.init_from: {tmp_path / 'empty'} holds no config")


def test_files_outside_the_directory_or_unreadable_are_one_line(tmp_path):
    """An index may only name files of its own directory; a safetensors header that cannot
    be read (cut short, a length beyond the file, not JSON, offsets past the end, a dtype
    safetensors does not know) is one line naming the file."""
    model = _plain_model()
    sharded = tmp_path / "sharded" / "model"
    _hf_model("llama").save_pretrained(sharded, max_shard_size="40KB")
    index_file = sharded / pretrained.INDEX_FILE
    index = json.loads(index_file.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    (tmp_path / "outside.safetensors").write_bytes((sharded / shard).read_bytes())
    index["weight_map"]["model.norm.weight"] = "../../outside.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, sharded)
    assert _one_line(info) == (
        f"{index_file} lists weights file '../../outside.safetensors', outside {sharded}; an "
        "index names files of its own directory"
    )
    index["weight_map"]["model.norm.weight"] = shard
    index_file.write_text(json.dumps(index))
    whole = (sharded / shard).read_bytes()
    (sharded / shard).write_bytes(whole[: len(whole) // 2])  # a shard cut short
    with pytest.raises(PretrainedError) as info:
        load_pretrained(model, sharded)
    assert _one_line(info).startswith(
        f"{sharded / shard} is not a readable safetensors file (Error while deserializing header"
    )

    weights = _hf_model("llama").state_dict()
    for i, (name, data) in enumerate(MALFORMED_SAFETENSORS.items()):
        path = _write_dir(tmp_path / f"malformed-{i}", weights)
        (path / pretrained.WEIGHTS_FILE).write_bytes(data)
        with pytest.raises(PretrainedError) as info:
            load_pretrained(model, path)
        assert _one_line(info).startswith(
            f"{path / pretrained.WEIGHTS_FILE} is not a readable safetensors file (Error "
            "while deserializing header"
        ), name


def test_weights_of_a_non_float_dtype_are_one_line(tmp_path):
    """A tensor stored as integers (or another dtype no weight has) is one line naming the file
    and the tensor; nothing is cast."""
    weights = _hf_model("llama").state_dict()
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int64)
    path = _write_dir(tmp_path / "ints", weights)
    with pytest.raises(PretrainedError) as info:
        load_pretrained(_plain_model(), path)
    assert _one_line(info) == (
        f"{path / pretrained.WEIGHTS_FILE}: tensor model.norm.weight has dtype I64; weights are "
        "read from F64, F32, F16, BF16"
    )


def test_read_hf_config_is_set_up_for_training(saved):
    config = read_hf_config(saved["neox"]["dir"])
    assert (config.model_type, config.vocab_size, config.hidden_size) == ("gpt_neox", VOCAB, 32)
    assert config.use_cache is False and config._attn_implementation == "sdpa"


# ---------------------------------------------------------------- through the trainer


@pytest.fixture
def process_group():
    """Tear down the group of one that in-process trainer runs start."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _run(tiny_data: str, run_dir: Path, **extra):
    from srtrain.trainer import run

    return run(load_config(None, tiny_overrides(tiny_data, run_dir, **extra)))


@pytest.mark.slow
def test_export_round_trips_through_init_from(tiny_data, tmp_path, capsys, process_group):
    _run(tiny_data, tmp_path / "a", **{"train.steps": 10})
    checkpoint = latest(tmp_path / "a")
    export(checkpoint, tmp_path / "hf", dtype="float32")
    _, full = read_full_model(checkpoint)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["tie_word_embeddings"]) == (
        512,
        128,
        False,
    )

    mesh = device_mesh(init_distributed("cpu"))
    model = build_model("llama-tiny", 512, 64)
    apply_fsdp(model, mesh, param_dtype=torch.float32)
    model.to_empty(device="cpu")
    load_pretrained(model, tmp_path / "hf")
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), full[name]), name
    inputs, labels = next(BatchLoader(tiny_data, "train", 8, 64, 0, 1, 0))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    first_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()

    capsys.readouterr()
    init_from = {"model.init_from": str(tmp_path / "hf")}
    whole = _run(tiny_data, tmp_path / "b", **init_from, **{"train.steps": 3})
    assert f"initialised from {tmp_path / 'hf'}\n" in capsys.readouterr().out
    assert whole.losses[0] == first_loss
    _run(tiny_data, tmp_path / "c", **init_from, **{"train.steps": 2})
    capsys.readouterr()
    resumed = _run(tiny_data, tmp_path / "c", **init_from, **{"train.steps": 3})
    out = capsys.readouterr().out
    assert "resumed from step 2" in out and "initialised from" not in out
    assert resumed.losses == whole.losses[2:]  # the checkpoint's weights, not the export's


def test_data_vocab_larger_than_the_model_is_one_line(tiny_data, tmp_path, process_group):
    small = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": 300}, intermediate_size=48))
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError) as info:
        _run(tiny_data, tmp_path / "run", **{"model.init_from": str(tmp_path / "small")})
    assert _one_line(info) == (
        f"model: the data's vocabulary (512 tokens) is larger than the model's (300 in "
        f"{tmp_path / 'small'}); tokenize the data with the model's tokenizer"
    )
