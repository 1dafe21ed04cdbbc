"""The memory planner against real FSDP2 shards and SRAdamW states (and the gradients the
step inside backward holds), at big shapes, and its CLI."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from srtrain.config import ConfigError, load_config
from srtrain.models import build_model, init_weights, model_config
from srtrain.optim import SRAdamW
from srtrain.optim.in_backward import StepInBackward
from srtrain.parallel import apply_fsdp, device_mesh, fsdp_units, shard_group
from srtrain.plan import (
    GIB,
    LADDER,
    LADDER_VOCAB_SIZE,
    largest_fitting,
    main,
    meta_model,
    plan_ladder,
    plan_memory,
    plan_run,
)

from distributed import free_port, join_gloo

PRESETS = ("llama-tiny", "neox-tiny")
VOCAB = 257  # odd: embedding and head rows pad on 2 ranks
SEQ = 16
# (m, v, block size) of the states checked against SRAdamW
STATE_FORMATS = (
    ("fp32", "fp32", 32),
    ("bf16", "bf16", 32),
    ("fp8", "fp8", 32),
    ("fp4_e2m1", "fp4_e2m2", 32),
    ("fp8", "fp4_e2m2", 16),
)
SHADOW_SAMPLE = 3  # one block in three: several sampled blocks in every tiny shard
ROOT = Path(__file__).resolve().parents[1]


def _local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors)


def _fsdp_model(preset: str, mesh, bf16_params: bool) -> torch.nn.Module:
    model = build_model(preset, VOCAB, SEQ)
    compute = torch.bfloat16 if bf16_params else torch.float32
    apply_fsdp(model, mesh, param_dtype=compute, bf16_params=bf16_params)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    return model


def _in_flight_peak(preset: str, mesh, bf16_params: bool) -> tuple[int, bool]:
    """The most sharded gradient bytes this rank holds at once during a backward that steps
    each unit inside it (read as each gradient arrives, before the unit's step frees them),
    and whether every gradient was freed by the end of the step."""
    model = _fsdp_model(preset, mesh, bf16_params)
    params = list(model.parameters())
    peak = 0

    def arrived(_param: torch.Tensor) -> None:
        nonlocal peak
        peak = max(peak, _local_bytes(p.grad for p in params if p.grad is not None))

    for p in params:  # registered first: runs before StepInBackward's hook steps the unit
        p.register_post_accumulate_grad_hook(arrived)
    opt = SRAdamW(params, lr=1e-3)
    inside = StepInBackward(
        opt, fsdp_units(model), math.inf, shard_group(mesh), torch.device("cpu")
    )
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    inside.begin()
    model(input_ids=ids, labels=ids).loss.backward()
    inside.finish()
    return peak, all(p.grad is None for p in params)


def _measure(preset: str, mesh, bf16_params: bool) -> dict:
    """Parameter, gradient and per-format state bytes this rank holds after one step, and the
    gradient bytes held at once with the step inside backward."""
    model = _fsdp_model(preset, mesh, bf16_params)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    params = list(model.parameters())
    out = {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        # every rank allocates the padded shard, also where its rows run out
        "param_storage": sum(p.to_local().untyped_storage().nbytes() for p in params),
    }
    for m_format, v_format, block in STATE_FORMATS:
        opt = SRAdamW(params, lr=1e-3, m_format=m_format, v_format=v_format, block_size=block)
        opt.step()
        out[(m_format, v_format, block)] = opt.state_bytes()
    opt = SRAdamW(params, lr=1e-3, m_format="fp8", v_format="fp8", shadow_sample=SHADOW_SAMPLE)
    opt.step()
    out["shadow"] = _local_bytes(
        value for state in opt.state.values() for k, value in state.items() if "shadow" in k
    )
    out["in_flight_grads"], out["in_backward_freed"] = _in_flight_peak(preset, mesh, bf16_params)
    return out


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    mesh = device_mesh(join_gloo(rank, world_size, port))
    results = {
        (preset, bf16): _measure(preset, mesh, bf16) for preset in PRESETS for bf16 in (False, True)
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def measured(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"plan{world}")
    mp.spawn(_worker, args=(world, free_port(), str(out)), nprocs=world)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("bf16_params", [False, True], ids=["fp32params", "bf16params"])
def test_exact_bytes_match_fsdp2_and_sradamw(measured, preset, bf16_params):
    world, ranks = measured
    runs = [r[(preset, bf16_params)] for r in ranks]
    config = model_config(preset, VOCAB, SEQ)
    common = dict(gpus=world, seq_len=SEQ, micro_batch=2, bf16_params=bf16_params)
    plan = plan_memory(config, **common)
    assert plan.params == max(r["params"] for r in runs)
    assert plan.grads == max(r["grads"] for r in runs)
    assert all(r["param_storage"] == plan.params for r in runs)
    if world == 2:  # the odd vocabulary leaves rank 1 short: the plan is the larger rank
        assert runs[1]["params"] < runs[0]["params"]
    for m_format, v_format, block in STATE_FORMATS:
        states = plan_memory(
            config, **common, m_format=m_format, v_format=v_format, block_size=block
        ).optimizer_states
        assert states == max(r[(m_format, v_format, block)] for r in runs), (m_format, block)
    shadow = plan_memory(config, **common, shadow_sample=SHADOW_SAMPLE).shadow
    assert shadow > 0 and all(r["shadow"] == shadow for r in runs)
    assert plan_memory(config, **common).shadow == 0
    assert plan_memory(config, **common, optimizer="torch_adamw", shadow_sample=3).shadow == 0


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("bf16_params", [False, True], ids=["fp32params", "bf16params"])
def test_in_flight_gradients_cover_what_the_step_inside_backward_holds(
    measured, preset, bf16_params
):
    """The planner's two units in flight are never below the sharded gradients a rank holds
    at once; here each unit is stepped and freed before the next arrives, so the rank holds
    one unit at most, and the estimate is at most twice that."""
    world, ranks = measured
    runs = [r[(preset, bf16_params)] for r in ranks]
    assert all(r["in_backward_freed"] for r in runs)
    config = model_config(preset, VOCAB, SEQ)
    common = dict(gpus=world, seq_len=SEQ, micro_batch=2, bf16_params=bf16_params)
    plan = plan_memory(config, **common, step_in_backward=True)
    held = max(r["in_flight_grads"] for r in runs)
    assert 0 < held <= plan.grads <= 2 * held
    assert plan.grads < plan_memory(config, **common).grads == max(r["grads"] for r in runs)


LLAMA_70B = LlamaConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _shapes(config) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in meta_model(config).parameters()]


def test_llama_7b_torch_adamw_is_16_bytes_per_parameter():
    config = model_config("llama-7b", 32000, 4096)
    n = sum(math.prod(s) for s in _shapes(config))
    assert n == 6_738_415_616
    plan = plan_memory(config, seq_len=4096, micro_batch=1, optimizer="torch_adamw")
    assert plan.params == plan.grads == 4 * n
    assert plan.params + plan.grads + plan.optimizer_states == 16 * n
    on8 = plan_memory(config, gpus=8, seq_len=4096, micro_batch=1, optimizer="torch_adamw")
    assert on8.params + on8.grads + on8.optimizer_states == 16 * n // 8  # every dim0 % 8 == 0
    # HSDP: 2 replicas of 4 shard like 4 GPUs
    hsdp = plan_memory(config, gpus=8, replicas=2, seq_len=4096, micro_batch=1)
    assert hsdp == plan_memory(config, gpus=4, seq_len=4096, micro_batch=1)


def test_llama_70b_gqa_fp4_bf16_params_on_8_gpus():
    shapes = _shapes(LLAMA_70B)
    n = sum(math.prod(s) for s in shapes)
    assert n == 70_553_706_496
    plan = plan_memory(
        LLAMA_70B,
        gpus=8,
        seq_len=4096,
        micro_batch=1,
        bf16_params=True,
        activation_checkpointing=True,
        m_format="fp4",
        v_format="fp4",
    )
    assert plan.params == plan.grads == 2 * n // 8
    matrices = sum(math.prod(s) for s in shapes if len(s) == 2)
    vectors = n - matrices
    # FP4 per moment: half a byte per element and a scale byte per 32 of a row (every
    # row length divides by 32); 1-D norms take a code byte and a scale byte each
    assert plan.m_state == plan.v_state == (matrices // 2 + matrices // 32 + 2 * vectors) // 8
    per_param = (plan.params + plan.grads + plan.optimizer_states) * 8 / n
    assert 5.06 < per_param < 5.07
    # with 6 GPUs rows pad to ceil(rows / 6): more than an even split
    on6 = plan_memory(LLAMA_70B, gpus=6, seq_len=4096, micro_batch=1, bf16_params=True)
    assert on6.params == 2 * sum(-(-s[0] // 6) * math.prod(s[1:]) for s in shapes) > 2 * n / 6
    assert plan.fits(int(139 * GIB))


def test_activation_checkpointing_and_accumulation_terms():
    config = model_config("llama-1b", 32000, 2048)
    kw = dict(seq_len=2048, micro_batch=4)
    full, ac = plan_memory(config, **kw), plan_memory(config, **kw, activation_checkpointing=True)
    assert ac.activations < full.activations / 5 and ac.logits == full.logits
    # logits: bf16 logits and three FP32 tensors of their size
    assert full.logits == 4 * 2048 * 32000 * (2 + 12)
    n = sum(math.prod(s) for s in _shapes(config))
    assert full.accumulated_grads == 0
    assert plan_memory(config, **kw, micro_batches=2).accumulated_grads == 4 * n
    assert (
        plan_memory(config, **kw, micro_batches=2, reduce_every_micro_batch=True).accumulated_grads
        == 0
    )


def test_query_width_activations_follow_heads_times_head_dim():
    """Qwen3 sets head_dim apart from hidden/heads: the queries, SDPA's output and its copy
    into o_proj are heads·head_dim wide, counted so, not at hidden width."""
    from transformers import Qwen3Config

    dims = dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1000,
    )
    wide = Qwen3Config(**dims, head_dim=128)  # q_dim 4096
    narrow = Qwen3Config(**dims, head_dim=80)  # q_dim 2560 = hidden
    kw = dict(seq_len=512, micro_batch=2)
    tokens, c = 2 * 512, 2
    for checkpointing, blocks_saved in ((False, 4), (True, 1)):
        a = plan_memory(wide, **kw, activation_checkpointing=checkpointing).activations
        b = plan_memory(narrow, **kw, activation_checkpointing=checkpointing).activations
        kv_extra = 2 * tokens * c * 8 * (128 - 80)  # rotated keys and values
        q_extra = 3 * tokens * c * 32 * (128 - 80)
        assert a - b == blocks_saved * (q_extra + kv_extra)


def test_step_in_backward_holds_two_units_of_gradients():
    """LLaMA-7B: the two largest consecutive units are two decoder blocks (202.4M parameters
    each, more than the head's 131.1M), sharded over the GPUs, in the parameters' dtype; every
    other term is the ordinary step's, and the total shrinks by the rest of the gradients."""
    config = model_config("llama2-7b", 32000, 2048)
    block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    kw = dict(seq_len=2048, micro_batch=1, activation_checkpointing=True, m_format="fp4")
    for gpus, bf16_params in ((1, True), (8, True), (8, False)):
        run = dict(kw, gpus=gpus, bf16_params=bf16_params, v_format="fp4")
        ordinary = plan_memory(config, **run)
        inside = plan_memory(config, **run, step_in_backward=True)
        assert inside.grads == 2 * block // gpus * (2 if bf16_params else 4)
        assert inside.total == ordinary.total - ordinary.grads + inside.grads
        assert inside.total < ordinary.total
    one = plan_memory(config, **kw, bf16_params=True, v_format="fp4", step_in_backward=True)
    assert one.grads == 2 * block * 2 and round(one.grads / GIB, 2) == 0.75
    # the head outweighs a block when the vocabulary is large enough: head + last block
    wide = model_config("llama2-7b", 128256, 2048)
    head = 128256 * 4096
    assert plan_memory(wide, **kw, step_in_backward=True).grads == 4 * (head + block)
    with pytest.raises(ValueError, match="step_in_backward steps SRAdamW"):
        plan_memory(config, **kw, optimizer="torch_adamw", step_in_backward=True)
    with pytest.raises(ValueError, match="over 2 micro-batches"):
        plan_memory(config, **kw, micro_batches=2, step_in_backward=True)


def test_one_unit_holds_the_whole_model_gathered_and_auto_takes_it_where_it_fits():
    config = model_config("llama-1b", 32000, 1024)
    kw = dict(seq_len=1024, micro_batch=4)
    blocks, whole = plan_memory(config, **kw), plan_memory(config, **kw, units="model")
    n = sum(p.numel() for p in meta_model(config).parameters())
    assert (whole.gathered_params, whole.gathered_grads) == (2 * n, (2 + 4) * n)
    assert blocks.gathered_params < whole.gathered_params / 5
    with pytest.raises(ValueError, match="step_in_backward"):
        plan_memory(config, **kw, units="model", step_in_backward=True)

    overrides = [
        "model.preset=llama-1b",
        "model.seq_len=1024",
        "data.vocab_size=32000",
        "data.dir=/nonexistent",
        "train.global_batch_size=8",
    ]

    def units(extra: list[str], gpus: int = 1, gib: float = 139.8) -> str:
        return plan_run(load_config(None, [*overrides, *extra]), gpus, None, int(gib * GIB)).units

    assert units([]) == "model"
    assert units([], gpus=8) == "blocks"
    assert units(["optim.step_in_backward=true"]) == "blocks"
    assert units([], gib=20) == "blocks"  # fits with a unit a block, not with the whole model
    assert units(["parallel.fsdp_units=blocks"]) == "blocks"
    plans = plan_run(load_config(None, overrides), 1)
    assert plans.plan == plan_memory(
        plans.config, gpus=1, seq_len=1024, micro_batch=8, shadow_sample=1024, units="model"
    )


def test_fsdp_units_setting_is_checked():
    base = ["data.dir=/nonexistent"]
    with pytest.raises(ConfigError, match=r"parallel\.fsdp_units: 'layers' is not allowed"):
        load_config(None, [*base, "parallel.fsdp_units=layers"])
    with pytest.raises(ConfigError, match=r"parallel\.fsdp_units=model: optim\.step_in_backward"):
        load_config(None, [*base, "parallel.fsdp_units=model", "optim.step_in_backward=true"])


def test_plan_run_steps_inside_backward_and_the_baseline_after():
    overrides = [
        "model.preset=llama2-7b",
        "model.seq_len=2048",
        "data.vocab_size=32000",
        "data.dir=/nonexistent",
        "train.global_batch_size=8",
        "parallel.bf16_params=true",
        "parallel.activation_checkpointing=true",
        "optim.m_format=fp4",
        "optim.v_format=fp4",
    ]
    ordinary = plan_run(load_config(None, overrides), 8)
    inside = plan_run(load_config(None, [*overrides, "optim.step_in_backward=true"]), 8)
    assert inside.baseline == ordinary.baseline
    assert inside.plan == plan_memory(
        inside.config,
        gpus=8,
        seq_len=2048,
        micro_batch=1,
        activation_checkpointing=True,
        bf16_params=True,
        m_format="fp4",
        v_format="fp4",
        shadow_sample=1024,
        step_in_backward=True,
    )
    assert inside.plan.total < ordinary.plan.total


def test_ladder_shapes_are_named_by_their_parameter_counts():
    from srtrain.bench.capacity import LADDER as CAPACITY_LADDER
    from srtrain.models import shape_config

    counts = {
        name: sum(math.prod(s) for s in _shapes(shape_config(shape, LADDER_VOCAB_SIZE, 2048)))
        for name, shape in LADDER.items()
    }
    assert list(counts.values()) == sorted(counts.values())
    for name, shape in LADDER.items():
        assert round(counts[name] / 1e9) == int(name.removeprefix("gpt3-").removesuffix("b"))
        if shape.family == "llama":
            assert shape.hidden == 128 * shape.heads and shape.intermediate % 256 == 0
            assert shape.key_value_heads == shape.heads and not shape.tied
    gpt3 = LADDER["gpt3-175b"]  # GPT-3 175B: 96 layers, d_model 12288, 96 heads, MLP 4x
    assert (gpt3.family, gpt3.layers, gpt3.hidden, gpt3.heads) == ("gpt-neox", 96, 12288, 96)
    assert gpt3.intermediate == 4 * gpt3.hidden
    shared = set(LADDER) & set(CAPACITY_LADDER)
    assert shared == {"26b", "40b", "52b"}
    assert all(LADDER[n] == CAPACITY_LADDER[n] for n in shared)


ONE_NODE = [
    "train.global_batch_size=8",
    "model.seq_len=2048",
    "parallel.activation_checkpointing=true",
    "parallel.bf16_params=true",
    "optim.m_format=fp4",
    "optim.v_format=fp4",
]


def test_ladder_plans_the_run_on_each_shape():
    from srtrain.models import shape_config

    cfg = load_config(None, ONE_NODE)
    shapes = {n: LADDER[n] for n in ("65b", "100b", "gpt3-175b")}
    gpu_bytes = int(139.8 * GIB)
    ladder = plan_ladder(cfg, 8, gpu_bytes, shapes)
    assert list(ladder) == list(shapes)
    for name, shape in shapes.items():
        model = shape_config(shape, LADDER_VOCAB_SIZE, 2048)
        assert ladder[name] == plan_run(cfg, 8, model, gpu_bytes)
    assert largest_fitting(ladder) == "gpt3-175b"  # FP4 states, BF16 weights
    assert largest_fitting(ladder, baseline=True) == "65b"  # torch's AdamW
    assert largest_fitting(plan_ladder(cfg, 8, 2 * GIB, shapes)) is None


def test_cli_ladder_one_node_with_the_step_inside_backward(capsys):
    """README's projection: the step inside backward fits a larger shape on one node of 8
    H200s than the ordinary step, which fits a larger one than torch's AdamW; the GPT-3-like
    shape fits with it and not with torch's AdamW."""
    node = ["--ladder", "--gpus", "8", "--gpu-memory", "139.8", *ONE_NODE]
    assert main([*node, "optim.step_in_backward=true"]) == 0
    inside = capsys.readouterr().out.splitlines()
    assert main(node) == 0
    ordinary = capsys.readouterr().out.splitlines()

    def largest(lines: list[str]) -> tuple[float, float]:
        assert lines[-1].startswith("largest that fits: this run ")
        ours, base = re.findall(r"\(([\d.]+)B\)", lines[-1])
        return float(ours), float(base)

    assert any(line.startswith("step inside backward (optim.step_in_backward)") for line in inside)
    (ours_in, torch_in), (ours, torch_) = largest(inside), largest(ordinary)
    assert ours_in > ours > torch_ == torch_in
    gpt3 = next(line for line in inside if line.startswith("gpt3-175b")).split()
    assert gpt3[1:] == ["GPTNeoX", "174.75B", gpt3[3], "yes", gpt3[5], "no"]
    assert inside[-2] == "GPU memory: 139.8 GiB (--gpu-memory)"


def _run_cli(*args: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "srtrain.plan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def test_cli_tiny_fits():
    rc, out, err = _run_cli("--config", "configs/tiny.yaml")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[-1] == "fits: yes"
    for row in ("parameters", "gradients", "optimizer m", "optimizer v", "total"):
        assert any(line.startswith(row) for line in lines), row


def test_cli_prints_the_step_inside_backward(capsys):
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "model.preset=llama-1b"]
    assert main([*args, "optim.step_in_backward=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "stepped inside backward; baseline: torch AdamW" in lines[3]
    assert lines[3].endswith("stepped after backward")
    assert lines[4].startswith("step inside backward (optim.step_in_backward)")
    inside = next(line for line in lines if line.startswith("gradients"))
    assert inside.split()[:4] == ["gradients", "(this", "run:", "in"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "stepped after backward; baseline" in lines[3]
    ordinary = next(line for line in lines if line.startswith("gradients"))
    assert ordinary.split()[0] == "gradients" and ordinary.split()[-1] == inside.split()[-1]
    assert float(inside.split()[-2]) < float(ordinary.split()[-2])


def test_cli_big_model_does_not_fit(capsys):
    rc = main(
        [
            "--config",
            str(ROOT / "configs/tiny.yaml"),
            "--gpu-memory",
            "10",
            "model.preset=llama-7b",
            "model.seq_len=4096",
            "train.global_batch_size=1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[-1] == "fits: no"


@pytest.mark.parametrize(
    "args", [["--gpus", "0"], ["--gpus", "3"], ["--gpu-memory", "0"], ["optim.m_format=fp5"]]
)
def test_cli_bad_arguments_are_one_line(capsys, args):
    rc = main(["--config", str(ROOT / "configs/tiny.yaml"), *args])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err


def test_gpus_must_split_into_replicas():
    cfg = load_config(ROOT / "configs/tiny.yaml")
    cfg.parallel.replicas = 4  # parallel.replicas (HSDP), read where the config has it
    with pytest.raises(ConfigError, match=r"--gpus: 6 GPUs .* parallel.replicas=4"):
        plan_run(cfg, 6)
    assert plan_run(cfg, 8).plan == plan_memory(
        model_config("llama-tiny", 4096, 128),
        gpus=2,
        seq_len=128,
        micro_batch=2,
        shadow_sample=cfg.optim.shadow_sample,
    )


def test_auto_checkpointing_turns_on_only_where_the_run_does_not_fit():
    """The trainer's auto rule and the planner's agree: on where the plan without
    checkpointing passes 95% of the GPU, off below, with the planned figure in its line (a
    unit a block: with parallel.fsdp_units=auto a tighter GPU first gives up the one unit)."""
    from srtrain.build import checkpointing_on_gpu
    from srtrain.models import model_config

    overrides = ["model.preset=llama-1b", "model.seq_len=1024", "parallel.fsdp_units=blocks"]
    cfg = load_config(None, overrides)
    config = model_config("llama-1b", 32000, 1024)
    without = load_config(None, [*overrides, "parallel.activation_checkpointing=false"])
    needed = plan_run(without, 1, config).plan.total
    roomy, tight = int(needed / 0.94), int(needed / 0.96)
    on, why = checkpointing_on_gpu(cfg, 1, config, roomy)
    assert (
        not on and why == f" (auto: planned {needed / GIB:.1f} of {roomy / GIB:.1f} GiB without it)"
    )
    assert checkpointing_on_gpu(cfg, 1, config, tight)[0]
    assert plan_run(cfg, 1, config, roomy).checkpointing[0] is False
    assert plan_run(cfg, 1, config, tight).checkpointing[0] is True
