"""The training loop, and nothing else: data → model → loss → clip → SRAdamW → resets → metrics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from srtrain import val_sets
from srtrain.build import Built, build, build_model
from srtrain.checkpoint import (
    CheckpointManager,
    checkpoint_step,
    finished_step,
    latest,
    load,
    load_latest_valid,
    resolve_checkpoint,
)
from srtrain.config import AUTO, Config, ConfigError, data_source, dump_config, validate_world
from srtrain.console import (
    RunClock,
    Ticker,
    closing_line,
    print_line,
)
from srtrain.data import (
    IGNORE_INDEX,
    META_FILE,
    BatchLoader,
    DataMeta,
    ensure_prepared,
    load_meta,
)
from srtrain.data_check import check_model_vocabulary, verify_data
from srtrain.errors import SkippedStepsError, agree
from srtrain.faultpoints import fault_point
from srtrain.metrics import (
    MEMORY_CUDA,
    MEMORY_MAXRSS,
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
    trim_records,
)
from srtrain.models import (
    count_params,
    flops_per_token,
    read_hf_config,
)
from srtrain.nospace import no_space, out_of_space
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
from srtrain.record import History
from srtrain.rundir import CONFIG_FILE, check_writable, finished_message
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


def prepare_data(cfg: Config, info: DistInfo) -> DataMeta:
    """Token data on every node: local rank 0 prepares it if missing (printing its progress)
    and verifies its shards, the others wait (a failure on any rank raises on every rank).

    A prepared dir is used as it is: a differing max_bytes, val_fraction or source is one
    notice line from rank 0, a differing ``data.vocab_size`` is refused (without it the dir's
    vocabulary is taken). A missing dir is prepared only from the source
    :func:`~srtrain.config.data_source` names; with none, ConfigError.
    """
    source = data_source(cfg.data)
    kwargs = dict(val_fraction=cfg.data.val_fraction)
    for key in ("vocab_size", "max_bytes"):
        if getattr(cfg.data, key) is not None:
            kwargs[key] = getattr(cfg.data, key)

    def prepare_and_verify() -> None:
        if info.local_rank == 0:
            path = Path(cfg.data.dir)
            if not source and not (path / META_FILE).is_file():
                state = "does not exist" if not path.exists() else "holds no prepared data"
                raise ConfigError(
                    f"data.dir {cfg.data.dir} {state}; set data.source to prepare it there "
                    "(builtin, packages, a Hugging Face dataset or files), or fix the path"
                )
            ensure_prepared(
                cfg.data.dir,
                source,
                progress=Ticker(print_line),
                notice=print_line if info.is_main else None,
                **kwargs,
            )
            verify_data(load_meta(cfg.data.dir), fallback_dir=cfg.train.run_dir)

    agree(prepare_and_verify, info.device)
    return agree(lambda: load_meta(cfg.data.dir), info.device)


def validating(cfg: Config) -> bool:
    """Whether the run validates (``train.val_interval`` and ``train.val_batches`` both set)."""
    return bool(cfg.train.val_interval and cfg.train.val_batches)


def check_before_training(cfg: Config, meta: DataMeta) -> None:
    """What could otherwise stop a run only at a validation, a save or its end, checked
    before it starts (ConfigError, one line): every split it reads holds a window of
    ``model.seq_len`` tokens, the data's tokenizer fits ``model.init_from`` (DataError),
    and a ``checkpoint.load`` that seeds the run (before its first checkpoint of its own)
    leaves steps to train."""
    if cfg.model.init_from:
        try:
            config = read_hf_config(cfg.model.init_from)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from None
        check_model_vocabulary(meta, config, cfg.model.init_from)
    seq_len = cfg.model.seq_len
    for split in ("train", "val") if validating(cfg) else ("train",):
        tokens = meta.splits[split].num_tokens if split in meta.splits else 0
        if tokens > seq_len:
            continue
        fix = (
            "lower model.seq_len, prepare the data again with a larger data.val_fraction "
            f"(delete {cfg.data.dir} or choose another data.dir), or set train.val_interval=0"
            if split == "val"
            else "lower model.seq_len or prepare more text (data.max_bytes)"
        )
        raise ConfigError(
            f"split {split!r} of {cfg.data.dir} has {tokens} tokens, not one window of "
            f"model.seq_len={seq_len} (it needs {seq_len + 1}); {fix}"
        )
    own = cfg.checkpoint.enabled and latest(cfg.train.run_dir) is not None
    if cfg.checkpoint.load and not own:  # it seeds the run (see resume)
        path = resolve_checkpoint(cfg.checkpoint.load)
        step = checkpoint_step(path)
        if step >= cfg.train.steps:
            raise ConfigError(
                f"checkpoint.load: {path} is at step {step}, which leaves nothing of "
                f"train.steps={cfg.train.steps} to train; set train.steps above {step}"
            )


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


# The trainer state a checkpoint's ``extra`` carries: section → key → type of its value.
TRAINER_STATE: dict[str, dict[str, type]] = {
    "loader": {"split": str, "seed": int, "seq_len": int, "num_windows": int, "position": int},
    "resets": dict.fromkeys(
        ("age_m", "age_v", "window_m", "window_v", "window_elements", "window_steps"), int
    ),
}


# extra's key for the norm the next step inside backward clips by (None before the first)
CLIP_NORM_KEY = "clip_norm"


def _json_float(value: float) -> float | None:
    """``value``, or None where JSON has no number for it (NaN, ±Inf)."""
    return value if math.isfinite(value) else None


def trainer_state_problem(extra: dict) -> str | None:
    """What keeps a checkpoint's ``extra`` from restoring the trainer (the first section or
    key missing or of the wrong type, e.g. ``loader.position of type str``); None if it can."""
    for section, keys in TRAINER_STATE.items():
        saved = extra.get(section)
        if not isinstance(saved, dict):
            return f"{section} missing" if saved is None else f"{section} malformed"
        for key, kind in keys.items():
            value = saved.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                what = "missing" if value is None else f"of type {type(value).__name__}"
                return f"{section}.{key} {what}"
    return None


def resume(
    cfg: Config, run_dir: Path, model, optimizer, log: Callable[[str], None]
) -> tuple[int, dict | None, str | None]:
    """Step and trainer state to continue from, and the line saying which and why.

    The run dir's own newest usable checkpoint wins (``log`` receives a line for each
    corrupt one passed over, on rank 0); ``checkpoint.load`` seeds the run only while its
    run dir has no usable checkpoint; else the run starts afresh (no line)."""
    seed = cfg.checkpoint.load
    if cfg.checkpoint.enabled:
        instead = f"starting from checkpoint.load={seed} instead" if seed else None
        found = load_latest_valid(
            run_dir, model, optimizer, log=log, otherwise=instead, check_extra=trainer_state_problem
        )
        if found is not None:
            step, extra = found
            ignored = (
                f" (its own newest checkpoint: checkpoint.load={seed} seeds a run only before "
                "its first checkpoint)"
                if seed
                else ""
            )
            return step, extra, f"resumed from step {step} of {run_dir}{ignored}"
    if not seed:
        return 0, None, None
    path = resolve_checkpoint(seed)
    step = checkpoint_step(path)
    why = (
        f"{run_dir} has no usable checkpoint of its own yet"
        if cfg.checkpoint.enabled
        else "checkpoint.enabled is false, so the run keeps none of its own"
    )
    extra = load(path, model, optimizer, check_extra=trainer_state_problem)
    return step, extra, f"started from {path} (step {step}): {why}"


def open_run_dir(
    cfg: Config, info: DistInfo, run_dir: Path, start: int, resumed: bool
) -> tuple[CheckpointManager | None, MetricsLogger]:
    """The run dir's first writes, once every check has passed (every rank calls it; a
    failure on any rank raises on every rank): the checkpoint manager, and on rank 0
    ``config.yaml``, ``metrics.jsonl`` cut back to ``start`` (emptied for a run starting
    afresh, atomically: see :func:`trim_records`) and the TensorBoard writer, which hides
    the events of steps after ``start`` too. ``resumed``: whether a checkpoint was loaded."""

    def open_all() -> tuple[CheckpointManager | None, MetricsLogger]:
        checkpoints = (
            CheckpointManager(
                run_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save, data_dir=cfg.data.dir
            )
            if cfg.checkpoint.enabled
            else None
        )
        if info.is_main:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                dump_config(cfg, run_dir / CONFIG_FILE)
            except OSError as err:
                if out_of_space(err):
                    raise no_space(run_dir) from None
                raise
            trim_records(run_dir, start if resumed else 0, log=print_line)
        memory_source = MEMORY_CUDA if info.device.type == "cuda" else MEMORY_MAXRSS
        logger = MetricsLogger(
            run_dir, info.rank, memory_source=memory_source, purge_step=start + 1
        )
        return checkpoints, logger

    return agree(open_all, info.device)


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
