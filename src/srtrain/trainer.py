"""The training loop, and nothing else: data → model → loss → clip → SRAdamW → resets → metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from srtrain import val_sets
from srtrain.build import Built, build, build_model
from srtrain.checkpoint import (
    CheckpointManager,
    finished_step,
    latest,
)
from srtrain.config import Config, ConfigError, validate_world
from srtrain.console import (
    RunClock,
    closing_line,
    print_line,
)
from srtrain.data import (
    IGNORE_INDEX,
    BatchLoader,
    DataMeta,
)
from srtrain.errors import SkippedStepsError, agree
from srtrain.faultpoints import fault_point
from srtrain.metrics import (
    TAG_GRAD_NORM,
    TAG_LOSS,
    TAG_LR,
    TAG_MEMORY,
    TAG_MFU,
    TAG_TOKENS_PER_S,
    TAG_VAL_LOSS,
    MetricsLogger,
    StallAggregator,
    StallReport,
    ThroughputMeter,
    peak_flops,
    peak_memory_gib,
    record_key,
)
from srtrain.models import (
    count_params,
    flops_per_token,
)
from srtrain.optim import SRAdamW, TorchAdamW, shadow
from srtrain.optim.in_backward import StepInBackward
from srtrain.optim.resets import schedule_from_config
from srtrain.optim.sradamw import shard_offset
from srtrain.optim.update_size import UpdateSizes
from srtrain.parallel import (
    DistInfo,
    clip_grad_norm_,
    fsdp_units,
    init_distributed,
)
from srtrain.preflight import check_before_training, prepare_data, validating
from srtrain.record import History
from srtrain.resume import CLIP_NORM_KEY, open_run_dir, resume
from srtrain.run_lines import FirstStep, first_line, setup_line
from srtrain.rundir import check_writable, finished_message
from srtrain.rundir_lock import Ownership, own_run_dir
from srtrain.stopping import (
    EXIT_SAVED,
    RunStopped,
    StopSignals,
    handling,
    signal_exit_code,
    signal_name,
)
from srtrain.theory import block_stall_probability

# After a reset (and at the start of training) the applied update's size is measured every
# step for this many steps of the youngest state's age, to show the burst and its fading;
# otherwise at log steps.
UPDATE_WATCH_STEPS = 50


@dataclass
class TrainResult:
    """What a finished run reports back (rank 0 has the global values)."""

    losses: list[float] = field(default_factory=list)  # global mean loss per step
    val_losses: dict[int, float] = field(default_factory=dict)
    val_set_losses: dict[str, dict[int, float]] = field(default_factory=dict)  # train.val_sets
    resets: dict[int, list[str]] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    stall_reports: dict[int, StallReport] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)  # per log interval
    mfu: list[float] = field(default_factory=list)
    peak_memory_gib: float = 0.0
    state_bytes_per_param: float = 0.0  # optimizer state of one replica / parameters


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to ``optim.lr``, then cosine decay to ``lr·min_lr_ratio`` at the end."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cosine)


def predicted_stalls(cfg: Config) -> dict[str, float]:
    """The theory's steady-state stalled fraction of each state: the block model for
    block-scaled formats (:mod:`srtrain.theory.blocks`), the plain model otherwise."""
    o = cfg.optim
    return {
        "m": block_stall_probability(o.m_format, o.beta1, o.m_rounding, "m", o.block_size),
        "v": block_stall_probability(o.v_format, o.beta2, o.v_rounding, "v", o.block_size),
    }


def state_bytes_per_param(
    optimizer: SRAdamW | TorchAdamW, model: torch.nn.Module, group: dist.ProcessGroup
) -> float:
    """Optimizer-state bytes summed over the shard group (one replica), per model parameter."""
    device = next(iter(model.parameters())).to_local().device
    total = torch.tensor([optimizer.state_bytes()], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=group)
    return int(total) / count_params(model)


def train_step(
    model, loader, micro_batches: int, device, *, reduce_every_micro_batch: bool = False
) -> tuple[torch.Tensor, int]:
    """Forward and backward over one step's micro-batches; the local mean loss and tokens.

    Gradients are reduce-scattered after the last micro-batch, or after every one with
    ``reduce_every_micro_batch`` (then they accumulate in the sharded gradients' dtype).
    """
    inputs, labels = next(loader)
    total = torch.zeros((), device=device)
    tokens = 0
    for i, (x, y) in enumerate(
        zip(inputs.chunk(micro_batches), labels.chunk(micro_batches), strict=True)
    ):
        model.set_requires_gradient_sync(reduce_every_micro_batch or i == micro_batches - 1)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / micro_batches
        loss.backward()
        total += loss.detach()
        tokens += y.numel()
    return total, tokens


@torch.no_grad()
def validate(model, val_loader: BatchLoader, batches: int, device) -> float:
    """Mean validation loss over ``batches`` fixed batches (a short split's windows, padding
    left out), across all ranks."""
    model.eval()
    total = torch.zeros(2, device=device)
    for x, y in val_loader.val_batches(batches):
        logits = model(input_ids=x.to(device)).logits
        y = y.to(device).flatten()
        total[0] += F.cross_entropy(
            logits.float().flatten(0, 1), y, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total[1] += (y != IGNORE_INDEX).sum()
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def run(cfg: Config) -> TrainResult:
    """Train as configured; returns the run's losses, resets and stall reports.

    The run owns ``train.run_dir`` while it trains (see srtrain.rundir_lock): another live
    job's run directory is refused with ConfigError, a dead job's is taken over. SIGTERM or
    SIGINT (in the main thread) ends it with :class:`~srtrain.stopping.RunStopped` once
    every rank has finished the step in flight and saved a checkpoint; a run that skipped
    more than ``train.max_skipped_fraction`` of its steps raises SkippedStepsError at the end.
    """
    with handling() as stop:
        stop.check()
        if cfg.parallel.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "parallel.device: 'cuda' asked for, but no CUDA device is available here; "
                "use parallel.device=auto (CUDA where there is one) or cpu"
            )
        info = init_distributed(None if cfg.parallel.device == "auto" else cfg.parallel.device)
        stop.rank = info.rank
        validate_world(cfg, info.world_size)
        agree(lambda: check_writable(cfg.train.run_dir), info.device)
        with own_run_dir(cfg.train.run_dir, info.rank, info.device) as owner:
            stop.on_exit = owner.release_before_exit
            try:
                return _train(cfg, info, owner, stop)
            except Exception as err:
                if stop.signum is None or isinstance(err, SkippedStepsError):
                    raise
                raise stop.failed(stop.signum, err) from err
            finally:
                stop.on_exit = None


def _train(cfg: Config, info: DistInfo, owner: Ownership, stop: StopSignals) -> TrainResult:
    """The training of :func:`run`, in a run directory this run owns; ``owner.check()``
    before every write; ``stop``: the signals that end it early (with a checkpoint)."""
    torch.manual_seed(cfg.train.seed)
    t = cfg.train
    run_dir = Path(t.run_dir)
    finished = finished_step(cfg)
    if finished is not None:  # nothing to train: say so and leave the run dir as it is
        if info.is_main:
            print_line(finished_message(run_dir, t.steps, finished))
        return TrainResult()
    meta = prepare_data(cfg, info)
    agree(lambda: check_before_training(cfg, meta), info.device)
    set_metas = agree(lambda: val_sets.check_val_sets(cfg, meta, info.local_rank == 0), info.device)
    built = build(cfg, info, *build_model(cfg, meta.vocab_size))
    loop = Loop(cfg, info, owner, built, set_metas)
    start = loop.resume()
    first_step = FirstStep(start + 1, loop.built.compiled, info.device)
    loop.logger.log_text(first_step.starting())
    stop_group = dist.new_group(backend="gloo") if info.world_size > 1 else None
    stopping, saved, step = None, None, start  # the signal the ranks agreed on; the last save
    stop.training()
    with loop.logger:
        for step in range(start + 1, t.steps + 1):
            grad_norm, log_step = loop.train_one(step)
            if step == first_step.step:
                loop.logger.log_text(first_step.finished())
            stopping = stop.agree(stop_group)  # a signal on any rank: log, save, stop
            records = loop.log(step, grad_norm) if log_step or stopping else None
            if validating(cfg) and (step % t.val_interval == 0 or step == t.steps):
                loop.validate(step)
            if records is not None:
                loop.history.write(records)
            interval = cfg.checkpoint.interval
            if (interval and step % interval == 0) or step == t.steps or stopping:
                saved = loop.save(step) or saved
            if stopping:
                break
    loop.close()
    if stop_group is not None:
        dist.destroy_process_group(stop_group)
    if stopping and step < t.steps:
        raise _stopped(stopping, step, saved)
    loop.logger.log_text(
        closing_line(
            run_dir,
            start,
            t.steps,
            loop.clock.elapsed(),
            latest(run_dir) if loop.checkpoints is not None else None,
        )
    )
    _check_skipped(loop.result, t.steps - start, t.max_skipped_fraction)
    return loop.result


def _stopped(signum: int, step: int, saved: Path | None) -> RunStopped:
    """The end of a run a signal stopped after ``step``, with or without a checkpoint."""
    name = signal_name(signum)
    if saved is None:
        return RunStopped(
            f"stopped by {name} after step {step}; checkpoint.enabled is false, so "
            "nothing was saved",
            signal_exit_code(signum),
        )
    return RunStopped(
        f"stopped by {name} after step {step}: saved {saved}; to resume, run the same "
        "command again",
        EXIT_SAVED,
    )


def _check_skipped(result: TrainResult, trained: int, max_fraction: float) -> None:
    """SkippedStepsError when more than ``max_fraction`` of the ``trained`` steps were
    skipped for a non-finite gradient norm."""
    skipped = len(result.skipped_steps)
    if trained > 0 and skipped > max_fraction * trained:
        raise SkippedStepsError(
            f"{skipped} of the {trained} steps trained were skipped for a non-finite gradient "
            f"norm ({skipped / trained:.0%}, over train.max_skipped_fraction="
            f"{max_fraction}): the model did not train as configured; lower "
            "optim.lr or check the data"
        )


def _json_float(value: float) -> float | None:
    """``value``, or None where JSON has no number for it (NaN, ±Inf)."""
    return value if math.isfinite(value) else None


class Loop:
    """A run in progress: its model and optimizer, data, resets, measurements and history.

    Built before step 1; :meth:`resume` loads the run's checkpoint and opens its directory,
    then the loop calls :meth:`train_one` each step and :meth:`log`, :meth:`validate` and
    :meth:`save` when they are due."""

    def __init__(
        self,
        cfg: Config,
        info: DistInfo,
        owner: Ownership,
        built: Built,
        set_metas: dict[str, DataMeta],
    ) -> None:
        self.cfg, self.info, self.owner, self.built = cfg, info, owner, built
        t, optimizer = cfg.train, built.optimizer
        self.params = built.params
        self.resets = schedule_from_config(cfg.resets, cfg.optim, info.device)
        self.aggregator = StallAggregator(
            built.labels,
            optimizer.local_numels(),
            info.device,
            optimizer.local_blocks() if isinstance(optimizer, SRAdamW) else None,
        )
        self.local_elements = sum(optimizer.local_numels())
        self.update_sizes = UpdateSizes(
            self.params, built.labels, [shard_offset(p) for p in self.params], info.device
        )
        self.predicted = predicted_stalls(cfg)
        self.loader, self.val_loader = agree(
            lambda: tuple(
                BatchLoader(
                    cfg.data.dir,
                    split,
                    t.global_batch_size,
                    cfg.model.seq_len,
                    info.rank,
                    info.world_size,
                    t.seed,
                )
                if split == "train" or validating(cfg)
                else None
                for split in ("train", "val")
            ),
            info.device,
        )
        self.val_set_loaders: dict[str, BatchLoader] = agree(  # train.val_sets
            lambda: {
                name: BatchLoader(
                    set_meta.data_dir,
                    "val",
                    t.global_batch_size,
                    cfg.model.seq_len,
                    info.rank,
                    info.world_size,
                    t.seed,
                )
                for name, set_meta in set_metas.items()
            },
            info.device,
        )
        per_rank = t.global_batch_size // info.world_size
        self.micro_batches = per_rank // t.micro_batch_size if t.micro_batch_size else 1
        peak = peak_flops(info.device, t.peak_flops or None)
        self.meter = ThroughputMeter(
            flops_per_token(built.model, cfg.model.seq_len), peak, info.world_size
        )
        self.grad_clip = cfg.optim.grad_clip or float("inf")
        # optim.step_in_backward: the step runs unit by unit inside backward
        self.in_backward = (
            StepInBackward(
                optimizer, fsdp_units(built.model), self.grad_clip, built.shards, info.device
            )
            if cfg.optim.step_in_backward
            else None
        )
        self.result = TrainResult()
        self.checkpoints: CheckpointManager | None = None
        self.logger: MetricsLogger
        self.history: History
        self.clock: RunClock
        self.lr = 0.0

    def resume(self) -> int:
        """Load the checkpoint the run continues from (if any), open the run dir and write
        the run's first lines; the step training starts after."""
        cfg, info, built = self.cfg, self.info, self.built
        run_dir = Path(cfg.train.run_dir)
        for loader in (self.val_loader, *self.val_set_loaders.values()):
            notice = loader.val_notice() if loader is not None else None
            if notice and info.is_main:
                print_line(notice)
        fallbacks: list[str] = []
        start, extra, origin = resume(cfg, run_dir, built.model, built.optimizer, fallbacks.append)
        if extra is not None:
            self.loader.load_state_dict(extra["loader"])
            clip_norm = extra.get(CLIP_NORM_KEY)
            if self.in_backward is not None and isinstance(clip_norm, (int, float)):
                self.in_backward.previous_norm = float(clip_norm)
            self.resets.load_state_dict(
                extra["resets"], holds_window=dist.get_rank(built.shards) == 0
            )
        self.checkpoints, self.logger = open_run_dir(cfg, info, run_dir, start, extra is not None)
        self.history = History(
            self.logger, run_dir, info.is_main, self.owner.check, cfg.train.steps
        )
        for line in (
            first_line(cfg, info, built, self.resets),
            setup_line(cfg, built),
            built.compile_notice,
            *fallbacks,
            origin or (f"initialised from {cfg.model.init_from}" if cfg.model.init_from else None),
        ):
            if line:
                self.logger.log_text(line)
        self.clock = RunClock(start, cfg.train.steps)
        return start

    def train_one(self, step: int) -> tuple[torch.Tensor, bool]:
        """Forward, backward, clipping and the optimizer step (skipped for a non-finite
        gradient norm; with ``optim.step_in_backward``, taken inside backward unit by unit,
        skipping the units whose gradient is non-finite) with its resets; the gradient norm
        and whether ``step`` logs."""
        cfg, optimizer, resets = self.cfg, self.built.optimizer, self.resets
        self.lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        log_step = step % cfg.train.log_interval == 0 or step == cfg.train.steps
        measure = log_step or min(resets.ages.values()) < UPDATE_WATCH_STEPS
        in_backward = self.in_backward
        if in_backward is not None:  # the parameters change during backward
            if measure:
                self.update_sizes.before_step()
            optimizer.count_health = log_step
            in_backward.begin()
        loss, tokens = train_step(
            self.built.model,
            self.loader,
            self.micro_batches,
            self.info.device,
            reduce_every_micro_batch=cfg.parallel.reduce_every_micro_batch,
        )
        if in_backward is not None:
            done = in_backward.finish()
            grad_norm = done.grad_norm
            stepped = len(done.skipped_units) < len(in_backward.units)
            if done.skipped_units and stepped:
                self.result.skipped_steps.append(step)
                self.logger.log_text(
                    f"step {step}: non-finite gradient in {len(done.skipped_units)} of "
                    f"{len(in_backward.units)} units; their update skipped"
                )
        else:
            grad_norm = clip_grad_norm_(self.params, self.grad_clip, self.built.shards)
            optimizer.prepare_step()  # host work overlapping the GPU until the check below
            if measure:
                self.update_sizes.before_step()
            stepped = bool(torch.isfinite(grad_norm))
            if stepped:
                if optimizer.counts_stalls:  # the health counts are those of the log steps
                    optimizer.count_health = log_step
                optimizer.step()
        if stepped:
            if measure:
                self.update_sizes.after_step(step, self.update_sizes.hyperparameters(optimizer))
            if optimizer.counts_stalls:
                taken = optimizer.take_stall_counts()
                self.aggregator.accumulate(*taken)
                resets.observe(taken.counts, self.local_elements)
            due = resets.after_step(step, self.built.shards)
            for state in due:
                optimizer.reset(state)
            if due:
                self.logger.log_reset(step, due)
                self.result.resets[step] = due
        else:
            if in_backward is not None:
                optimizer.take_stall_counts()  # a step that updated nothing counts nothing
            self.aggregator.note_skipped_step()
            self.result.skipped_steps.append(step)
            self.logger.log_text(f"step {step}: non-finite gradient norm, step skipped")
        optimizer.zero_grad(set_to_none=True)
        self.meter.update(tokens * self.info.world_size)
        self.history.add_loss(step, loss)
        return grad_norm, log_step

    def log(self, step: int, grad_norm: torch.Tensor) -> list[dict]:
        """A log step: the pending steps' records (written after validation), TensorBoard
        and the console; the measurements of the interval go into the result."""
        built, result, shards = self.built, self.result, self.built.shards
        optimizer = built.optimizer
        records = self.history.take_losses()
        result.losses.extend(record["loss"] for record in records)
        sizes = self.update_sizes.take(shards)
        self.logger.log_update_sizes(sizes)
        for record in records:
            if record["step"] in sizes:
                record["update_rms"] = sizes[record["step"]].get("all", 0.0)
        tokens_per_s, mfu = self.meter.measure()
        memory, _ = peak_memory_gib(self.info.device)
        result.tokens_per_s.append(tokens_per_s)
        result.mfu.append(mfu)
        result.peak_memory_gib = memory
        if not result.state_bytes_per_param:
            result.state_bytes_per_param = state_bytes_per_param(optimizer, built.model, shards)
            self.logger.log_text(
                f"optimizer state: {result.state_bytes_per_param:.4f} bytes per parameter"
            )
        report = self.aggregator.reduce(shards) if optimizer.counts_stalls else None
        last = records[-1]
        last.update(grad_norm=float(grad_norm), lr=self.lr)
        if report is not None:
            result.stall_reports[step] = report
            last.update(
                stall_m=report.stalled["m"],
                stall_v=report.stalled["v"],
                param_changed=report.param_changed,
                **{record_key(tag): v for tag, v in report.state_counts.items()},
            )
        sums = optimizer.shadow_sums() if isinstance(optimizer, SRAdamW) else None
        if sums is not None:
            drift = shadow.report(sums, built.labels, shards)
            self.logger.log_shadow(step, drift)
            last.update({f"shadow_{k}": v for k, v in drift.get("all", {}).items()})
        scalars = {
            TAG_LOSS: last["loss"],
            TAG_LR: self.lr,
            TAG_GRAD_NORM: float(grad_norm),
            TAG_TOKENS_PER_S: tokens_per_s,
            TAG_MFU: mfu,
            TAG_MEMORY: memory,
        }
        self.logger.log_step(step, scalars, report, self.predicted, self.clock.progress(step))
        return records

    def validate(self, step: int) -> None:
        """The validation losses of ``step`` (the run's data and each of ``train.val_sets``),
        into the result and the history."""
        model, batches, device = self.built.model, self.cfg.train.val_batches, self.info.device
        value = validate(model, self.val_loader, batches, device)
        sets = {
            name: validate(model, loader, batches, device)
            for name, loader in self.val_set_loaders.items()
        }
        self.result.val_losses[step] = value
        for name, loss in sets.items():
            self.result.val_set_losses.setdefault(name, {})[step] = loss
        self.history.add_validation(
            step,
            {TAG_VAL_LOSS: value, **{val_sets.tag(n): v for n, v in sets.items()}},
            {val_sets.RECORD_KEY: value, **{val_sets.record_key(n): v for n, v in sets.items()}},
        )

    def save(self, step: int) -> Path | None:
        """A checkpoint of ``step`` (None when the run keeps none)."""
        if self.checkpoints is None:
            return None
        fault_point("checkpoint")
        self.owner.check()
        return self.checkpoints.save(
            step,
            self.built.model,
            self.built.optimizer,
            {
                "step": step,
                "loader": self.loader.state_dict(),
                "resets": self.resets.state_dict(self.built.shards),
                "config": self.cfg.to_dict(),
                **(
                    {CLIP_NORM_KEY: _json_float(self.in_backward.previous_norm)}
                    if self.in_backward is not None
                    else {}
                ),
            },
        )

    def close(self) -> None:
        """Wait for the last checkpoint to be written."""
        if self.checkpoints is not None:
            self.checkpoints.close()
