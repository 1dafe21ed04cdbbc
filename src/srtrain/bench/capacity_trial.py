"""One capacity trial in this process: build, shard, init and train a LLaMA shape as srtrain
trains it, on random tokens, and report what it cost (or where it failed) as one JSON row.

``python -m srtrain.bench.capacity_trial SPEC.json ROW.json`` reads a :class:`TrialSpec` and
writes the row. A failure inside the trial (an out-of-memory error above all) is part of the
result: the row says ``fit: false`` with the error's first line, and the process exits 0.
Under torchrun every rank trains its share (FSDP2 over ``gpus`` ranks, HSDP with
``replicas`` > 1) and writes its own row: rank 0 to ROW.json, rank r to ROW.rank<r>.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from srtrain.models import Shape

GIB = 2**30

# optimizer variants: config overrides on top of srtrain's defaults
VARIANTS: dict[str, tuple[str, ...]] = {
    # torch's AdamW: FP32 master weights and FP32 states
    "torch": ("optim.name=torch_adamw",),
    # SRAdamW, FP8 m and v, FP32 master weights
    "fp8": ("optim.m_format=fp8", "optim.v_format=fp8"),
    # FP8 states, BF16 weights rounded stochastically (no FP32 master copy)
    "fp8-bf16w": ("optim.m_format=fp8", "optim.v_format=fp8", "parallel.bf16_params=true"),
    # FP4 states, BF16 weights
    "fp4-bf16w": ("optim.m_format=fp4", "optim.v_format=fp4", "parallel.bf16_params=true"),
    # FP4 states, BF16 weights, each FSDP2 unit stepped inside backward (no whole-model grads)
    "fp4-bf16w-inbwd": (
        "optim.m_format=fp4",
        "optim.v_format=fp4",
        "parallel.bf16_params=true",
        "optim.step_in_backward=true",
    ),
}


@dataclass(frozen=True)
class TrialSpec:
    """One trial: a variant training a LLaMA shape at a micro-batch, with or without activation
    checkpointing, for ``warmup_steps`` then ``measured_steps`` steps (one micro-batch a step
    per rank, over ``gpus`` ranks in ``replicas`` replicas). Memory peaks and tokens/s cover
    the measured steps only. ``repeat_batch``: every step trains on the same batch, so a model
    that learns shows a falling loss; ``overrides`` are config overrides applied last."""

    variant: str
    rung: str
    shape: Shape
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    warmup_steps: int
    measured_steps: int
    device: str = "cuda"
    vocab_size: int = 32000
    search: str = ""  # which search asked for it: "ladder" or "throughput"
    gpus: int = 1
    replicas: int = 1
    repeat_batch: bool = False
    overrides: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The spec as plain JSON data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrialSpec:
        """The spec written by :meth:`to_dict`."""
        return cls(
            **{
                **data,
                "shape": Shape(**data["shape"]),
                "overrides": tuple(data.get("overrides", ())),
            }
        )

    @classmethod
    def from_row(cls, row: dict, shapes: dict) -> TrialSpec:
        """The spec of a recorded result row, its rung's shape from ``shapes`` (the result
        file's ``settings["shapes"]``); fields a row does not record keep their defaults."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"shape", "overrides"}
        return cls(
            **{k: row[k] for k in fields if k in row},
            shape=Shape(**shapes[row["rung"]]),
            overrides=tuple(row.get("overrides", ())),
        )

    def row(self) -> dict:
        """The row's fields that come from the spec alone."""
        return {
            "variant": self.variant,
            "rung": self.rung,
            "search": self.search,
            "hidden": self.shape.hidden,
            "intermediate": self.shape.intermediate,
            "layers": self.shape.layers,
            "heads": self.shape.heads,
            "kv_heads": self.shape.key_value_heads,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "activation_checkpointing": self.activation_checkpointing,
            "device": self.device,
            "warmup_steps": self.warmup_steps,
            "measured_steps": self.measured_steps,
            "gpus": self.gpus,
            "replicas": self.replicas,
        }


# the LLaMA preset a trial's shape keys change: its rotary base and norm epsilon stay
BASE_PRESET = "llama2-7b"


def trial_config(spec: TrialSpec):
    """The srtrain Config of a trial: its shape as ``model.*`` keys on a LLaMA preset, the
    variant's optimizer and precision settings, its batch (``micro_batch`` per rank), mesh and
    device, then the spec's ``overrides``."""
    from srtrain.config import load_config

    if spec.variant not in VARIANTS:
        raise ValueError(f"unknown variant {spec.variant!r}; allowed: {', '.join(VARIANTS)}")
    if spec.shape.family != "llama":
        raise ValueError(f"capacity trials train LLaMA shapes, got family {spec.shape.family!r}")
    s = spec.shape
    return load_config(
        None,
        [
            f"model.preset={BASE_PRESET}",
            f"model.hidden={s.hidden}",
            f"model.intermediate={s.intermediate}",
            f"model.layers={s.layers}",
            f"model.heads={s.heads}",
            f"model.kv_heads={s.key_value_heads}",
            f"model.tied_embeddings={str(s.tied).lower()}",
            *VARIANTS[spec.variant],
            f"parallel.activation_checkpointing={str(spec.activation_checkpointing).lower()}",
            "parallel.compile=false",
            "parallel.fsdp_units=blocks",  # the layout of every GPU of a node, and the leanest
            f"parallel.device={spec.device}",
            f"model.seq_len={spec.seq_len}",
            f"train.global_batch_size={spec.micro_batch * spec.gpus}",
            f"train.micro_batch_size={spec.micro_batch}",
            f"train.steps={spec.warmup_steps + spec.measured_steps}",
            f"parallel.replicas={spec.replicas}",
            *spec.overrides,
        ],
    )


def is_oom(err: BaseException) -> bool:
    """Whether an error means the device ran out of memory: the CUDA allocator's error, a
    library's failed allocation (cuBLAS's), or the CPU allocator's."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or any(
        phrase in text for phrase in ("out of memory", "alloc_failed", "can't allocate memory")
    )


def error_line(err: BaseException, limit: int = 500) -> str:
    """The error's type and message on one line, cut at ``limit`` characters (a CUDA
    out-of-memory message names the request, the free memory and the allocator's split
    between allocated and reserved)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:limit]


def random_batches(
    vocab_size: int,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    seed: int = 0,
    repeat: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, labels) of uniformly random token ids drawn from ``seed``, made on
    ``device``; with ``repeat`` the first batch again and again."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = None
    while True:
        if tokens is None or not repeat:
            tokens = torch.randint(
                vocab_size, (micro_batch, seq_len + 1), device=device, generator=generator
            )
        yield tokens[:, :-1], tokens[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(value: int) -> float:
    return value / GIB


# What runs after a trial's last step, given (model, optimizer, mesh, info): its dict joins
# the row (an error in it is the trial's failure, in phase "after").
AfterTrial = Callable[[torch.nn.Module, object, object, object], dict]


def run_trial(spec: TrialSpec, after: AfterTrial | None = None) -> dict:
    """Run one trial in this process; the row, with ``fit`` false and the error on failure.

    The sequence is the trainer's: :func:`srtrain.build.build_model` and
    :func:`srtrain.build.build` (FSDP2 with BF16 compute on CUDA and FP32 reduction, no
    compile, the seeded init, the optimizer), then per step ``train_step``,
    ``clip_grad_norm_``, ``prepare_step``, ``step``, ``zero_grad``; with
    ``optim.step_in_backward``, as the trainer's ``Loop.train_one`` steps inside backward,
    :class:`srtrain.optim.in_backward.StepInBackward`'s ``begin``, ``train_step`` (whose
    backward steps each unit and frees its gradients) and ``finish``, and nothing else (a
    step with a skipped unit counts as skipped). On CUDA the row holds
    the memory free before the trial, the memory allocated after init (timed, synchronised),
    the peak of the warm-up steps (the optimizer states appear in the first), and the peaks
    allocated and reserved over the measured steps, which tokens/s and MFU also cover.
    Each rank draws its own batches (seeded by its rank). The row also holds every step's
    loss (this rank's), and the seconds of the measured steps and of their optimizer part
    (``prepare_step``, ``step`` and the stall counts, timed between device synchronisations
    after gradient clipping and at the step's end; inside backward, only ``finish`` and the
    stall counts after backward, the units' steps being part of backward). ``after``, if
    given, runs last.
    """
    from srtrain.build import build, build_model
    from srtrain.metrics import ThroughputMeter, peak_flops, peak_memory_gib
    from srtrain.models import count_params, flops_per_token
    from srtrain.optim.in_backward import StepInBackward
    from srtrain.parallel import clip_grad_norm_, fsdp_units, init_distributed
    from srtrain.trainer import lr_at, train_step

    row = spec.row()
    phase = "config"
    try:
        cfg = trial_config(spec)
        info = init_distributed(cfg.parallel.device)
        cuda = info.device.type == "cuda"
        if cuda:  # what the trial finds free: another process on the device would show here
            free, total = torch.cuda.mem_get_info(info.device)
            row.update(device_free_gib=_gib(free), device_total_gib=_gib(total))
        phase = "build"
        start = time.perf_counter()
        model_config, model = build_model(cfg, spec.vocab_size)
        row["params"] = count_params(model)
        per_token = flops_per_token(model, spec.seq_len)
        row["build_s"] = time.perf_counter() - start

        phase = "init"
        _sync(info.device)
        start = time.perf_counter()
        built = build(cfg, info, model_config, model)
        optimizer, compute, mesh = built.optimizer, built.compute, built.mesh
        if optimizer.counts_stalls:
            optimizer.count_health = False  # the ordinary step; nothing reports them
        params = built.params
        _sync(info.device)
        row["init_s"] = time.perf_counter() - start
        row["compute_dtype"] = str(compute).removeprefix("torch.")
        if cuda:
            row["init_allocated_gib"] = _gib(torch.cuda.memory_allocated(info.device))
            row["init_reserved_gib"] = _gib(torch.cuda.memory_reserved(info.device))

        batches = random_batches(
            spec.vocab_size,
            spec.micro_batch,
            spec.seq_len,
            info.device,
            seed=info.rank,
            repeat=spec.repeat_batch,
        )
        meter = ThroughputMeter(per_token, peak_flops(info.device), info.world_size)
        grad_clip = cfg.optim.grad_clip or float("inf")
        in_backward = (
            StepInBackward(optimizer, fsdp_units(model), grad_clip, built.shards, info.device)
            if cfg.optim.step_in_backward
            else None
        )
        skipped = 0
        losses = []
        step_s = optimizer_s = 0.0
        for step in range(1, spec.warmup_steps + spec.measured_steps + 1):
            phase = f"step {step}"
            if step == spec.warmup_steps + 1:
                _sync(info.device)
                if cuda:
                    row["warmup_peak_allocated_gib"] = _gib(
                        torch.cuda.max_memory_allocated(info.device)
                    )
                    torch.cuda.reset_peak_memory_stats(info.device)
                meter.measure()  # restarts the window
            measured = step > spec.warmup_steps
            step_start = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if in_backward is not None:
                in_backward.begin()
                loss, tokens = train_step(model, batches, 1, info.device)
                _sync(info.device)
                optimizer_start = time.perf_counter()
                skipped += bool(in_backward.finish().skipped_units)
                optimizer.take_stall_counts()
            else:
                loss, tokens = train_step(model, batches, 1, info.device)
                grad_norm = clip_grad_norm_(params, grad_clip, mesh)
                _sync(info.device)
                optimizer_start = time.perf_counter()
                optimizer.prepare_step()
                if torch.isfinite(grad_norm):
                    optimizer.step()
                    if optimizer.counts_stalls:
                        optimizer.take_stall_counts()
                else:
                    skipped += 1
            _sync(info.device)
            if measured:
                end = time.perf_counter()
                step_s += end - step_start
                optimizer_s += end - optimizer_start
            if in_backward is None:
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
            if measured:
                meter.update(tokens * info.world_size)
        _sync(info.device)
        tokens_per_s, mfu = meter.measure()
        row.update(
            fit=True,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            skipped_steps=skipped,
            final_loss=float(losses[-1]),
            losses=[float(x) for x in losses],
            measured_step_s=step_s,
            measured_optimizer_s=optimizer_s,
        )
        if cuda:
            row.update(
                memory_source="cuda",
                peak_allocated_gib=_gib(torch.cuda.max_memory_allocated(info.device)),
                peak_reserved_gib=_gib(torch.cuda.max_memory_reserved(info.device)),
            )
        else:
            row.update(memory_source="maxrss", peak_allocated_gib=peak_memory_gib(info.device)[0])
        if not math.isfinite(row["final_loss"]):
            row.update(
                fit=False, oom=False, phase=phase, error=f"non-finite loss {row['final_loss']}"
            )
        elif after is not None:
            phase = "after"
            row.update(after(model, optimizer, mesh, info))
    except Exception as err:  # the failure is the trial's result
        row.update(fit=False, oom=is_oom(err), phase=phase, error=error_line(err))
        if torch.cuda.is_initialized():
            row["failure_peak_allocated_gib"] = _gib(torch.cuda.max_memory_allocated())
    return row


def main(argv: list[str]) -> int:
    """Run the spec in ``argv[0]``, write the row to ``argv[1]``."""
    import torch.distributed as dist

    spec = TrialSpec.from_dict(json.loads(Path(argv[0]).read_text()))
    row = run_trial(spec)
    write_row(row, Path(argv[1]))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def rank_row_path(out: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its row: ``out`` for rank 0, ``<stem>.rank<r>.json``
    beside it for the others."""
    return out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}.json")


def write_row(row: dict, out: Path) -> None:
    """Write this rank's row (see :func:`rank_row_path`), never half-written."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    out = rank_row_path(out, rank)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
