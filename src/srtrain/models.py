"""LLaMA and GPT-NeoX shapes built with transformers, their seeded init and FLOP counts.

A model's shape comes from a preset (``PRESETS``; the README lists them with their parameter
counts), optionally changed key by key (``model.hidden``, ``model.kv_heads``, ...), or from
a transformers ``config.json`` (``model.hf_config``, or ``model.init_from``'s directory) of
a LLaMA, Mistral, Qwen2, Qwen3 or GPT-NeoX model (:data:`MODEL_TYPES`). The vocabulary size
of a preset comes from the tokenizer; a config file brings its own. All models use SDPA
attention. GPT-NeoX presets use Pythia's rotary fraction 0.25 and parallel residual; LLaMA
presets with ``kv_heads < heads`` use grouped-query attention.

Initialisation (``init_weights``) gives each element a value that is a function of
(seed, parameter name, global element index) only, and each rank computes only its own
shard's elements, so a model initialised on any number of ranks holds bitwise the same
full weights as on one rank (for the same device type: values are computed on the
parameter's device).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import CONFIG_MAPPING, GPTNeoXConfig, LlamaConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from srtrain.numerics.normal import fill_normal_, normal_keys
from srtrain.param_groups import param_group_of

# Projections that write into the residual stream (scaled down at init).
_OUTPUT_PROJECTIONS = frozenset({"o_proj", "down_proj", "dense", "dense_4h_to_h"})
# Buffers that init_weights knows how to rebuild.
_ROTARY_BUFFERS = frozenset({"inv_freq", "original_inv_freq"})


FAMILIES = ("llama", "gpt-neox")
# config.json model_type → the family of its blocks and its transformers causal-LM class
MODEL_TYPES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralForCausalLM"),  # LLaMA blocks, a sliding attention window
    "qwen2": ("llama", "Qwen2ForCausalLM"),  # LLaMA blocks with q, k and v biases
    "qwen3": ("llama", "Qwen3ForCausalLM"),  # LLaMA blocks with RMSNorm on q and k heads
    "gpt_neox": ("gpt-neox", "GPTNeoXForCausalLM"),
}


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The transformers causal-LM class of a supported config (imported on first use)."""
    if config.model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; allowed: {', '.join(MODEL_TYPES)}"
        )
    return getattr(transformers, MODEL_TYPES[config.model_type][1])


@dataclass(frozen=True)
class Shape:
    """A model's architecture apart from its vocabulary and context length.

    ``kv_heads`` below ``heads`` is grouped-query attention (LLaMA only); ``rope_theta`` is
    the rotary base; ``norm_eps`` the RMSNorm/LayerNorm epsilon; ``tied`` shares the input
    embedding with the output head.
    """

    family: str
    hidden: int
    intermediate: int
    heads: int
    layers: int
    kv_heads: int = 0  # 0: as many as heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = False

    @property
    def key_value_heads(self) -> int:
        """Key/value heads (``heads`` unless grouped-query attention)."""
        return self.kv_heads or self.heads

    def check(self) -> None:
        """Raise ValueError (one line, naming the ``model.*`` key) if the shape cannot be built."""
        if self.family not in FAMILIES:
            raise ValueError(
                f"model family {self.family!r} is not supported; allowed: {', '.join(FAMILIES)}"
            )
        for key in ("hidden", "intermediate", "heads", "layers"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"model.{key}: must be a positive integer, got {getattr(self, key)}"
                )
        if self.hidden % self.heads:
            raise ValueError(
                f"model.heads: {self.heads} heads do not divide model.hidden "
                f"{self.hidden}; choose heads that divide it"
            )
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"model.heads: head size {self.hidden}/{self.heads} = "
                f"{self.hidden // self.heads} is odd; rotary embeddings need it even"
            )
        if self.kv_heads < 0 or self.heads % self.key_value_heads:
            raise ValueError(
                f"model.kv_heads: {self.kv_heads} KV heads do not divide the "
                f"{self.heads} attention heads; choose a divisor of {self.heads}"
            )
        if self.family == "gpt-neox" and self.key_value_heads != self.heads:
            raise ValueError(
                f"model.kv_heads: GPT-NeoX has no grouped-query attention; "
                f"leave kv_heads at 0 or {self.heads}"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"model.rope_theta: must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"model.norm_eps: must be > 0, got {self.norm_eps}")


_LLAMA1 = {"norm_eps": 1e-6}
_LLAMA3 = {"rope_theta": 500000.0, "kv_heads": 8}

PRESETS: dict[str, Shape] = {
    "llama-tiny": Shape("llama", 128, 344, 4, 2, **_LLAMA1),
    "llama-60m": Shape("llama", 512, 1376, 8, 8, **_LLAMA1),
    "llama-100m": Shape("llama", 640, 1708, 10, 12, **_LLAMA1),
    "llama-350m": Shape("llama", 1024, 2736, 16, 24, **_LLAMA1),
    "llama-1b": Shape("llama", 2048, 5461, 32, 24, **_LLAMA1),
    "llama-7b": Shape("llama", 4096, 11008, 32, 32, **_LLAMA1),
    "llama2-7b": Shape("llama", 4096, 11008, 32, 32),
    "llama2-13b": Shape("llama", 5120, 13824, 40, 40),
    "llama2-70b": Shape("llama", 8192, 28672, 64, 80, kv_heads=8),
    "llama3-8b": Shape("llama", 4096, 14336, 32, 32, **_LLAMA3),
    "llama3-70b": Shape("llama", 8192, 28672, 64, 80, **_LLAMA3),
    "neox-tiny": Shape("gpt-neox", 128, 512, 4, 2),
    "neox-160m": Shape("gpt-neox", 768, 3072, 12, 12),
    "neox-410m": Shape("gpt-neox", 1024, 4096, 16, 24),
    "pythia-1b": Shape("gpt-neox", 2048, 8192, 8, 16),
    "pythia-1.4b": Shape("gpt-neox", 2048, 8192, 16, 24),
    "pythia-2.8b": Shape("gpt-neox", 2560, 10240, 32, 32),
    "pythia-6.9b": Shape("gpt-neox", 4096, 16384, 32, 32),
    "pythia-12b": Shape("gpt-neox", 5120, 20480, 40, 36),
}

# ``model.*`` keys that change a preset's shape, and the Shape field each sets.
SHAPE_KEYS = {
    "hidden": "hidden",
    "intermediate": "intermediate",
    "heads": "heads",
    "layers": "layers",
    "kv_heads": "kv_heads",
    "rope_theta": "rope_theta",
    "norm_eps": "norm_eps",
    "tied_embeddings": "tied",
}


def preset_shape(preset: str, **changes) -> Shape:
    """A preset's shape with ``changes`` (Shape fields; None or 0 keeps the preset's), checked."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    kept = {
        key: value
        for key, value in changes.items()
        if value is not None and (isinstance(value, bool) or value != 0)
    }
    shape = dataclasses.replace(PRESETS[preset], **kept)
    shape.check()
    return shape


def shape_config(shape: Shape, vocab_size: int, seq_len: int) -> PretrainedConfig:
    """The transformers config of a shape for a vocabulary size and context length."""
    shape.check()
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads,
        num_hidden_layers=shape.layers,
        max_position_embeddings=seq_len,
        tie_word_embeddings=shape.tied,
        use_cache=False,
        attn_implementation="sdpa",
    )
    rope = {"rope_theta": shape.rope_theta, "rope_type": "default"}
    if shape.family == "llama":
        return LlamaConfig(
            **common,
            rms_norm_eps=shape.norm_eps,
            num_key_value_heads=shape.key_value_heads,
            rope_parameters=rope,
        )
    return GPTNeoXConfig(
        **common,
        layer_norm_eps=shape.norm_eps,
        use_parallel_residual=True,
        rope_parameters={**rope, "partial_rotary_factor": 0.25},
    )


def model_config(preset: str, vocab_size: int, seq_len: int) -> PretrainedConfig:
    """The transformers config of a preset for a vocabulary size and context length."""
    return shape_config(preset_shape(preset), vocab_size, seq_len)


def read_hf_config(path: str | Path) -> PretrainedConfig:
    """A transformers config of a supported model type (:data:`MODEL_TYPES`) from
    ``config.json`` (a file, or a directory holding one), set up as srtrain builds models (SDPA
    attention, no KV cache)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"model config not found: {file} (a transformers config.json)")
    try:
        values = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"model config {file} is not readable JSON: {err}") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model config {file}: model_type {model_type!r} is not supported; "
            f"allowed: {', '.join(MODEL_TYPES)}"
        )
    try:
        config = CONFIG_MAPPING[model_type].from_dict(values)
    except Exception as err:  # transformers validates fields with several exception types
        detail = " ".join(str(err).split())
        raise ValueError(f"model config {file}: {detail}") from None
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def shape_of(config: PretrainedConfig) -> Shape:
    """The Shape of a supported transformers config (Mistral, Qwen2 and Qwen3 are of the LLaMA
    family: their extras, a sliding window, biases and q/k norms, live in the config)."""
    if config.model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; allowed: {', '.join(MODEL_TYPES)}"
        )
    family = MODEL_TYPES[config.model_type][0]
    rope = getattr(config, "rope_parameters", None) or {}
    eps = config.rms_norm_eps if family == "llama" else config.layer_norm_eps
    return Shape(
        family,
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or 0,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_eps=float(eps),
        tied=bool(config.tie_word_embeddings),
    )


def resolve_model_config(model: Any, vocab_size: int) -> PretrainedConfig:
    """The transformers config of a ``model`` config section for data of ``vocab_size`` tokens.

    ``model.hf_config`` (else ``model.init_from``'s ``config.json``) gives the whole shape and
    its own vocabulary, which must hold the data's; otherwise ``model.preset`` with the shape
    keys set (non-zero) on top, at the data's vocabulary. The context length is
    ``model.seq_len``. Raises ValueError in one line.
    """
    source = model.hf_config or model.init_from
    if source:
        config = read_hf_config(source)
        shape_of(config).check()
        if vocab_size > config.vocab_size:
            raise ValueError(
                f"the data's vocabulary ({vocab_size} tokens) is larger than the model's "
                f"({config.vocab_size} in {source}); tokenize the data with the model's tokenizer"
            )
        return config
    changes = {field: getattr(model, key) for key, field in SHAPE_KEYS.items()}
    return shape_config(preset_shape(model.preset, **changes), vocab_size, model.seq_len)


def build_model_from_config(config: PretrainedConfig, *, device: str = "meta") -> nn.Module:
    """A causal LM of a supported transformers config, built on ``device``."""
    with torch.device(device):
        return model_class(config)(config)


def build_model(preset: str, vocab_size: int, seq_len: int, *, device: str = "meta") -> nn.Module:
    """A causal LM of the preset, built on ``device`` (meta: no memory, weights unset)."""
    return build_model_from_config(model_config(preset, vocab_size, seq_len), device=device)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a supported causal LM."""
    return model.base_model.layers


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
    counted), L layers, d the attention width (heads × head size: the hidden size unless
    the config sets a wider ``head_dim``, as Qwen3 does), S sequence length. The attention
    term is the QKᵀ and AV matmuls (4·S·d per layer and token forward, ×3 with backward),
    counted without halving for the causal mask.
    """
    if isinstance(model_or_config, PretrainedConfig):
        with torch.device("meta"):
            model = model_class(model_or_config)(model_or_config)
    else:
        model = model_or_config
    config = model.config
    n = count_params(model) - model.get_input_embeddings().weight.numel()
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 6.0 * n + 12.0 * config.num_hidden_layers * width * seq_len


def _local_shard(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's shard of a parameter, flat, and the global flat index of its first element.

    A plain tensor is its own shard. A DTensor may be placed with any mix of Replicate and
    Shard(0) (FSDP2, HSDP), so its shard is a block of whole rows, possibly empty.
    """
    if not isinstance(param, DTensor):
        return param.view(-1), 0
    for placement in param.placements:
        if not (
            isinstance(placement, Replicate) or (type(placement) is Shard and placement.dim == 0)
        ):
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
    init_buffers(model)


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute the rotary ``inv_freq`` buffers (left undefined by ``to_empty``), in place.

    Raises ValueError naming any other buffer, which has no init rule.
    """
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
