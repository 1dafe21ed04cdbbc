"""Memory planner: the bytes one GPU holds to train a LLaMA or GPT-NeoX model under FSDP2.

``python -m srtrain.plan --config configs/X.yaml [--gpus N] [--gpu-memory GiB] [k=v ...]``
prints, per GPU, the configured run beside the same run with torch's AdamW (FP32
master weights and FP32 states), and ends with ``fits: yes`` or ``fits: no``. With
``--ladder`` it plans the configured run on each shape of :data:`LADDER` instead of the
config's model, one line a shape, and ends with the largest shape that fits each optimizer.

Exact terms (they equal what a rank holds; ``tests/test_plan.py`` checks them against a
real FSDP2 model and SRAdamW on gloo ranks). Each parameter is sharded on dim 0 over the
shard group of S = gpus / replicas ranks, padded to ``ceil(rows / S)`` rows on every rank;
the planner reports that largest shard:

- parameters: the shards in FP32 (master weights) or BF16 (``bf16_params``);
- gradients: the sharded gradients, in the dtype of the sharded parameters (with the
  step inside backward, an estimate: see below);
- optimizer states: per parameter shard, SRAdamW's m and v codes in their storage dtype
  plus one scale byte per block of a row for FP8/FP4 (FP4 codes two to a byte, rows
  padded to whole bytes and blocks); torch's AdamW holds ``exp_avg`` and ``exp_avg_sq``
  in the parameter dtype;
- FP32 shadow (``optim.shadow_sample``, SRAdamW): FP32 m and v of the sampled blocks, in a
  tensor of the same size on every rank of the shard group
  (:func:`srtrain.optim.shadow.capacity`).

Transient and estimated terms (FSDP2 units: each decoder block, the input embeddings,
the output head, and the root holding the rest, e.g. the final norm):

- gathered parameters: the unsharded (padded) parameters of two consecutive units in
  the compute dtype (the one running and the one all-gathered ahead), plus the root's;
- gathered gradients: the unsharded gradients of the largest unit in the compute dtype
  and their reduce-scatter copy in the reduce dtype (FP32);
- accumulated gradients: with more than one micro-batch per step, the trainer skips the
  gradient reduction on all but the last (``set_requires_gradient_sync(False)``), and
  FSDP2 keeps the whole model's unsharded gradients in the reduce dtype meanwhile;
- gradients with the step inside backward (``optim.step_in_backward``,
  :mod:`srtrain.optim.in_backward`): each unit is stepped as soon as its gradients are
  reduce-scattered and its gradients are freed, so the whole model's sharded gradients are
  never held together. The planner counts the sharded gradients (parameter dtype) of the two
  largest consecutive units in the order backward reduces them (the output head, the
  blocks from last to first, the input embeddings, then the root): one unit being stepped
  while the next is reduced. An estimate: the device may hold a freed unit's gradients
  until its step has run. The mode refuses gradient accumulation, so there are no
  accumulated gradients;
- activations and logits: see :func:`activation_bytes` (an estimate);
- a fixed allowance for the CUDA context, library workspaces and allocator
  fragmentation (:data:`FIXED_OVERHEAD_BYTES`).

The constants below are the knobs a calibration against measured peak memory adjusts.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPTNeoXConfig, PretrainedConfig

from srtrain.config import (
    AUTO,
    FSDP_UNIT_KINDS,
    Config,
    ConfigError,
    load_config,
    resolve_format,
    validate_world,
)
from srtrain.models import Shape, shape_config
from srtrain.numerics.formats import (
    Format,
    check_block_size,
    check_moment_formats,
    code_shape,
    scale_shape,
)
from srtrain.optim.shadow import capacity as shadow_capacity
from srtrain.optim.sradamw import storage_dtype

GIB = 2**30

GPU_MEMORY_GIB = 139.0
"""Default ``--gpu-memory``: an H200 sold as 141 GB shows 140.4 GiB to CUDA; 139 GiB is
what a training process can expect to use beside the driver's own reservations."""

FIXED_OVERHEAD_BYTES = 2 * GIB
"""Per GPU, independent of the model: the CUDA context and loaded kernels (about 0.5 GiB
with torch on an H200), cuBLAS and NCCL workspaces, and the caching allocator's
fragmentation."""

LOGIT_FP32_COPIES = 3
"""FP32 tensors of the logits' size alive at the loss's backward, beside the logits in the
compute dtype: the log-softmax output that cross-entropy saves, the gradient arriving at it
and the gradient it passes to the logits (the FP32 upcast of the forward is freed by then)."""


@dataclass(frozen=True)
class LayerActivations:
    """Tensors one decoder layer saves for backward, per token, counted in units of
    ``hidden`` (compute dtype), ``q_dim`` = heads·head_dim (compute dtype), ``kv_dim`` =
    kv_heads·head_dim (compute dtype), ``intermediate`` (compute dtype) and ``hidden`` in
    FP32. ``q_dim`` equals ``hidden`` unless the config sets a ``head_dim`` of its own
    (Qwen3: 32 heads of 128 at hidden 2560)."""

    hidden: int
    query: int
    kv: int
    intermediate: int
    fp32_hidden: int


LLAMA_LAYER = LayerActivations(hidden=2, query=3, kv=2, intermediate=4, fp32_hidden=2)
"""LLaMA block: the two RMSNorm outputs (inputs of the q/k/v and gate/up projections,
2·hidden); the rotated queries, SDPA's output and its contiguous copy into o_proj
(3·q_dim); the rotated keys and the values (2·kv_dim); gate, SiLU(gate), up and their
product into down_proj (4·intermediate); each RMSNorm's FP32 upcast of its input (2·hidden
in FP32)."""

NEOX_LAYER = LayerActivations(hidden=3, query=3, kv=2, intermediate=2, fp32_hidden=0)
"""GPT-NeoX block (parallel residual): the block input both LayerNorms save and their two
outputs (3·hidden); the queries, SDPA's output and its copy into the dense projection
(3·q_dim); keys and values (2·kv_dim); dense_h_to_4h's output and GELU's output
(2·intermediate)."""

FINAL_NORM = LayerActivations(hidden=1, query=0, kv=0, intermediate=0, fp32_hidden=1)
"""The final norm: its output (the head's input) and, for RMSNorm, its FP32 upcast."""

AUTO_CHECKPOINTING_MARGIN = 0.05
"""``parallel.activation_checkpointing=auto`` leaves checkpointing off when the planned peak
without it stays under this share below the GPU's memory: room for the estimated terms'
error (measured within a few percent of the plan)."""

OPTIMIZERS = ("sradamw", "torch_adamw")


def _llama(hidden: int, intermediate: int, layers: int) -> Shape:
    return Shape(
        "llama", hidden=hidden, intermediate=intermediate, heads=hidden // 128, layers=layers
    )


LADDER_VOCAB_SIZE = 32000
LADDER: dict[str, Shape] = {
    "26b": _llama(6656, 17920, 48),  # 26.11B, the capacity ladder's 26b
    "40b": _llama(7168, 19200, 64),  # 40.04B, the capacity ladder's 40b
    "52b": _llama(8192, 22016, 64),  # 52.33B, the capacity ladder's 52b
    "65b": _llama(8192, 22016, 80),  # 65.29B, LLaMA-65B
    "100b": _llama(10240, 27648, 78),  # 99.62B
    "135b": _llama(11264, 30208, 88),  # 135.21B
    "175b": _llama(12288, 32768, 96),  # 174.73B, GPT-3 175B's dimensions in LLaMA blocks
    "gpt3-175b": Shape(
        "gpt-neox", hidden=12288, intermediate=49152, heads=96, layers=96
    ),  # 174.75B
    "223b": _llama(13312, 35840, 104),  # 223.43B
    "278b": _llama(14336, 38400, 112),  # 277.96B
    "298b": _llama(14336, 38400, 120),  # 297.75B
    "342b": _llama(15360, 41216, 120),  # 342.14B
    "409b": _llama(16384, 44032, 126),  # 409.04B
}
"""The shapes ``--ladder`` plans, smallest first, named by their parameter count at
:data:`LADDER_VOCAB_SIZE` (untied embeddings): LLaMA shapes in the style of the capacity
ladder's (``srtrain.bench.capacity``; multi-head attention, head dimension 128, an MLP of
about 2.7·hidden), 175b with an MLP of 8/3·hidden as LLaMA sizes it; and gpt3-175b, GPT-3
175B's dimensions (96 layers, hidden 12288, 96 heads, MLP 4·hidden) in GPT-NeoX blocks,
whose two-matrix GELU MLP is GPT-3's (a LLaMA block's three-matrix MLP at 4·hidden would
make 232.72B)."""
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_REDUCE_DTYPE = torch.float32


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one GPU holds at the peak of a training step (the rank with the largest shards).

    ``params``, ``grads``, ``m_state``, ``v_state`` and ``shadow`` are exact (``grads`` an
    estimate with the step inside backward); the others are estimates (see the module
    docstring)."""

    params: int
    grads: int
    m_state: int
    v_state: int
    shadow: int
    gathered_params: int
    gathered_grads: int
    accumulated_grads: int
    activations: int
    logits: int
    overhead: int

    @property
    def optimizer_states(self) -> int:
        """Both moments, codes and block scales."""
        return self.m_state + self.v_state

    @property
    def total(self) -> int:
        """Every term together: the planned peak."""
        return sum(getattr(self, f.name) for f in fields(self))

    def fits(self, gpu_bytes: int) -> bool:
        """Whether the planned peak fits in ``gpu_bytes`` of GPU memory."""
        return self.total <= gpu_bytes


def _dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(f"{what}: {value!r} is not allowed; choose one of {', '.join(_DTYPES)}")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shard_shape(shape: Sequence[int], shard_size: int) -> tuple[int, ...]:
    """The largest rank's shard of a parameter: dim 0 split into ``ceil(rows / S)`` rows."""
    shape = tuple(shape)
    if not shape:
        return shape
    return (-(-shape[0] // shard_size), *shape[1:])


def state_bytes(fmt: Format, shape: Sequence[int], block_size: int) -> int:
    """Bytes of one SRAdamW moment for a (local) parameter of ``shape``: codes in their
    storage dtype plus, for scaled formats, one byte per block of each row."""
    codes = math.prod(code_shape(fmt, tuple(shape))) * _nbytes(storage_dtype(fmt))
    scales = math.prod(scale_shape(tuple(shape), block_size)) if fmt.scaled else 0
    return codes + scales


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The causal LM of ``config`` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def fsdp_units(model: nn.Module) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of each FSDP2 unit in forward order as ``apply_fsdp`` wraps them:
    input embeddings, each decoder block, the output head; last, the root (the rest)."""
    from srtrain.models import decoder_layers

    modules = [model.get_input_embeddings(), *decoder_layers(model), model.get_output_embeddings()]
    units, seen = [], set()
    for module in modules:
        params = list(module.parameters())
        seen.update(id(p) for p in params)
        units.append([tuple(p.shape) for p in params])
    units.append([tuple(p.shape) for p in model.parameters() if id(p) not in seen])
    return units


def in_flight_elements(units: Sequence[Sequence[tuple[int, ...]]], shard_size: int) -> int:
    """Sharded gradient elements (the largest rank's) held at once with the step inside
    backward: the two largest consecutive ``units`` (:func:`fsdp_units`) in the order
    backward reduces them: the head, the blocks from last to first, the input embeddings,
    then the root."""
    sizes = [sum(math.prod(shard_shape(s, shard_size)) for s in unit) for unit in units]
    order = [*reversed(sizes[:-1]), sizes[-1]]
    return max((a + b for a, b in itertools.pairwise(order)), default=sum(order))


def activation_bytes(
    config: PretrainedConfig,
    *,
    seq_len: int,
    micro_batch: int,
    activation_checkpointing: bool,
    compute_dtype: torch.dtype,
) -> tuple[int, int]:
    """Estimated (activations, logits) bytes of one micro-batch at the peak of backward.

    With T = micro_batch·seq_len tokens, c the compute dtype's bytes, h hidden, f
    intermediate, q = heads·head_dim, k = kv_heads·head_dim, L layers, V vocabulary, and a
    layer's saved tensors (:data:`LLAMA_LAYER`, :data:`NEOX_LAYER`) ``layer = T·(c·(n_h·h +
    n_q·q + n_k·k + n_f·f) + 4·n_32·h)``:

    - without activation checkpointing: ``L·layer + final_norm``;
    - with it: ``L·T·h·c`` (each block's saved input) ``+ layer`` (one block recomputed
      in backward) ``+ final_norm``;
    - logits: ``T·V·(c + 4·LOGIT_FP32_COPIES)``.

    SDPA runs flash or memory-efficient attention on CUDA, which saves no seq_len² term.
    This is an estimate: autograd's exact lifetimes, the allocator and kernels' scratch
    space move the measured peak around it.
    """
    c = _nbytes(compute_dtype)
    tokens = micro_batch * seq_len
    h = config.hidden_size
    f = config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q_dim = heads * head_dim
    kv_dim = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    neox = isinstance(config, GPTNeoXConfig)
    counts = NEOX_LAYER if neox else LLAMA_LAYER
    final_counts = replace(FINAL_NORM, fp32_hidden=0) if neox else FINAL_NORM

    def saved(n: LayerActivations) -> int:
        return tokens * (
            c * (n.hidden * h + n.query * q_dim + n.kv * kv_dim + n.intermediate * f)
            + 4 * n.fp32_hidden * h
        )

    layers = config.num_hidden_layers
    if activation_checkpointing:
        body = layers * tokens * h * c + saved(counts)
    else:
        body = layers * saved(counts)
    logits = tokens * config.vocab_size * (c + 4 * LOGIT_FP32_COPIES)
    return body + saved(final_counts), logits


def plan_memory(
    config: PretrainedConfig,
    *,
    gpus: int = 1,
    replicas: int = 1,
    seq_len: int,
    micro_batch: int,
    micro_batches: int = 1,
    reduce_every_micro_batch: bool = False,
    activation_checkpointing: bool = False,
    bf16_params: bool = False,
    optimizer: str = "sradamw",
    m_format: str = "bf16",
    v_format: str = "bf16",
    block_size: int = 32,
    shadow_sample: int = 0,
    compute_dtype: str | torch.dtype = "bf16",
    step_in_backward: bool = False,
    units: str = "blocks",
) -> MemoryPlan:
    """Bytes per GPU to train ``config`` on ``gpus`` GPUs in ``replicas`` replicas of
    FSDP2 shard groups of gpus/replicas ranks, ``micro_batch`` sequences of ``seq_len``
    tokens per forward and ``micro_batches`` forwards per step on each GPU. Several
    micro-batches keep the model's unsharded FP32 gradients unless
    ``reduce_every_micro_batch``.

    ``optimizer`` "sradamw" stores m and v in ``m_format``/``v_format`` (fp32, bf16, fp8,
    fp4, fp4_e2m1 for m, fp4_e2m2 for v) with ``block_size``; "torch_adamw" stores them
    in the parameter dtype. SRAdamW keeps an FP32 shadow of m and v on one block in
    ``shadow_sample`` (0: none). ``compute_dtype`` ("bf16", "fp32" or the torch dtype) is the
    forward/backward dtype; gradients are reduced in FP32. ``step_in_backward`` steps each
    FSDP2 unit inside backward (SRAdamW, one micro-batch per step): only the gradients of
    the units in flight are held (see the module docstring). ``units`` is how
    ``apply_fsdp`` groups the parameters: "blocks" gathers two consecutive units at a time,
    "model" gathers the whole model once and holds it, with its unsharded gradients, through
    backward.
    """
    for name, value in (
        ("gpus", gpus),
        ("replicas", replicas),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("micro_batches", micro_batches),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if gpus % replicas:
        raise ValueError(f"gpus ({gpus}) must be a multiple of replicas ({replicas})")
    if isinstance(shadow_sample, bool) or not isinstance(shadow_sample, int) or shadow_sample < 0:
        raise ValueError(f"shadow_sample must be a non-negative integer, got {shadow_sample!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer {optimizer!r} is not allowed; choose one of {', '.join(OPTIMIZERS)}"
        )
    if step_in_backward and optimizer != "sradamw":
        raise ValueError(f"step_in_backward steps SRAdamW; optimizer {optimizer!r} cannot")
    if units not in FSDP_UNIT_KINDS:
        raise ValueError(
            f"units {units!r} is not allowed; choose one of {', '.join(FSDP_UNIT_KINDS)}"
        )
    if step_in_backward and units == "model":
        raise ValueError("step_in_backward steps each block's unit; units='model' has one")
    if step_in_backward and micro_batches > 1:
        raise ValueError(
            f"step_in_backward cannot accumulate gradients over {micro_batches} micro-batches"
        )
    m_fmt, v_fmt = check_moment_formats(
        resolve_format(m_format, "m"), resolve_format(v_format, "v")
    )
    check_block_size(block_size)
    compute = _dtype(compute_dtype, "compute_dtype")
    shard = gpus // replicas
    param_bytes = 2 if bf16_params else 4
    c, r = _nbytes(compute), _nbytes(_REDUCE_DTYPE)

    unit_shapes = fsdp_units(meta_model(config))
    local = [shard_shape(shape, shard) for unit in unit_shapes for shape in unit]
    local_elements = sum(math.prod(s) for s in local)
    grad_elements = local_elements
    if step_in_backward:
        grad_elements = in_flight_elements(unit_shapes, shard)
    shapes = [shape for unit in unit_shapes for shape in unit]
    if optimizer == "torch_adamw":
        m_state = v_state = local_elements * param_bytes
        shadow = 0
    else:
        m_state = sum(state_bytes(m_fmt, s, block_size) for s in local)
        v_state = sum(state_bytes(v_fmt, s, block_size) for s in local)
        shadow = (
            2 * 4 * sum(shadow_capacity(s, shard, block_size, shadow_sample) for s in shapes)
            if shadow_sample
            else 0
        )

    # all-gather outputs are padded: S shards of ceil(rows / S) rows
    gathered = [sum(shard * math.prod(shard_shape(s, shard)) for s in unit) for unit in unit_shapes]
    if units == "model":
        gathered_params = gathered_grads = sum(gathered)
    else:
        *sequence, root = gathered
        gathered_params = max(a + b for a, b in itertools.pairwise(sequence)) + root
        gathered_grads = max(gathered)
    full_elements = sum(math.prod(s) for s in shapes)
    activations, logits = activation_bytes(
        config,
        seq_len=seq_len,
        micro_batch=micro_batch,
        activation_checkpointing=activation_checkpointing,
        compute_dtype=compute,
    )
    return MemoryPlan(
        params=local_elements * param_bytes,
        grads=grad_elements * param_bytes,
        m_state=m_state,
        v_state=v_state,
        shadow=shadow,
        gathered_params=gathered_params * c,
        gathered_grads=gathered_grads * (c + r),
        accumulated_grads=(
            full_elements * r if micro_batches > 1 and not reduce_every_micro_batch else 0
        ),
        activations=activations,
        logits=logits,
        overhead=FIXED_OVERHEAD_BYTES,
    )


# --------------------------------------------------------------------------- the CLI


@dataclass(frozen=True)
class RunPlans:
    """A configured run's plan, the torch AdamW baseline of the same run, and the setup;
    ``checkpointing`` says whether each of the two recomputes activations (``auto``
    resolved for each by :func:`checkpointing_fits`)."""

    config: PretrainedConfig
    parameters: int
    plan: MemoryPlan
    baseline: MemoryPlan
    gpus: int
    replicas: int
    micro_batch: int
    micro_batches: int
    compute_dtype: torch.dtype
    checkpointing: tuple[bool, bool]
    gpu_bytes: int
    units: str = "blocks"


def checkpointing_fits(without: MemoryPlan, gpu_bytes: int) -> bool:
    """Whether a run planned without activation checkpointing leaves it off under
    ``parallel.activation_checkpointing=auto``: its peak is within
    :data:`AUTO_CHECKPOINTING_MARGIN` below ``gpu_bytes``."""
    return without.total <= (1 - AUTO_CHECKPOINTING_MARGIN) * gpu_bytes


def vocab_size(cfg: Config) -> int:
    """The prepared data's vocabulary (``data.dir``/meta.json) if it exists, else
    ``data.vocab_size``, else the vocabulary preparing the data would train (4096)."""
    from srtrain.data import DEFAULT_VOCAB_SIZE, META_FILE, load_meta

    if (Path(cfg.data.dir) / META_FILE).is_file():
        return load_meta(cfg.data.dir).vocab_size
    return cfg.data.vocab_size if cfg.data.vocab_size is not None else DEFAULT_VOCAB_SIZE


def _vocab_source(cfg: Config) -> str:
    """Where the planned vocabulary comes from, when not from the model's config file."""
    from srtrain.data import META_FILE

    if cfg.model.hf_config or cfg.model.init_from:
        return ""
    meta = Path(cfg.data.dir) / META_FILE
    if meta.is_file():
        return f" from {meta}"
    return " from data.vocab_size" if cfg.data.vocab_size is not None else " (the default)"


def model_config_of(cfg: Config, vocab: int) -> PretrainedConfig:
    """The transformers config the trainer builds for ``cfg.model`` (ConfigError in one line)."""
    from srtrain.models import resolve_model_config

    try:
        return resolve_model_config(cfg.model, vocab)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


def plan_run(
    cfg: Config,
    gpus: int,
    model: PretrainedConfig | None = None,
    gpu_bytes: int = int(GPU_MEMORY_GIB * GIB),
) -> RunPlans:
    """Plans of a validated config on ``gpus`` GPUs of ``gpu_bytes`` each (ConfigError for a
    bad mesh or batch); ``model`` replaces the config's model shape (default: what the
    trainer would build). ``parallel.activation_checkpointing=auto`` is resolved for the run
    and the baseline alike, as the trainer resolves it on a GPU of ``gpu_bytes``;
    ``parallel.fsdp_units=auto`` is "model" for a run on one GPU (not stepping inside
    backward) whose plan with one unit fits as :func:`checkpointing_fits` says, else
    "blocks". The run steps inside backward where ``optim.step_in_backward`` says so; the
    baseline (torch's AdamW) always steps after it, in per-block units."""
    replicas = cfg.parallel.replicas
    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    if gpus % replicas:
        raise ConfigError(
            f"--gpus: {gpus} GPUs do not split into parallel.replicas={replicas} "
            f"replicas; use a multiple of {replicas}"
        )
    validate_world(cfg, gpus)
    per_rank = cfg.train.global_batch_size // gpus
    micro_batch = cfg.train.micro_batch_size or per_rank
    compute = _DTYPES[
        "bf16" if cfg.parallel.compute_dtype == "auto" else cfg.parallel.compute_dtype
    ]
    config = model if model is not None else model_config_of(cfg, vocab_size(cfg))
    common = dict(
        gpus=gpus,
        replicas=replicas,
        seq_len=cfg.model.seq_len,
        micro_batch=micro_batch,
        micro_batches=per_rank // micro_batch,
        reduce_every_micro_batch=cfg.parallel.reduce_every_micro_batch,
        compute_dtype=compute,
    )
    setting = cfg.parallel.activation_checkpointing

    def planned(**run) -> tuple[MemoryPlan, bool]:
        if setting != AUTO:
            return plan_memory(config, **common, **run, activation_checkpointing=setting), setting
        without = plan_memory(config, **common, **run, activation_checkpointing=False)
        if checkpointing_fits(without, gpu_bytes):
            return without, False
        return plan_memory(config, **common, **run, activation_checkpointing=True), True

    o = cfg.optim
    ours = dict(
        bf16_params=cfg.parallel.bf16_params,
        optimizer=o.name,
        m_format=o.m_format,
        v_format=o.v_format,
        block_size=o.block_size,
        shadow_sample=o.shadow_sample,
        step_in_backward=o.step_in_backward,
    )
    units = cfg.parallel.fsdp_units
    if units == AUTO:
        units = "blocks"
        if gpus == 1 and not o.step_in_backward:
            whole = plan_memory(
                config,
                **common,
                **ours,
                units="model",
                activation_checkpointing=setting if setting != AUTO else False,
            )
            if checkpointing_fits(whole, gpu_bytes):
                units = "model"
    plan, checkpointed = planned(**ours, units=units)
    # the baseline steps after backward, as torch's AdamW must, in per-block units
    baseline, baseline_checkpointed = planned(bf16_params=False, optimizer="torch_adamw")
    parameters = sum(p.numel() for p in meta_model(config).parameters())
    return RunPlans(
        config,
        parameters,
        plan,
        baseline,
        gpus,
        replicas,
        micro_batch,
        per_rank // micro_batch,
        compute,
        (checkpointed, baseline_checkpointed),
        gpu_bytes,
        units,
    )


def _checkpointing(cfg: Config, plans: RunPlans) -> str:
    """Activation checkpointing of the run and the baseline, and whether auto chose it."""
    ours, baseline = ("on" if c else "off" for c in plans.checkpointing)
    text = ours if ours == baseline else f"{ours} (baseline {baseline})"
    if cfg.parallel.activation_checkpointing == AUTO:
        text += (
            f" (auto: on only where the plan without it passes "
            f"{1 - AUTO_CHECKPOINTING_MARGIN:.0%} of {plans.gpu_bytes / GIB:.1f} GiB)"
        )
    return text


def _setup_lines(cfg: Config, plans: RunPlans) -> list[str]:
    """The model, the mesh, the batch and the two optimizers of a plan, one line each, and
    a line on the step inside backward where the run takes it."""
    n = plans.parameters
    compute = {torch.bfloat16: "bf16", torch.float32: "fp32"}[plans.compute_dtype]
    o = cfg.optim
    ours = (
        f"SRAdamW m {o.m_format}, v {o.v_format} (block {o.block_size})"
        if o.name == "sradamw"
        else "torch AdamW"
    )
    ours += f", {'bf16' if cfg.parallel.bf16_params else 'fp32'} params"
    inside = o.name == "sradamw" and o.step_in_backward
    ours += ", stepped inside backward" if inside else ", stepped after backward"
    shard = plans.gpus // plans.replicas
    lines = [
        f"model: {type(plans.config).__name__.removesuffix('Config')}, "
        f"{f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'} parameters "
        f"(hidden {plans.config.hidden_size}, {plans.config.num_hidden_layers} "
        f"layers, vocab {plans.config.vocab_size}{_vocab_source(cfg)})",
        f"mesh: {plans.gpus} GPU(s) = {plans.replicas} replica(s) x shard group of {shard}; "
        + ("one FSDP2 unit" if plans.units == "model" else "an FSDP2 unit a block")
        + (" (parallel.fsdp_units auto)" if cfg.parallel.fsdp_units == AUTO else ""),
        f"batch per GPU: micro-batch {plans.micro_batch} x seq {cfg.model.seq_len}, "
        f"{plans.micro_batches} micro-batch(es) per step; {compute} compute; activation "
        f"checkpointing {_checkpointing(cfg, plans)}",
        f"this run: {ours}; baseline: torch AdamW, fp32 params and states, stepped after backward",
    ]
    if inside:
        lines.append(
            "step inside backward (optim.step_in_backward): this run's gradients are those of "
            "the two largest consecutive FSDP2 units in flight (an estimate)"
        )
    return lines


def format_plans(cfg: Config, plans: RunPlans, gpu_bytes: int) -> str:
    """The table ``python -m srtrain.plan`` prints, ending with ``fits: yes|no``."""
    p, b, n = plans.plan, plans.baseline, plans.parameters
    unit, scale = ("GiB", GIB) if b.params >= GIB else ("MiB", 2**20)
    inside = cfg.optim.name == "sradamw" and cfg.optim.step_in_backward
    shard = plans.gpus // plans.replicas
    lines = _setup_lines(cfg, plans)
    lines.append(f"{unit + ' per GPU':<36}{'this run':>14}{'baseline':>14}")
    rows = [
        ("parameters", p.params, b.params),
        ("gradients (this run: in flight)" if inside else "gradients", p.grads, b.grads),
        ("optimizer m", p.m_state, b.m_state),
        ("optimizer v", p.v_state, b.v_state),
        ("FP32 shadow of m, v (sampled)", p.shadow, b.shadow),
        ("gathered parameters", p.gathered_params, b.gathered_params),
        ("gathered gradients", p.gathered_grads, b.gathered_grads),
        ("accumulated gradients", p.accumulated_grads, b.accumulated_grads),
        ("activations (estimate)", p.activations, b.activations),
        ("logits and gradients (estimate)", p.logits, b.logits),
        ("CUDA context, workspaces", p.overhead, b.overhead),
        ("total", p.total, b.total),
    ]
    lines += [f"{name:<36}{x / scale:>14.2f}{y / scale:>14.2f}" for name, x, y in rows]
    per_param = [(q.params + q.grads + q.optimizer_states) * shard / n for q in (p, b)]
    lines.append(
        f"{'params+grads+states, B/parameter':<36}{per_param[0]:>14.2f}{per_param[1]:>14.2f}"
    )
    lines.append(
        f"GPU memory: {gpu_bytes / GIB:.1f} GiB (--gpu-memory, default "
        f"{GPU_MEMORY_GIB:g}: an H200); baseline fits: "
        f"{'yes' if b.fits(gpu_bytes) else 'no'}"
    )
    lines.append(f"fits: {'yes' if p.fits(gpu_bytes) else 'no'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the ladder


def plan_ladder(
    cfg: Config,
    gpus: int,
    gpu_bytes: int = int(GPU_MEMORY_GIB * GIB),
    shapes: dict[str, Shape] | None = None,
) -> dict[str, RunPlans]:
    """:func:`plan_run` of ``cfg`` with each shape of ``shapes`` (default :data:`LADDER`) in
    place of the config's model, at vocabulary :data:`LADDER_VOCAB_SIZE` and the config's
    ``model.seq_len``; by shape name, in the ladder's order."""
    chosen = LADDER if shapes is None else shapes
    seq_len = cfg.model.seq_len
    return {
        name: plan_run(cfg, gpus, shape_config(shape, LADDER_VOCAB_SIZE, seq_len), gpu_bytes)
        for name, shape in chosen.items()
    }


def largest_fitting(ladder: dict[str, RunPlans], baseline: bool = False) -> str | None:
    """The name of the ladder's largest shape (by parameters) whose run (or ``baseline``)
    fits its GPUs; None when none does."""
    fitting = [
        (plans.parameters, name)
        for name, plans in ladder.items()
        if (plans.baseline if baseline else plans.plan).fits(plans.gpu_bytes)
    ]
    return max(fitting)[1] if fitting else None


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def format_ladder(cfg: Config, ladder: dict[str, RunPlans]) -> str:
    """The table ``python -m srtrain.plan --ladder`` prints: one line a shape, then the
    largest shape that fits the run and the baseline. Under
    ``parallel.activation_checkpointing=auto`` each line says whether the run and the
    baseline checkpoint (the setup line says it of the first shape)."""
    first = next(iter(ladder.values()))
    auto = cfg.parallel.activation_checkpointing == AUTO
    lines = [
        f"ladder: {len(ladder)} shapes (srtrain.plan.LADDER), vocab {LADDER_VOCAB_SIZE}, "
        f"the config's model replaced",
        *_setup_lines(cfg, first)[1:],
        f"{'shape':<10}{'family':<10}{'parameters':>11}{'run GiB':>10}{'fits':>6}"
        f"{'baseline GiB':>14}{'fits':>6}" + (f"{'checkpointing':>15}" if auto else ""),
    ]
    for name, plans in ladder.items():
        p, b = plans.plan, plans.baseline
        family = type(plans.config).__name__.removesuffix("Config")
        checkpointing = "/".join("on" if c else "off" for c in plans.checkpointing)
        lines.append(
            f"{name:<10}{family:<10}{_billions(plans.parameters):>11}{p.total / GIB:>10.1f}"
            f"{'yes' if p.fits(plans.gpu_bytes) else 'no':>6}{b.total / GIB:>14.1f}"
            f"{'yes' if b.fits(plans.gpu_bytes) else 'no':>6}"
            + (f"{checkpointing:>15}" if auto else "")
        )
    lines.append(f"GPU memory: {first.gpu_bytes / GIB:.1f} GiB (--gpu-memory)")
    largest = [largest_fitting(ladder, baseline) for baseline in (False, True)]
    lines.append(
        "largest that fits: "
        + ", ".join(
            f"{who} {name} ({_billions(ladder[name].parameters)})" if name else f"{who} none"
            for who, name in zip(("this run", "baseline"), largest, strict=True)
        )
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m srtrain.plan``."""
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.plan",
        description="Bytes per GPU of a training run under FSDP2, beside torch's AdamW.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: the tiny run)")
    parser.add_argument("--gpus", type=int, default=1, help="world size (default 1)")
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=GPU_MEMORY_GIB,
        help=f"GiB per GPU (default {GPU_MEMORY_GIB:g}: an H200)",
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help=f"plan the run on each shape of srtrain.plan.LADDER ({', '.join(LADDER)}; "
        f"vocab {LADDER_VOCAB_SIZE}) instead of the config's model",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m srtrain.plan``: print the per-GPU memory plan of a config (or, with
    ``--ladder``, of its run on each shape of the ladder)."""
    args = parser().parse_args(argv)
    gpu_bytes = int(args.gpu_memory * GIB)
    try:
        if not args.gpu_memory > 0:
            raise ConfigError(f"--gpu-memory: must be > 0 GiB, got {args.gpu_memory}")
        cfg = load_config(args.config, args.overrides)
        if args.ladder:
            text = format_ladder(cfg, plan_ladder(cfg, args.gpus, gpu_bytes))
        else:
            text = format_plans(cfg, plan_run(cfg, args.gpus, gpu_bytes=gpu_bytes), gpu_bytes)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
