"""The training loop, and nothing else: data → model → loss → clip → SRAdamW → resets → metrics."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PretrainedConfig

from srtrain.checkpoint import (
    CheckpointManager,
    checkpoint_step,
    latest,
    load,
    load_latest_valid,
    resolve_checkpoint,
)
from srtrain.config import AUTO, Config, ConfigError, data_source, dump_config, validate_world
from srtrain.console import (
    RunClock,
    StepProgress,
    Ticker,
    closing_line,
    finished_message,
    finished_step,
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
from srtrain.data_check import verify_data
from srtrain.errors import SkippedStepsError, agree, check_run_dir
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
    append_records,
    peak_flops,
    peak_memory_gib,
    record_key,
    trim_records,
)
from srtrain.models import (
    build_model_from_config,
    count_params,
    flops_per_token,
    init_weights,
    no_decay,
    param_group_of,
    resolve_model_config,
)
from srtrain.nospace import no_space, out_of_space
from srtrain.optim import SRAdamW, TorchAdamW, shadow
from srtrain.optim.resets import schedule_from_config
from srtrain.optim.sradamw import shard_offset
from srtrain.optim.update_size import UpdateSizes
from srtrain.parallel import (
    DistInfo,
    apply_fsdp,
    clip_grad_norm_,
    compile_choice,
    compute_dtype,
    device_mesh,
    init_distributed,
    shard_group,
)
from srtrain.plan import GIB, checkpointing_fits, plan_run
from srtrain.pretrained import load_pretrained
from srtrain.rundir_lock import Ownership, own_run_dir
from srtrain.stopping import (
    EXIT_SAVED,
    RunStopped,
    StopSignals,
    handling,
    signal_exit_code,
    signal_name,
)
from srtrain.theory_blocks import block_stall_probability

# After a reset (and at the start of training) the applied update's size is measured every
# step for this many steps of the youngest state's age, to show the burst and its fading;
# otherwise at log steps.
UPDATE_WATCH_STEPS = 50


@dataclass
class TrainResult:
    """What a finished run reports back (rank 0 has the global values)."""

    losses: list[float] = field(default_factory=list)  # global mean loss per step
    val_losses: dict[int, float] = field(default_factory=dict)
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
    ``model.seq_len`` tokens, and a ``checkpoint.load`` that seeds the run (before its
    first checkpoint of its own) leaves steps to train."""
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
    return f"m {o.m_format}/{o.m_rounding}, v {o.v_format}/{o.v_rounding}, resets {cfg.resets.mode}"


def describe_model(cfg: Config, model: torch.nn.Module) -> str:
    """The model in the run's first log line: where its shape comes from and its size."""
    m = cfg.model
    source = m.hf_config or m.init_from or m.preset
    return f"{source} ({count_params(model) / 1e6:,.1f}M parameters)"


def predicted_stalls(cfg: Config) -> dict[str, float]:
    """The theory's steady-state stalled fraction of each state: the block model for
    block-scaled formats (:mod:`srtrain.theory_blocks`), the plain model otherwise."""
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
                dump_config(cfg, run_dir / "config.yaml")
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


def _mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    values = values.clone()
    dist.all_reduce(values)
    return values / dist.get_world_size()


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
        agree(lambda: check_run_dir(Path(cfg.train.run_dir)), info.device)
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
    run_dir = Path(cfg.train.run_dir)
    finished = finished_step(cfg)
    if finished is not None:  # nothing to train: say so and leave the run dir as it is
        if info.is_main:
            print_line(finished_message(run_dir, cfg.train.steps, finished))
        return TrainResult()
    meta = prepare_data(cfg, info)
    agree(lambda: check_before_training(cfg, meta), info.device)

    mesh = device_mesh(info, cfg.parallel.replicas)
    shards = shard_group(mesh)  # sums over shards: one replica's ranks
    try:
        model_config = resolve_model_config(cfg.model, meta.vocab_size)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    model = build_model_from_config(model_config)
    compute = compute_dtype(cfg.parallel.compute_dtype, info.device)
    compiled, compile_notice = compile_choice(cfg.parallel.compile, info.device)
    checkpointed, checkpointing_why = checkpointing_choice(cfg, info, model_config)
    apply_fsdp(
        model,
        mesh,
        param_dtype=compute,
        reduce_dtype=torch.float32,
        bf16_params=cfg.parallel.bf16_params,
        activation_checkpointing=checkpointed,
        compile_blocks=compiled,
    )
    model.to_empty(device=info.device)
    if cfg.model.init_from:
        load_pretrained(model, cfg.model.init_from)
    else:
        init_weights(model, cfg.train.seed)
    optimizer, labels = build_optimizer(model, cfg)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    resets = schedule_from_config(cfg.resets, cfg.optim, info.device)
    aggregator = StallAggregator(
        labels,
        optimizer.local_numels(),
        info.device,
        optimizer.local_blocks() if isinstance(optimizer, SRAdamW) else None,
    )
    local_elements = sum(optimizer.local_numels())
    update_sizes = UpdateSizes(params, labels, [shard_offset(p) for p in params], info.device)
    predicted = predicted_stalls(cfg)

    t = cfg.train
    loader, val_loader = agree(
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
    val_notice = val_loader.val_notice() if val_loader is not None else None
    if val_notice and info.is_main:
        print_line(val_notice)
    per_rank = t.global_batch_size // info.world_size
    micro_batches = per_rank // t.micro_batch_size if t.micro_batch_size else 1
    peak = peak_flops(info.device, t.peak_flops or None)
    meter = ThroughputMeter(flops_per_token(model, cfg.model.seq_len), peak, info.world_size)
    fallbacks: list[str] = []
    start, extra, origin = resume(cfg, run_dir, model, optimizer, fallbacks.append)
    if extra is not None:
        loader.load_state_dict(extra["loader"])
        resets.load_state_dict(extra["resets"], holds_window=dist.get_rank(shards) == 0)
    checkpoints, logger = open_run_dir(cfg, info, run_dir, start, extra is not None)
    logger.log_text(
        f"srtrain: {describe_model(cfg, model)} on {info.world_size}×{info.device.type} "
        + (
            f"(HSDP: {cfg.parallel.replicas} replicas of "
            f"{info.world_size // cfg.parallel.replicas} shards) "
            if mesh.ndim == 2
            else ""
        )
        + f"({info.backend}, {str(compute).removeprefix('torch.')} compute), "
        + describe_optimizer(optimizer, cfg)
        + (
            f" (periods m {resets.periods['m']}, v {resets.periods['v']})"
            if cfg.resets.mode in ("periodic", "theory")
            else ""
        )
    )
    logger.log_text(
        f"setup: blocks {'compiled' if compiled else 'eager'}"
        + (" (parallel.compile auto)" if cfg.parallel.compile == AUTO else "")
        + f", activation checkpointing {'on' if checkpointed else 'off'}{checkpointing_why}"
    )
    if compile_notice:
        logger.log_text(compile_notice)
    for line in fallbacks:
        logger.log_text(line)
    if origin:
        logger.log_text(origin)
    elif cfg.model.init_from:
        logger.log_text(f"initialised from {cfg.model.init_from}")

    result = TrainResult()
    pending_losses: list[torch.Tensor] = []
    pending_steps: list[int] = []
    grad_clip = cfg.optim.grad_clip or float("inf")
    clock = RunClock(start, t.steps)
    val_pending: dict[int, float] = {}  # validation losses of steps whose records are pending
    first_step = FirstStep(start + 1, compiled, info.device)
    logger.log_text(first_step.starting())
    stop_group = dist.new_group(backend="gloo") if info.world_size > 1 else None
    stopping, saved = None, None  # the signal the ranks agreed to stop on; the last save
    stop.training()
    with logger:
        for step in range(start + 1, t.steps + 1):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, tokens = train_step(
                model,
                loader,
                micro_batches,
                info.device,
                reduce_every_micro_batch=cfg.parallel.reduce_every_micro_batch,
            )
            grad_norm = clip_grad_norm_(params, grad_clip, shards)
            optimizer.prepare_step()  # host work overlapping the GPU until the check below
            log_step = step % t.log_interval == 0 or step == t.steps
            measure = log_step or min(resets.ages.values()) < UPDATE_WATCH_STEPS
            if measure:
                update_sizes.before_step()
            if torch.isfinite(grad_norm):
                if optimizer.counts_stalls:  # the health counts are those of the log steps
                    optimizer.count_health = log_step
                optimizer.step()
                if measure:
                    update_sizes.after_step(step, update_sizes.hyperparameters(optimizer))
                if optimizer.counts_stalls:
                    taken = optimizer.take_stall_counts()
                    aggregator.accumulate(*taken)
                    resets.observe(taken.counts, local_elements)
                due = resets.after_step(step, shards)
                for state in due:
                    optimizer.reset(state)
                if due:
                    logger.log_reset(step, due)
                    result.resets[step] = due
            else:
                aggregator.note_skipped_step()
                result.skipped_steps.append(step)
                logger.log_text(f"step {step}: non-finite gradient norm, step skipped")
            optimizer.zero_grad(set_to_none=True)
            if step == first_step.step:
                logger.log_text(first_step.finished())
            meter.update(tokens * info.world_size)
            pending_losses.append(loss)
            pending_steps.append(step)
            stopping = stop.agree(stop_group)  # a signal on any rank: log, save, stop

            records: list[dict] | None = None
            if log_step or stopping:
                losses = _mean_over_ranks(torch.stack(pending_losses)).tolist()
                result.losses.extend(losses)
                records = [
                    {"step": s, "loss": v} for s, v in zip(pending_steps, losses, strict=True)
                ]
                sizes = update_sizes.take(shards)
                logger.log_update_sizes(sizes)
                for record in records:
                    if record["step"] in sizes:
                        record["update_rms"] = sizes[record["step"]].get("all", 0.0)
                pending_losses, pending_steps = [], []
                tokens_per_s, mfu = meter.measure()
                memory, _ = peak_memory_gib(info.device)
                result.tokens_per_s.append(tokens_per_s)
                result.mfu.append(mfu)
                result.peak_memory_gib = memory
                if not result.state_bytes_per_param:
                    result.state_bytes_per_param = state_bytes_per_param(optimizer, model, shards)
                    logger.log_text(
                        f"optimizer state: {result.state_bytes_per_param:.4f} bytes per parameter"
                    )
                report = aggregator.reduce(shards) if optimizer.counts_stalls else None
                records[-1].update(grad_norm=float(grad_norm), lr=lr)
                if report is not None:
                    result.stall_reports[step] = report
                    records[-1].update(
                        stall_m=report.stalled["m"],
                        stall_v=report.stalled["v"],
                        param_changed=report.param_changed,
                        **{record_key(tag): v for tag, v in report.state_counts.items()},
                    )
                sums = optimizer.shadow_sums() if isinstance(optimizer, SRAdamW) else None
                if sums is not None:
                    drift = shadow.report(sums, labels, shards)
                    logger.log_shadow(step, drift)
                    records[-1].update({f"shadow_{k}": v for k, v in drift.get("all", {}).items()})
                scalars = {
                    TAG_LOSS: losses[-1],
                    TAG_LR: lr,
                    TAG_GRAD_NORM: float(grad_norm),
                    TAG_TOKENS_PER_S: tokens_per_s,
                    TAG_MFU: mfu,
                    TAG_MEMORY: memory,
                }
                logger.log_step(step, scalars, report, predicted, clock.progress(step))
            if validating(cfg) and (step % t.val_interval == 0 or step == t.steps):
                val = validate(model, val_loader, t.val_batches, info.device)
                owner.check()
                result.val_losses[step] = val
                val_pending[step] = val
                logger.log_step(step, {TAG_VAL_LOSS: val}, progress=StepProgress(t.steps))
            if records is not None:
                for record in records:
                    if record["step"] in val_pending:
                        record["val_loss"] = val_pending.pop(record["step"])
                owner.check()
                if info.is_main:
                    append_records(run_dir, records)
            interval = cfg.checkpoint.interval
            save_now = (interval and step % interval == 0) or step == t.steps or stopping
            if checkpoints is not None and save_now:
                fault_point("checkpoint")
                owner.check()
                saved = checkpoints.save(
                    step,
                    model,
                    optimizer,
                    {
                        "step": step,
                        "loader": loader.state_dict(),
                        "resets": resets.state_dict(shards),
                        "config": cfg.to_dict(),
                    },
                )
            if stopping:
                break
    if checkpoints is not None:
        checkpoints.close()
    if stop_group is not None:
        dist.destroy_process_group(stop_group)
    if stopping and step < t.steps:
        name = signal_name(stopping)
        if saved is None:
            raise RunStopped(
                f"stopped by {name} after step {step}; checkpoint.enabled is false, so "
                "nothing was saved",
                signal_exit_code(stopping),
            )
        raise RunStopped(
            f"stopped by {name} after step {step}: saved {saved}; to resume, run the same "
            "command again",
            EXIT_SAVED,
        )
    logger.log_text(
        closing_line(
            run_dir,
            start,
            t.steps,
            clock.elapsed(),
            latest(run_dir) if checkpoints is not None else None,
        )
    )
    skipped, trained = len(result.skipped_steps), t.steps - start
    if trained > 0 and skipped > t.max_skipped_fraction * trained:
        raise SkippedStepsError(
            f"{skipped} of the {trained} steps trained were skipped for a non-finite gradient "
            f"norm ({skipped / trained:.0%}, over train.max_skipped_fraction="
            f"{t.max_skipped_fraction}): the model did not train as configured; lower "
            "optim.lr or check the data"
        )
    return result
