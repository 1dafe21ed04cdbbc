"""LLaMA and GPT-NeoX presets built with transformers, their seeded init and FLOP counts.

Presets (vocabulary size comes from the tokenizer, context length from ``seq_len``):

| preset      | family   | hidden | intermediate | heads | layers | params at vocab 32000 |
|-------------|----------|--------|--------------|-------|--------|-----------------------|
| llama-tiny  | llama    | 128    | 344          | 4     | 2      | 8.6M                  |
| llama-60m   | llama    | 512    | 1376         | 8     | 8      | 58M                   |
| llama-100m  | llama    | 640    | 1708         | 10    | 12     | 100M                  |
| llama-350m  | llama    | 1024   | 2736         | 16    | 24     | 368M                  |
| llama-1b    | llama    | 2048   | 5461         | 32    | 24     | 1.34B                 |
| llama-7b    | llama    | 4096   | 11008        | 32    | 32     | 6.74B                 |
| neox-tiny   | gpt-neox | 128    | 512          | 4     | 2      | 8.6M                  |
| neox-160m   | gpt-neox | 768    | 3072         | 12    | 12     | 134M (Pythia shapes)  |
| neox-410m   | gpt-neox | 1024   | 4096         | 16    | 24     | 368M (Pythia shapes)  |

GPT-NeoX presets use Pythia's rotary fraction 0.25 and parallel residual. All
presets keep input and output embeddings untied and use SDPA attention.

Initialisation (``init_weights``) gives each element a value that is a function of
(seed, parameter name, global element index) only, and each rank computes only its own
shard's elements, so a model initialised on any number of ranks holds bitwise the same
full weights as on one rank (for the same device type: values are computed on the
parameter's device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from srtrain.numerics.normal import fill_normal_, normal_keys

PARAM_GROUPS = ("attention", "mlp", "embeddings", "norms", "head")

_MODEL_CLASSES: dict[type[PretrainedConfig], type[nn.Module]] = {
    LlamaConfig: LlamaForCausalLM,
    GPTNeoXConfig: GPTNeoXForCausalLM,
}

# Name components that identify each parameter group in both families.
_HEAD_PARTS = frozenset({"lm_head", "embed_out"})
_EMBEDDING_PARTS = frozenset({"embed_tokens", "embed_in"})
_ATTENTION_PARTS = frozenset({"self_attn", "attention"})
_MLP_PARTS = frozenset({"mlp"})
# Projections that write into the residual stream (scaled down at init).
_OUTPUT_PROJECTIONS = frozenset({"o_proj", "down_proj", "dense", "dense_4h_to_h"})
# Buffers that init_weights knows how to rebuild.
_ROTARY_BUFFERS = frozenset({"inv_freq", "original_inv_freq"})


@dataclass(frozen=True)
class Preset:
    """Shape of one model preset."""

    family: str
    hidden: int
    intermediate: int
    heads: int
    layers: int


PRESETS: dict[str, Preset] = {
    "llama-tiny": Preset("llama", 128, 344, 4, 2),
    "llama-60m": Preset("llama", 512, 1376, 8, 8),
    "llama-100m": Preset("llama", 640, 1708, 10, 12),
    "llama-350m": Preset("llama", 1024, 2736, 16, 24),
    "llama-1b": Preset("llama", 2048, 5461, 32, 24),
    "llama-7b": Preset("llama", 4096, 11008, 32, 32),
    "neox-tiny": Preset("gpt-neox", 128, 512, 4, 2),
    "neox-160m": Preset("gpt-neox", 768, 3072, 12, 12),
    "neox-410m": Preset("gpt-neox", 1024, 4096, 16, 24),
}


def model_config(preset: str, vocab_size: int, seq_len: int) -> PretrainedConfig:
    """The transformers config of a preset for a vocabulary size and context length."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    shape = PRESETS[preset]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_hidden_layers=shape.layers,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    if shape.family == "llama":
        return LlamaConfig(**common)
    return GPTNeoXConfig(**common, rotary_pct=0.25, use_parallel_residual=True)


def build_model(preset: str, vocab_size: int, seq_len: int, *, device: str = "meta") -> nn.Module:
    """A causal LM of the preset, built on ``device`` (meta: no memory, weights unset)."""
    config = model_config(preset, vocab_size, seq_len)
    with torch.device(device):
        return _MODEL_CLASSES[type(config)](config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a LLaMA or GPT-NeoX causal LM."""
    return model.base_model.layers


def param_group_of(name: str) -> str:
    """The group ("attention", "mlp", "embeddings", "norms", "head") of a parameter FQN."""
    parts = name.split(".")
    if _HEAD_PARTS.intersection(parts):
        return "head"
    if _EMBEDDING_PARTS.intersection(parts):
        return "embeddings"
    if any("norm" in part for part in parts):
        return "norms"
    if _ATTENTION_PARTS.intersection(parts):
        return "attention"
    if _MLP_PARTS.intersection(parts):
        return "mlp"
    raise ValueError(
        f"parameter {name!r} is not a known LLaMA/GPT-NeoX parameter; groups: {PARAM_GROUPS}"
    )


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Whether a parameter is exempt from weight decay (norm weights and biases)."""
    return param_group_of(name) == "norms" or name.endswith(".bias") or param.ndim < 2


def count_params(model: nn.Module) -> int:
    """Number of parameters of the full (unsharded) model."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model_or_config: nn.Module | PretrainedConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) for MFU.

    ``6·N + 12·L·d·S`` (the PaLM / torchtitan convention): N counts every parameter
    except the input embedding table (a lookup, not a matmul; the output head is
    counted), L layers, d hidden size, S sequence length. The attention term is the
    QKᵀ and AV matmuls (4·S·d per layer and token forward, ×3 with backward), counted
    without halving for the causal mask.
    """
    if isinstance(model_or_config, PretrainedConfig):
        with torch.device("meta"):
            model = _MODEL_CLASSES[type(model_or_config)](model_or_config)
    else:
        model = model_or_config
    config = model.config
    n = count_params(model) - model.get_input_embeddings().weight.numel()
    return 6.0 * n + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def _local_shard(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's shard of a parameter, flat, and the global flat index of its first element.

    A plain tensor is its own shard. A DTensor may be placed with any mix of Replicate and
    Shard(0) (FSDP2, HSDP), so its shard is a block of whole rows, possibly empty.
    """
    if not isinstance(param, DTensor):
        return param.view(-1), 0
    for placement in param.placements:
        if not (isinstance(placement, Replicate) or
                (type(placement) is Shard and placement.dim == 0)):
            raise ValueError(
                f"init_weights needs parameter {name!r} replicated or sharded on dim 0, "
                f"got placements {param.placements}"
            )
    _, offsets = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    start = offsets[0] * math.prod(param.shape[1:]) if param.ndim else 0
    return param.to_local().view(-1), start


def _reset_rotary(module: nn.Module) -> None:
    """Recompute a rotary embedding's inverse frequencies (fp32) on its current device."""
    init_fn = (
        module.compute_default_rope_parameters
        if module.rope_type == "default"
        else ROPE_INIT_FUNCTIONS[module.rope_type]
    )
    inv_freq, module.attention_scaling = init_fn(module.config)
    inv_freq = inv_freq.to(device=module.inv_freq.device, dtype=torch.float32)
    module.inv_freq = inv_freq
    module.original_inv_freq = inv_freq.clone()


@torch.no_grad()
def init_weights(
    model: nn.Module, seed: int, *, std: float = 0.02, scale_output_projections: bool = True
) -> None:
    """Seeded, world-size-independent init of parameters and rotary buffers, in place.

    Linear and embedding weights ~ N(0, std²); projections into the residual stream
    (LLaMA o_proj/down_proj, NeoX attention.dense/dense_4h_to_h) use std/√(2·layers)
    when ``scale_output_projections`` (GPT-2/Megatron); biases 0; norm weights 1.
    A weight's element takes a counter-based normal sample keyed on (seed, parameter
    name, global element index) (:mod:`srtrain.numerics.normal`), computed in FP32 and
    stored in the parameter's dtype. Each rank computes only its own shard of each
    parameter (plain tensors, or DTensors placed with Replicate and Shard(0)), in bounded
    chunks, and never holds a full sharded tensor; the full values do not depend on the
    world size or sharding (bitwise, on one device type). ``seed`` must be >= 0.
    Rotary ``inv_freq`` buffers (left undefined by ``to_empty``) are recomputed.
    """
    layers = model.config.num_hidden_layers
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device; call model.to_empty(device=...) first"
            )
        flat, start = _local_shard(name, param)
        if name.endswith(".bias"):
            flat.zero_()
        elif param_group_of(name) == "norms":
            flat.fill_(1.0)
        else:
            is_output = name.split(".")[-2] in _OUTPUT_PROJECTIONS and name.endswith(".weight")
            scale = (2.0 * layers) ** -0.5 if scale_output_projections and is_output else 1.0
            fill_normal_(flat, normal_keys(seed, name), start, std * scale)
    for module_name, module in model.named_modules():
        buffers = {key for key, _ in module.named_buffers(recurse=False)}
        unknown = buffers - _ROTARY_BUFFERS
        if unknown:
            raise ValueError(
                f"buffer(s) {sorted(unknown)} of module {module_name!r} have no init rule; "
                f"known: {sorted(_ROTARY_BUFFERS)}"
            )
        if buffers:
            _reset_rotary(module)
