"""What a run trains: the model on its mesh (FSDP2/HSDP), its weights, and the optimizer.

:func:`build` is the one setup the trainer and the capacity trials share: the model of the
config's ``model`` section on the meta device, sharded by :func:`srtrain.parallel.apply_fsdp`
(compute dtype, compile and activation checkpointing as configured, ``auto`` resolved
here), materialized on the device, initialised (``model.init_from``'s weights, else the
seeded init) and given ``optim.name``'s optimizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from srtrain.config import AUTO, Config, ConfigError
from srtrain.models import build_model_from_config, init_weights, no_decay, resolve_model_config
from srtrain.optim import SRAdamW, TorchAdamW
from srtrain.parallel import (
    DistInfo,
    apply_fsdp,
    compile_choice,
    compute_dtype,
    device_mesh,
    shard_group,
)
from srtrain.param_groups import param_group_of
from srtrain.plan import GIB, checkpointing_fits, plan_run
from srtrain.pretrained import load_pretrained


@dataclass
class Built:
    """A run's model and optimizer, and the choices made building them."""

    model_config: PretrainedConfig
    model: torch.nn.Module
    mesh: DeviceMesh
    shards: dist.ProcessGroup  # one replica's ranks: sums over shards go through it
    compute: torch.dtype
    compiled: bool
    compile_notice: str | None  # why compile is off where it was asked for, else None
    checkpointed: bool
    checkpointing_why: str  # the console's reason for an ``auto`` choice, else ""
    units: str  # FSDP2 units: "blocks" or "model" (parallel.fsdp_units resolved)
    optimizer: SRAdamW | TorchAdamW
    labels: list[str]  # each optimized parameter's layer group, in the optimizer's order

    @property
    def params(self) -> list[torch.Tensor]:
        """The optimized parameters, in the optimizer's order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]


def build_model(cfg: Config, vocab_size: int) -> tuple[PretrainedConfig, torch.nn.Module]:
    """The model config and the model on the meta device; ConfigError for a bad shape."""
    try:
        model_config = resolve_model_config(cfg.model, vocab_size)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    return model_config, build_model_from_config(model_config)


def build(
    cfg: Config,
    info: DistInfo,
    model_config: PretrainedConfig,
    model: torch.nn.Module,
) -> Built:
    """Shard ``model`` (from :func:`build_model`) over the mesh, materialize and initialise it
    on ``info.device``, and build the optimizer over its shards."""
    mesh = device_mesh(info, cfg.parallel.replicas)
    compute = compute_dtype(cfg.parallel.compute_dtype, info.device)
    compiled, compile_notice = compile_choice(cfg.parallel.compile, info.device)
    checkpointed, checkpointing_why = checkpointing_choice(cfg, info, model_config)
    units = units_choice(cfg, info, model_config)
    apply_fsdp(
        model,
        mesh,
        param_dtype=compute,
        reduce_dtype=torch.float32,
        bf16_params=cfg.parallel.bf16_params,
        activation_checkpointing=checkpointed,
        compile_blocks=compiled,
        units=units,
    )
    model.to_empty(device=info.device)
    if cfg.model.init_from:
        load_pretrained(model, cfg.model.init_from)
    else:
        init_weights(model, cfg.train.seed)
    optimizer, labels = build_optimizer(model, cfg)
    return Built(
        model_config=model_config,
        model=model,
        mesh=mesh,
        shards=shard_group(mesh),
        compute=compute,
        compiled=compiled,
        compile_notice=compile_notice,
        checkpointed=checkpointed,
        checkpointing_why=checkpointing_why,
        units=units,
        optimizer=optimizer,
        labels=labels,
    )


def build_optimizer(model: torch.nn.Module, cfg: Config) -> tuple[SRAdamW | TorchAdamW, list[str]]:
    """``optim.name``'s optimizer with decay and no-decay groups; also each parameter's layer
    group, in order."""
    decay, exempt, names_decay, names_exempt = [], [], [], []
    for name, p in model.named_parameters():
        if no_decay(name, p):
            exempt.append(p)
            names_exempt.append(name)
        else:
            decay.append(p)
            names_decay.append(name)
    o = cfg.optim
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    labels = [param_group_of(n) for n in names_decay + names_exempt]
    if o.name == "torch_adamw":
        return TorchAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps), labels
    optimizer = SRAdamW(
        groups,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        m_format=o.m_format,
        v_format=o.v_format,
        m_rounding=o.m_rounding,
        v_rounding=o.v_rounding,
        param_rounding=o.param_rounding,
        block_size=o.block_size,
        seed=o.seed,
        backend=o.backend,
        rewarmup=cfg.resets.rewarmup,
        shadow_sample=o.shadow_sample,
    )
    return optimizer, labels


def checkpointing_choice(
    cfg: Config, info: DistInfo, model_config: PretrainedConfig
) -> tuple[bool, str]:
    """Whether the blocks recompute their activations, and why when ``auto`` chose: on a
    GPU the memory planner's peak without checkpointing decides
    (:func:`srtrain.plan.checkpointing_fits`); on a CPU it stays off."""
    setting = cfg.parallel.activation_checkpointing
    if setting != AUTO:
        return bool(setting), ""
    if info.device.type != "cuda":
        return False, " (auto)"
    gpu_bytes = torch.cuda.get_device_properties(info.device).total_memory
    return checkpointing_on_gpu(cfg, info.world_size, model_config, gpu_bytes)


def units_choice(cfg: Config, info: DistInfo, model_config: PretrainedConfig) -> str:
    """``parallel.fsdp_units`` resolved: ``auto`` is "model" in a single process that does
    not step inside backward, where (on a GPU) the memory planner says the run fits with
    the whole model gathered (:func:`srtrain.plan.plan_run`); else "blocks"."""
    setting = cfg.parallel.fsdp_units
    if setting != AUTO:
        return setting
    if info.world_size > 1 or cfg.optim.step_in_backward:
        return "blocks"
    if info.device.type != "cuda":
        return "model"
    gpu_bytes = torch.cuda.get_device_properties(info.device).total_memory
    return plan_run(cfg, 1, model_config, gpu_bytes).units


def checkpointing_on_gpu(
    cfg: Config, world_size: int, model_config: PretrainedConfig, gpu_bytes: int
) -> tuple[bool, str]:
    """``auto`` on GPUs of ``gpu_bytes``: on where the planned peak without checkpointing
    does not fit (:func:`srtrain.plan.checkpointing_fits`), and the console's reason."""
    without = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, activation_checkpointing=False)
    )
    planned = plan_run(without, world_size, model_config, gpu_bytes).plan
    why = f" (auto: planned {planned.total / GIB:.1f} of {gpu_bytes / GIB:.1f} GiB without it)"
    return not checkpointing_fits(planned, gpu_bytes), why
