"""Process group and device mesh setup, FSDP2 sharding with mixed precision, grad clipping.

A run always has a process group, also when started without torchrun: a single
process joins a group of one over an in-process ``HashStore`` (no port, no env vars),
so the mesh, FSDP2 and the collectives take the same code path at every world size.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from srtrain.config import FSDP_UNIT_KINDS
from srtrain.models import decoder_layers

_DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the run and which device and backend it uses."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that logs and writes files)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    """An integer environment variable, with one clear error when it is not one."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _attempt_store(rank: int, world_size: int) -> dist.Store | None:
    """Under torchrun, the rendezvous store with a prefix per restart attempt.

    torchrun keeps its store across ``--max-restarts``; without a prefix, restarted
    workers can read the addresses their dead predecessors published and fail to
    connect. Outside torchrun: None (the default env:// rendezvous).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT", 29500),
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timedelta(minutes=30),
        multi_tenant=not agent_hosts_store,
    )
    return dist.PrefixStore(f"srtrain/attempt-{attempt}/", store)


def init_distributed(device_type: str | None = None) -> DistInfo:
    """Join (or start) the process group from torchrun's env vars and pick the device.

    ``device_type`` "cuda" (backend NCCL) or "cpu" (backend gloo); by default CUDA when
    available. Without RANK/WORLD_SIZE in the environment this is rank 0 of a world of 1.
    An already initialised default group is reused.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in _DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {_DEVICE_TYPES}, got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device_type 'cuda' was asked for but CUDA is not available")
    backend = "nccl" if device_type == "cuda" else "gloo"
    local_rank = _env_int("LOCAL_RANK", 0)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                store=_attempt_store(rank, world_size),
                device_id=device if device_type == "cuda" else None,
            )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
    )


REPLICATE_DIM, SHARD_DIM = "replicate", "shard"


def device_mesh(info: DistInfo, replicas: int = 1) -> DeviceMesh:
    """The data-parallel mesh on the run's device type.

    ``replicas`` 1: a 1-D mesh (dim name "dp") over all ranks, plain FSDP. ``replicas`` R > 1:
    a 2-D mesh of shape (R, world/R), dims ("replicate", "shard"), on which ``fully_shard`` is
    HSDP. Row r holds ranks r·world/R … (r+1)·world/R − 1, so with torchrun (consecutive ranks
    on one node) and R nodes, parameters are sharded within a node and replicated across nodes.
    """
    if replicas < 1 or info.world_size % replicas:
        raise ValueError(
            f"parallel.replicas={replicas} must be a positive divisor of the "
            f"world size {info.world_size}"
        )
    if replicas == 1:
        return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(
        info.device.type,
        (replicas, info.world_size // replicas),
        mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
    )


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks that together hold one full copy of the sharded model and optimizer state.

    Sums over shards (gradient norms, stall counts, state bytes, adaptive reset statistics)
    reduce over this group: all ranks of a 1-D mesh; on a 2-D (HSDP) mesh, this rank's row
    (its "shard" dim). Replicas hold bit-identical shards, so reducing over all ranks would
    count every element once per replica.
    """
    return mesh.get_group(SHARD_DIM) if mesh.ndim == 2 else mesh.get_group()


def _checkpoint_forward(block: nn.Module) -> None:
    """Make a block recompute its activations in backward, keeping parameter names."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point parameters (not buffers) to ``dtype`` in place."""
    for module in model.modules():
        for key, param in module.named_parameters(recurse=False):
            if param.is_floating_point():
                setattr(module, key, nn.Parameter(param.to(dtype), param.requires_grad))


_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compile_unavailable(device: torch.device) -> str:
    """Why ``torch.compile`` cannot compile the blocks on ``device`` here ("" when it can)."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python or platform"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "torch.compile needs Triton for CUDA, and Triton does not work here"
    return ""


def compile_choice(setting: bool | str, device: torch.device) -> tuple[bool, str]:
    """Whether the blocks are compiled under ``parallel.compile``, and a notice line when
    ``auto`` cannot compile where it would: ``auto`` compiles on CUDA where
    :func:`compile_unavailable` finds nothing in the way, and never on a CPU (where the
    tiny runs spend longer compiling than training)."""
    if setting != "auto":
        return bool(setting), ""
    if device.type != "cuda":
        return False, ""
    reason = compile_unavailable(device)
    if reason:
        return (
            False,
            f"compile: {reason}; the blocks run eagerly (parallel.compile=false hides this)",
        )
    return True, ""


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype of ``parallel.compute_dtype``: ``auto`` is BF16 on CUDA and
    FP32 on a CPU, where BF16 matrix products run slower than FP32 ones without BF16 matrix
    units."""
    if setting == "auto":
        setting = "bf16" if device.type == "cuda" else "fp32"
    return _TORCH_DTYPES[setting]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    bf16_params: bool = False,
    activation_checkpointing: bool = False,
    compile_blocks: bool = False,
    units: str = "blocks",
) -> nn.Module:
    """Shard a causal LM with FSDP2. ``units="blocks"``: each block, the embeddings, the head,
    then the root are units of their own (a tied embedding and head are sharded with the
    root, since both use the one table); each unit is gathered and its gradients reduced
    apart, overlapping communication with compute. ``units="model"``: the whole model is one
    unit, gathered once a forward and reduced once a backward: fewer hooks and launches,
    for one GPU, where there is nothing to overlap; its unsharded copy is held from forward
    to the end of backward. On a CPU the losses match bit for bit either way (tested).

    On a 1-D mesh this is FSDP; on a 2-D :func:`device_mesh` it is HSDP: parameters are
    sharded over the "shard" dim (placements (Replicate(), Shard(0))) and gradients are
    reduce-scattered within a row, then averaged across rows.

    Compute runs in ``param_dtype`` and gradients are reduced in ``reduce_dtype``. The
    sharded (master) parameters stay FP32 unless ``bf16_params``, where they are BF16
    themselves. Blocks optionally recompute activations in backward and are optionally
    compiled with ``torch.compile``; parameter names do not change. Call on the meta
    device, then ``model.to_empty(device=...)`` and ``init_weights``.
    """
    if units not in FSDP_UNIT_KINDS:
        raise ValueError(
            f"units {units!r} is not allowed; choose one of {', '.join(FSDP_UNIT_KINDS)}"
        )
    if bf16_params:
        _cast_params(model, torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in decoder_layers(model):
        if activation_checkpointing:
            _checkpoint_forward(block)
        if compile_blocks:
            block.compile()
        if units == "blocks":
            fully_shard(block, mesh=mesh, mp_policy=policy)
    if units == "blocks" and not model.config.tie_word_embeddings:
        # a tied table stays with the root's parameters
        fully_shard(model.get_input_embeddings(), mesh=mesh, mp_policy=policy)
        fully_shard(model.get_output_embeddings(), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fsdp_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each FSDP2 unit of ``model`` (each module ``fully_shard`` was applied
    to, holding its parameters that no inner unit holds), innermost units first; every
    parameter of ``model`` is in one. FSDP2 reduce-scatters a unit's gradients together."""
    roots = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not roots:
        raise ValueError("the model has no FSDP2 unit; apply fully_shard (apply_fsdp) first")
    owner: dict[int, int] = {}
    depth = {id(m): name.count(".") + bool(name) for name, m in model.named_modules()}
    units: list[list[nn.Parameter]] = []
    for module in sorted(roots, key=lambda m: -depth[id(m)]):
        unit = [p for p in module.parameters() if id(p) not in owner]
        for p in unit:
            owner[id(p)] = len(units)
        units.append(unit)
    return [unit for unit in units if unit]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether a tensor is a DTensor sharded across ranks (vs. a full replica)."""
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared L2 norms of ``tensors`` (FP32, 0-d): multi-tensor launches
    grouped by dtype instead of one reduction per tensor."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        total += torch.stack(norms).square().sum()
    return total


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    mesh_or_group: DeviceMesh | dist.ProcessGroup | None,
) -> torch.Tensor:
    """Scale gradients in place to a global L2 norm of at most ``max_norm``; return the norm.

    Squared norms of sharded gradients are summed in FP32 with one all_reduce over
    ``mesh_or_group`` (a mesh, reduced over its :func:`shard_group`, or a group; None: no
    reduction); replicated gradients (plain tensors) count once. On an HSDP mesh FSDP has
    already averaged the gradients across replicas, so one replica's shards hold the whole
    gradient. The scale min(1, max_norm/(norm+1e-6)) is applied on the device without a
    host synchronisation. The returned norm is a 0-d FP32 device tensor, non-finite when
    any gradient is.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    group = shard_group(mesh_or_group) if isinstance(mesh_or_group, DeviceMesh) else mesh_or_group
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sharded = [local for grad, local in zip(grads, locals_, strict=True) if is_sharded(grad)]
    replicated = [local for grad, local in zip(grads, locals_, strict=True) if not is_sharded(grad)]
    sharded_sq = sum_of_squares(sharded, locals_[0].device)
    replicated_sq = sum_of_squares(replicated, locals_[0].device)
    if group is not None:
        dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM, group=group)
    norm = (sharded_sq + replicated_sq).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(locals_, scale)
    return norm
