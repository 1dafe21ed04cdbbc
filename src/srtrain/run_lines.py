"""The lines a training run prints about itself: the first line (model, mesh, optimizer),
the ``setup:`` line (compile, activation checkpointing, FSDP2 units, and why) and the lines
around the first step, which compiles the blocks and builds the kernels."""

from __future__ import annotations

import time

import torch

from srtrain.build import Built
from srtrain.config import AUTO, Config
from srtrain.models import count_params
from srtrain.optim import SRAdamW, TorchAdamW
from srtrain.parallel import DistInfo


class FirstStep:
    """The console lines around the first step a process trains, which also compiles the
    blocks (with ``parallel.compile``) and builds the optimizer's kernels: a line as it
    starts, and one with its wall time once it has finished on the device."""

    def __init__(self, step: int, compiled: bool, device: torch.device) -> None:
        self.step, self.compiled, self.device = step, compiled, device
        self._started = 0.0

    def starting(self) -> str:
        """The line before the step; starts its clock."""
        self._started = time.perf_counter()
        work = "compiles the blocks and builds the kernels" if self.compiled else "builds kernels"
        return f"training from step {self.step}: its first step {work}, the next run faster"

    def finished(self) -> str:
        """The line after the step, once the device has finished it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._started
        compiled = ", compile included" if self.compiled else ""
        return f"first step done in {seconds:.1f} s{compiled}"


def describe_optimizer(optimizer: SRAdamW | TorchAdamW, cfg: Config) -> str:
    """The optimizer in the run's first log line."""
    if isinstance(optimizer, TorchAdamW):
        return f"torch AdamW ({optimizer.implementation}), states in the parameters' dtype"
    o = cfg.optim
    described = (
        f"m {o.m_format}/{o.m_rounding}, v {o.v_format}/{o.v_rounding}, resets {cfg.resets.mode}"
    )
    if o.step_in_backward:
        clipping = (
            f"clipped to {o.grad_clip:g} by the previous step's gradient norm"
            if o.grad_clip
            else "no clipping"
        )
        described += f", stepped inside backward ({clipping})"
    return described


def describe_model(cfg: Config, model: torch.nn.Module) -> str:
    """The model in the run's first log line: where its shape comes from and its size."""
    m = cfg.model
    source = m.hf_config or m.init_from or m.preset
    return f"{source} ({count_params(model) / 1e6:,.1f}M parameters)"


def first_line(cfg: Config, info: DistInfo, built: Built, resets) -> str:
    """The run's first log line: model, mesh, compute dtype, optimizer, reset periods."""
    return (
        f"srtrain: {describe_model(cfg, built.model)} on {info.world_size}×{info.device.type} "
        + (
            f"(HSDP: {cfg.parallel.replicas} replicas of "
            f"{info.world_size // cfg.parallel.replicas} shards) "
            if built.mesh.ndim == 2
            else ""
        )
        + f"({info.backend}, {str(built.compute).removeprefix('torch.')} compute), "
        + describe_optimizer(built.optimizer, cfg)
        + (
            f" (periods m {resets.periods['m']}, v {resets.periods['v']})"
            if cfg.resets.mode in ("periodic", "theory")
            else ""
        )
    )


def setup_line(cfg: Config, built: Built) -> str:
    """The ``setup:`` line: compiled or eager blocks, activation checkpointing, and why, and
    the FSDP2 units."""
    return (
        f"setup: blocks {'compiled' if built.compiled else 'eager'}"
        + (" (parallel.compile auto)" if cfg.parallel.compile == AUTO else "")
        + f", activation checkpointing {'on' if built.checkpointed else 'off'}"
        + built.checkpointing_why
        + (", one FSDP2 unit" if built.units == "model" else ", an FSDP2 unit a block")
        + (" (parallel.fsdp_units auto)" if cfg.parallel.fsdp_units == AUTO else "")
    )
