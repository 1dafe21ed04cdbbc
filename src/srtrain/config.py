"""Typed run configuration: YAML files plus ``section.key=value`` overrides, validated at start.

Every error names the key, the value and what is allowed, in one line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from srtrain.numerics.formats import (
    FORMATS,
    NAMED_PAIRS,
    check_block_size,
    check_moment_formats,
    get_format,
)
from srtrain.numerics.rounding import ROUNDING_MODES


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


@dataclass
class ModelConfig:
    """Which network to train: a preset, optionally reshaped key by key, or a transformers
    ``config.json`` (``hf_config``; else ``init_from``'s), which then gives the whole shape."""

    preset: str = "llama-tiny"
    seq_len: int = 128
    hidden: int = 0  # shape keys: 0 (None for tied_embeddings) keeps the preset's value
    intermediate: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0  # fewer than heads: grouped-query attention (LLaMA)
    rope_theta: float = 0.0
    norm_eps: float = 0.0
    tied_embeddings: bool | None = None
    hf_config: str = ""  # a LLaMA/GPT-NeoX config.json (or a directory holding one)
    init_from: str = ""  # a transformers model directory (safetensors) to start from


# The default job's data: its dir is prepared from the builtin corpus when missing.
DEFAULT_DATA_DIR = "data/builtin"
DEFAULT_DATA_SOURCE = "builtin"


@dataclass
class DataConfig:
    """Token data: a prepared dir, used as it is; a missing one is prepared on first use from
    ``source`` (see :func:`data_source`; ``builtin`` needs no network)."""

    dir: str = DEFAULT_DATA_DIR
    source: str = ""  # "": not named (a prepared dir is used as it is; see data_source)
    vocab_size: int | None = None  # None: the prepared dir's, or 4096 when preparing now
    max_bytes: int | None = None
    val_fraction: float = 0.02


@dataclass
class OptimConfig:
    """The optimizer (SRAdamW, or torch's AdamW as a baseline) and its schedule."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1
    m_format: str = "bf16"
    v_format: str = "bf16"
    m_rounding: str = "stochastic"
    v_rounding: str = "stochastic"
    param_rounding: str = "stochastic"
    block_size: int = 32
    seed: int = 0
    backend: str = "auto"
    shadow_sample: int = 1024  # FP32 shadow of m and v on one block in this many; 0: off
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    name: str = "sradamw"  # sradamw | torch_adamw (FP32 states, no stalls or resets)
    # True: each FSDP2 unit is stepped as soon as its gradients are reduce-scattered, and
    # its gradients freed; clipping then uses the previous step's global norm
    step_in_backward: bool = False


@dataclass
class ResetConfig:
    """When optimizer states are set back to zero (every rank decides alike)."""

    mode: str = "none"  # none | periodic | theory | adaptive
    m_period: int = 0  # periodic: 0 never resets that state
    v_period: int = 0
    tolerance: float = 200.0  # theory: stalled updates tolerated since a reset
    threshold: float = 0.9  # adaptive: stalled fraction that triggers a reset
    window: int = 50  # adaptive: steps the fraction must stay above the threshold
    min_age: int = 100  # adaptive: a state younger than this is never reset
    states: str = "both"  # which states the theory/adaptive modes manage: m | v | both
    # after a reset the lr warms up again over this many steps of the state's age (0: off)
    rewarmup: int = 20


@dataclass
class ParallelConfig:
    """FSDP2 (HSDP across ``replicas``) and compute precision."""

    replicas: int = 1  # >1: HSDP, a (replicas, world/replicas) mesh; shards hold consecutive ranks
    compute_dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    bf16_params: bool = False  # True: BF16 params, no FP32 master copy
    # auto: on only where the memory planner puts the run over the GPU without it (on CUDA)
    activation_checkpointing: bool | str = "auto"
    # With several micro-batches: True reduce-scatters every micro-batch's gradients into the
    # sharded ones (no full-model buffer); False keeps the model's unsharded FP32 gradients
    # until the last micro-batch (one reduce-scatter a step; 4 bytes a parameter on every GPU).
    reduce_every_micro_batch: bool = False
    compile: bool | str = "auto"  # torch.compile each block; auto: on CUDA where compile works
    # FSDP2 units: blocks (each block, the embeddings and the head a unit of its own) | model
    # (one unit: fewer hooks and launches, the unsharded model held through backward) | auto
    # (model on one GPU where the memory planner says it fits, and on a CPU; else blocks)
    fsdp_units: str = "auto"
    device: str = "auto"  # auto | cuda | cpu


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = 300
    global_batch_size: int = 16
    micro_batch_size: int = 0  # per rank; 0 means the whole per-rank batch at once
    seed: int = 0
    log_interval: int = 10
    val_interval: int = 100
    val_batches: int = 4
    # more prepared data dirs validated beside data.dir, as DIR or NAME=DIR (see val_sets)
    val_sets: list[str] = field(default_factory=list)
    run_dir: str = "runs/tiny"
    peak_flops: float = 0.0  # per device; 0 looks it up by device name
    max_skipped_fraction: float = 0.1  # more steps skipped (non-finite grads): exit non-zero


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = 100  # steps between saves; 0 saves only at the end
    keep: int = 2
    load: str = ""  # a checkpoint to start from; empty resumes the run dir's latest
    async_save: bool = False
    enabled: bool = True


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    resets: ResetConfig = field(default_factory=ResetConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-safe)."""
        return dataclasses.asdict(self)


AUTO = "auto"  # a switch the run decides at start (parallel.compile, .activation_checkpointing)
FSDP_UNIT_KINDS = ("blocks", "model")  # how srtrain.parallel.apply_fsdp groups parameters
FSDP_UNITS = (AUTO, *FSDP_UNIT_KINDS)  # parallel.fsdp_units
RESET_MODES = ("none", "periodic", "theory", "adaptive")
BACKENDS = ("auto", "triton", "torch")
OPTIMIZERS = ("sradamw", "torch_adamw")
DEVICES = ("auto", "cuda", "cpu")
COMPUTE_DTYPES = ("auto", "bf16", "fp32")


# ----------------------------------------------------------------------- loading


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's type; ints are accepted for floats."""
    hints = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    if value is None and type(None) in hints:
        return None
    for hint in hints:
        if typing.get_origin(hint) is list and isinstance(value, list):
            (item,) = typing.get_args(hint)
            return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        if hint is type(None):
            continue
        if hint is bool and isinstance(value, bool):
            return value
        if hint is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(key, float(value))
        if hint is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                return _finite(key, number)
        if hint is str and isinstance(value, str):
            return value
    allowed = " or ".join(
        f"a list of {typing.get_args(h)[0].__name__}"
        if typing.get_origin(h) is list
        else getattr(h, "__name__", str(h))
        for h in hints
    )
    raise ConfigError(f"{key}: expected {allowed}, got {value!r} ({type(value).__name__})")


def _finite(key: str, number: float) -> float:
    """``number``, or ConfigError where it is NaN or infinite (no key takes either)."""
    if not math.isfinite(number):
        raise ConfigError(f"{key}: must be a finite number, got {number!r}")
    return number


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _apply(section_obj: Any, section: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    names = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        if key not in names:
            raise ConfigError(
                f"unknown config key '{section}.{key}'; allowed in {section}: {', '.join(names)}"
            )
        setattr(section_obj, key, _coerce(f"{section}.{key}", value, hints[key]))


def _merge(cfg: Config, tree: dict[str, Any], origin: str) -> None:
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(tree).__name__}")
    sections = [f.name for f in dataclasses.fields(cfg)]
    for section, values in tree.items():
        if section not in sections:
            raise ConfigError(
                f"unknown config section '{section}' in {origin}; allowed: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a mapping of keys in {origin}")
        _apply(getattr(cfg, section), section, values)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` → (section, key, YAML-parsed value)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(
            f"override {text!r} must look like section.key=value (e.g. optim.lr=3e-4)"
        )
    dotted, raw = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(
            f"override {text!r}: value is not valid YAML ({_one_line(err)})"
        ) from None
    return section, key, value


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults, then the YAML file (which may name a ``base`` file), then overrides."""
    cfg = Config()
    if path is not None:
        for tree, origin in _yaml_chain(Path(path)):
            _merge(cfg, tree, origin)
    for text in overrides:
        section, key, value = parse_override(text)
        _merge(cfg, {section: {key: value}}, f"override {text!r}")
    validate(cfg)
    return cfg


def _yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[dict, str]]:
    """The file and, first, the files it names as ``base`` (relative to itself)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config file {path} includes itself through 'base'")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a YAML file?)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_one_line(err)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    base = tree.pop("base", None)
    chain: list[tuple[dict, str]] = []
    if base is not None:
        chain = _yaml_chain(path.parent / str(base), (*seen, path.resolve()))
    return [*chain, (tree, str(path))]


# -------------------------------------------------------------------- validation


def resolve_format(name: str, moment: str) -> str:
    """Format name for a moment; a name of a state pair (``fp4``: e2m1 for m and the
    unsigned e2m2 for v, :data:`~srtrain.numerics.formats.NAMED_PAIRS`) means its moment's."""
    if name == "fp4":
        return NAMED_PAIRS[name][0 if moment == "m" else 1].name
    return get_format(name).name


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(allowed)}")


def _positive(key: str, value: float, strict: bool = True) -> None:
    if value < 0 or (strict and value == 0):
        relation = "> 0" if strict else ">= 0"
        raise ConfigError(f"{key}: must be {relation}, got {value!r}")


def _seed(key: str, value: int) -> None:
    """A seed: a non-negative 64-bit signed integer (torch's and numpy's generators take it)."""
    if not 0 <= value < 1 << 63:
        raise ConfigError(f"{key}: must be in [0, 2**63), got {value!r}")


def _one_line(err: Exception) -> str:
    """An error's text with its line breaks and indentation folded into single spaces."""
    return " ".join(str(err).split())


def _validate_model(model: ModelConfig) -> None:
    """The model section: a known preset and a buildable shape, or a readable config file."""
    from srtrain.models import PRESETS, SHAPE_KEYS, preset_shape, read_hf_config, shape_of

    _positive("model.seq_len", model.seq_len)
    init_from = model.init_from
    if init_from and not (Path(init_from) / "config.json").is_file():
        missing = (
            "holds no config.json"
            if Path(init_from).is_dir()
            else "is not a directory"
            if Path(init_from).exists()
            else "does not exist"
        )
        raise ConfigError(
            f"model.init_from: {init_from} {missing}; give a transformers model "
            "directory (config.json and safetensors weights)"
        )
    source_key = "model.hf_config" if model.hf_config else "model.init_from"
    source = model.hf_config or model.init_from
    if source:
        reshaped = [key for key in SHAPE_KEYS if getattr(model, key) not in (0, None)]
        if reshaped:
            raise ConfigError(
                f"model.{reshaped[0]}: shape keys change a preset; {source_key} "
                f"{source} gives the whole shape (edit its config.json instead)"
            )
        try:
            shape_of(read_hf_config(source)).check()
        except ValueError as err:
            raise ConfigError(f"{source_key}: {err}") from None
        return
    _choice("model.preset", model.preset, tuple(PRESETS))
    for key in SHAPE_KEYS:
        if key != "tied_embeddings":
            _positive(f"model.{key}", getattr(model, key), strict=False)
    try:
        preset_shape(
            model.preset, **{field: getattr(model, key) for key, field in SHAPE_KEYS.items()}
        )
    except ValueError as err:
        raise ConfigError(f"{err} (model.preset {model.preset})") from None


def validate(cfg: Config) -> None:
    """Check every value and combination; resolves format aliases in place."""
    _validate_model(cfg.model)
    o = cfg.optim
    for moment in ("m", "v"):
        key = f"optim.{moment}_format"
        name = getattr(o, f"{moment}_format")
        try:
            resolved = resolve_format(str(name), moment)
        except ValueError:
            raise ConfigError(
                f"{key}: unknown format {name!r}; allowed: fp4, {', '.join(FORMATS)}"
            ) from None
        setattr(o, f"{moment}_format", resolved)
    try:
        check_moment_formats(o.m_format, o.v_format)
    except ValueError as err:
        raise ConfigError(f"optim.{err}") from None
    for key in ("m_rounding", "v_rounding", "param_rounding"):
        _choice(f"optim.{key}", getattr(o, key), ROUNDING_MODES)
    _choice("optim.name", o.name, OPTIMIZERS)
    if o.step_in_backward and o.name != "sradamw":
        raise ConfigError(
            f"optim.step_in_backward: steps SRAdamW inside backward; optim.name={o.name} "
            "needs every gradient at once (set optim.step_in_backward=false)"
        )
    _choice("optim.backend", o.backend, BACKENDS)
    try:
        check_block_size(o.block_size)
    except ValueError as err:
        raise ConfigError(f"optim.block_size: {err}") from None
    _positive("optim.shadow_sample", o.shadow_sample, strict=False)
    _positive("optim.lr", o.lr)
    for key in ("beta1", "beta2"):
        value = getattr(o, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optim.{key}: must be in [0, 1), got {value!r}")
    _positive("optim.eps", o.eps)  # 0 divides by a second moment stored as 0
    _positive("optim.weight_decay", o.weight_decay, strict=False)
    _positive("optim.warmup_steps", o.warmup_steps, strict=False)
    _positive("optim.grad_clip", o.grad_clip, strict=False)
    _seed("optim.seed", o.seed)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio!r}")

    r = cfg.resets
    _choice("resets.mode", r.mode, RESET_MODES)
    if o.name == "torch_adamw" and r.mode != "none":
        raise ConfigError(
            f"resets.mode: {r.mode!r} resets SRAdamW's states; "
            "optim.name=torch_adamw needs resets.mode=none"
        )
    _choice("resets.states", r.states, ("m", "v", "both"))
    _positive("resets.m_period", r.m_period, strict=False)
    _positive("resets.v_period", r.v_period, strict=False)
    if r.mode == "periodic" and r.m_period == 0 and r.v_period == 0:
        raise ConfigError("resets.mode: 'periodic' needs resets.m_period or resets.v_period > 0")
    _positive("resets.tolerance", r.tolerance)
    if not 0.0 < r.threshold <= 1.0:
        raise ConfigError(f"resets.threshold: must be in (0, 1], got {r.threshold!r}")
    _positive("resets.window", r.window)
    _positive("resets.min_age", r.min_age, strict=False)
    _positive("resets.rewarmup", r.rewarmup, strict=False)

    p = cfg.parallel
    for key in ("activation_checkpointing", "compile"):
        value = getattr(p, key)
        if isinstance(value, str) and value != AUTO:
            raise ConfigError(
                f"parallel.{key}: {value!r} is not allowed; choose auto, true or false"
            )
    _choice("parallel.compute_dtype", p.compute_dtype, COMPUTE_DTYPES)
    _choice("parallel.fsdp_units", p.fsdp_units, FSDP_UNITS)
    if p.fsdp_units == "model" and cfg.optim.step_in_backward:
        raise ConfigError(
            "parallel.fsdp_units=model: optim.step_in_backward steps each block's unit as its "
            "gradients arrive; set parallel.fsdp_units=blocks (or auto)"
        )
    _choice("parallel.device", p.device, DEVICES)
    _positive("parallel.replicas", p.replicas)

    for key, path in (("train.run_dir", cfg.train.run_dir), ("data.dir", cfg.data.dir)):
        if not path.strip():
            raise ConfigError(
                f"{key}: empty; give a directory (it would write into the current one)"
            )
    t = cfg.train
    _positive("train.steps", t.steps)
    _positive("train.global_batch_size", t.global_batch_size)
    _positive("train.micro_batch_size", t.micro_batch_size, strict=False)
    _positive("train.log_interval", t.log_interval)
    _positive("train.val_interval", t.val_interval, strict=False)
    _positive("train.val_batches", t.val_batches, strict=False)
    _positive("train.peak_flops", t.peak_flops, strict=False)
    named_val_sets(t)
    _seed("train.seed", t.seed)
    for key in ("vocab_size", "max_bytes"):
        if getattr(cfg.data, key) is not None:
            _positive(f"data.{key}", getattr(cfg.data, key))
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction!r}")
    _positive("checkpoint.interval", cfg.checkpoint.interval, strict=False)
    if cfg.checkpoint.interval % t.log_interval:
        raise ConfigError(
            f"checkpoint.interval: {cfg.checkpoint.interval} must be a multiple of "
            f"train.log_interval ({t.log_interval}) so a resumed run logs exactly the same"
        )
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    if not 0.0 <= t.max_skipped_fraction <= 1.0:
        raise ConfigError(
            f"train.max_skipped_fraction: must be in [0, 1], got {t.max_skipped_fraction!r}"
        )


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the number of ranks."""
    replicas = cfg.parallel.replicas
    if world_size % replicas:
        raise ConfigError(
            f"parallel.replicas: {replicas} does not divide the {world_size} ranks; use a "
            f"divisor of {world_size} (the number of nodes for HSDP, 1 for plain FSDP)"
        )
    t = cfg.train
    if t.global_batch_size % world_size:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} does not divide by the "
            f"{world_size} ranks; use a multiple of {world_size}"
        )
    per_rank = t.global_batch_size // world_size
    if t.micro_batch_size and per_rank % t.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size: {t.micro_batch_size} does not divide the per-rank batch "
            f"of {per_rank} (global {t.global_batch_size} over {world_size} ranks)"
        )
    if cfg.optim.step_in_backward and t.micro_batch_size and t.micro_batch_size < per_rank:
        raise ConfigError(
            f"optim.step_in_backward: steps each unit as its gradients arrive, so it cannot "
            f"accumulate {per_rank // t.micro_batch_size} micro-batches of "
            f"train.micro_batch_size={t.micro_batch_size}; set train.micro_batch_size=0 (the "
            f"per-rank batch of {per_rank} at once) or optim.step_in_backward=false"
        )


VAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def named_val_sets(train: TrainConfig) -> dict[str, str]:
    """``train.val_sets`` as name → data dir: ``NAME=DIR`` names its dir, a bare ``DIR`` is
    named by its last path component. ConfigError (one line) for an empty entry, a name
    outside ``[A-Za-z0-9_.-]``, a name given twice, or val sets without validation."""
    sets: dict[str, str] = {}
    for entry in train.val_sets:
        name, _, path = entry.partition("=") if "=" in entry else ("", "", entry)
        name = name or Path(path.rstrip("/")).name
        if not path.strip():
            raise ConfigError(f"train.val_sets: entry {entry!r} names no data dir")
        if not VAL_SET_NAME.fullmatch(name):
            raise ConfigError(
                f"train.val_sets: name {name!r} of {entry!r} may hold only letters, digits, "
                "'_', '.' and '-'; give one as NAME=DIR"
            )
        if name in sets:
            raise ConfigError(
                f"train.val_sets: two sets are named {name!r}; give each its own as NAME=DIR"
            )
        sets[name] = path
    if sets and not (train.val_interval and train.val_batches):
        raise ConfigError(
            "train.val_sets: validated only when the run validates; set train.val_interval "
            "and train.val_batches above 0"
        )
    return sets


def data_source(data: DataConfig) -> str:
    """The source that prepares ``data.dir`` when it holds no prepared data: ``data.source``
    when the config names it, the builtin corpus for the default job's own dir
    (``data/builtin``), else "": nothing, and a missing ``data.dir`` is an error, so a
    mistyped path is never filled with the default corpus. This is the one place the
    default source is decided."""
    if data.source:
        return data.source
    if os.path.abspath(data.dir) == os.path.abspath(DEFAULT_DATA_DIR):
        return DEFAULT_DATA_SOURCE
    return ""


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
