"""Training metrics: cross-rank stall aggregation, throughput/MFU, console lines, TensorBoard.

The fused optimizer counts, per parameter shard, per step, the things of ``COUNT_COLUMNS``
(:data:`srtrain.numerics.adamw.NUM_COUNTS`, in that order): the stall counts on every step,
the health counts (from :data:`~srtrain.numerics.adamw.NUM_STALL_COUNTS` on) on the steps
that ask for them (:attr:`srtrain.optim.SRAdamW.count_health`). :class:`StallAggregator`
sums them on the device between log steps and turns them into fractions of element-steps
(of block-steps for scale changes) over the steps that counted them, with one all-reduce,
so every rank gets the same :class:`StallReport` (usable for adaptive reset decisions).
:class:`MetricsLogger` prints one line per log step and writes TensorBoard scalars, both on
rank 0 only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from srtrain.console import StepProgress
from srtrain.faultpoints import fault_point
from srtrain.nospace import no_space, out_of_space
from srtrain.numerics.adamw import (
    COUNT_M_SATURATED,
    COUNT_M_SCALE_CHANGED,
    COUNT_M_UNDERFLOW,
    COUNT_V_SATURATED,
    COUNT_V_SCALE_CHANGED,
    COUNT_V_UNDERFLOW,
    NUM_COUNTS,
)
from srtrain.param_groups import GROUPS
from srtrain.rundir import METRICS_FILE, TB_DIR

STATES = ("m", "v")
COUNT_COLUMNS = (
    "m_stalled",
    "v_stalled",
    "param_changed",
    "nonfinite_grad",
    "m_underflow",
    "v_underflow",
    "m_saturated",
    "v_saturated",
    "m_scale_changed",
    "v_scale_changed",
)
# The health counts reported as fractions under their own tags (``<tag>`` over all
# elements, ``<tag>/<group>`` per layer group): tag → count column. underflow and saturated
# are fractions of element-steps; scale_changed of the state's block-steps, reported only
# for a state that has blocks (a block-scaled format) and per group where the group has some;
# the steps are those that counted the health counts, and none of them is reported where
# there were none.
STATE_COUNT_TAGS = {
    "underflow/m": COUNT_M_UNDERFLOW,
    "underflow/v": COUNT_V_UNDERFLOW,
    "saturated/m": COUNT_M_SATURATED,
    "saturated/v": COUNT_V_SATURATED,
    "scale_changed/m": COUNT_M_SCALE_CHANGED,
    "scale_changed/v": COUNT_V_SCALE_CHANGED,
}
# of the sizes' columns (element-steps, then over the health steps: element-steps, m and v
# block-steps)
_HEALTH_SIZE_COLUMN = {COUNT_M_SCALE_CHANGED: 2, COUNT_V_SCALE_CHANGED: 3}
_HEALTH_ELEMENT_STEPS = 1

TAG_LOSS = "loss/train"
TAG_VAL_LOSS = "loss/val"
TAG_LR = "lr"
TAG_GRAD_NORM = "grad_norm"
TAG_TOKENS_PER_S = "throughput/tokens_per_s"
TAG_MFU = "mfu"
TAG_MEMORY = "memory/max_allocated_gib"
TAG_UPDATE_RMS = "update/rms"
# The FP32 shadow's comparisons (srtrain.optim.shadow.METRICS) and their tags.
SHADOW_TAGS = {
    "rel_err_m": "shadow/rel_err/m",
    "rel_err_v": "shadow/rel_err/v",
    "bias_m": "shadow/bias/m",
    "bias_v": "shadow/bias/v",
    "update_cosine": "shadow/update_cosine",
}

MEMORY_CUDA = "max_allocated"
MEMORY_MAXRSS = "maxrss"

# Dense BF16 peak FLOP/s per GPU, matched as substrings of the CUDA device name, most
# specific first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
)

GIB = 2**30


@dataclass(frozen=True)
class StallReport:
    """Global stall statistics over the steps since the previous report (same on every rank).

    Fractions are counts divided by element-steps (elements × steps), NaN where there were
    none; groups without elements on any rank are left out of the per-group dicts.
    ``state_counts`` holds the fractions of :data:`STATE_COUNT_TAGS` by tag over the
    ``health_steps`` steps that counted them (scale changes: of block-steps, and only for
    states with blocks; empty without such steps), ``state_counts_by_group`` the same per
    group (scale changes: groups with blocks).
    """

    steps: int
    element_steps: int
    stalled: dict[str, float]
    stalled_by_group: dict[str, dict[str, float]]
    param_changed: float
    param_changed_by_group: dict[str, float]
    nonfinite_grad_elements: int
    skipped_steps: int
    state_counts: dict[str, float] = field(default_factory=dict)
    state_counts_by_group: dict[str, dict[str, float]] = field(default_factory=dict)
    health_steps: int = 0


def _fraction(count: int, total: int) -> float:
    """count / total as a float64, NaN for an empty total."""
    return count / total if total > 0 else math.nan


class StallAggregator:
    """Sums the optimizer's per-parameter counts on the device and reduces them per group."""

    def __init__(
        self,
        groups: Sequence[str],
        local_numels: Sequence[int],
        device: torch.device | str,
        local_blocks: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """``local_blocks``: each parameter's (m, v) block count on this rank (0 for an
        unscaled state; None: no blocks), the denominators of the scale changes."""
        if len(groups) != len(local_numels):
            raise ValueError(
                f"StallAggregator: {len(groups)} group labels but {len(local_numels)} "
                "local element counts; give one of each per parameter"
            )
        if local_blocks is not None and len(local_blocks) != len(groups):
            raise ValueError(
                f"StallAggregator: {len(groups)} group labels but {len(local_blocks)} "
                "local block counts; give one (m, v) pair per parameter"
            )
        for label in groups:
            if label not in GROUPS:
                raise ValueError(f"StallAggregator: group {label!r} is not one of {GROUPS}")
        self.num_params = len(groups)
        self.device = torch.device(device)
        self._group_index = torch.tensor(
            [GROUPS.index(label) for label in groups], dtype=torch.int64, device=self.device
        )
        self._group_numel = [0] * len(GROUPS)
        self._group_blocks = [[0, 0] for _ in GROUPS]
        blocks = local_blocks if local_blocks is not None else [(0, 0)] * len(groups)
        for label, numel, (m_blocks, v_blocks) in zip(groups, local_numels, blocks, strict=True):
            index = GROUPS.index(label)
            self._group_numel[index] += int(numel)
            self._group_blocks[index][0] += int(m_blocks)
            self._group_blocks[index][1] += int(v_blocks)
        self._counts = torch.zeros(
            self.num_params, NUM_COUNTS, dtype=torch.int64, device=self.device
        )
        self._steps = 0
        self._health_steps = 0
        self._skipped = 0

    def accumulate(
        self, counts: torch.Tensor, steps: int = 1, health_steps: int | None = None
    ) -> None:
        """Add int64 counts of shape [num_params, NUM_COUNTS] that cover ``steps`` optimizer
        steps, ``health_steps`` of which counted the health counts (None: all of them; see
        :class:`~srtrain.optim.sradamw.StallCounts`)."""
        if counts.shape != (self.num_params, NUM_COUNTS) or counts.dtype != torch.int64:
            raise ValueError(
                f"StallAggregator.accumulate: counts has shape {tuple(counts.shape)} and dtype "
                f"{counts.dtype}; expected ({self.num_params}, {NUM_COUNTS}) and torch.int64"
            )
        health_steps = steps if health_steps is None else health_steps
        if not 0 <= health_steps <= steps:
            raise ValueError(
                f"StallAggregator.accumulate: {health_steps} health steps of {steps} steps"
            )
        self._counts.add_(counts)
        self._steps += steps
        self._health_steps += health_steps

    def note_skipped_step(self) -> None:
        """Record one optimizer step skipped for non-finite gradients (every rank calls it)."""
        self._skipped += 1

    def reduce(self, group: dist.ProcessGroup | None = None) -> StallReport:
        """All-reduce the sums since the last report into a StallReport, then start afresh.

        ``group``: the ranks whose shards together cover the model once (default all ranks;
        under HSDP the shard group, so replicas are not counted twice)."""
        per_group = torch.zeros(len(GROUPS), NUM_COUNTS, dtype=torch.int64, device=self.device)
        per_group.index_add_(0, self._group_index, self._counts)
        health = self._health_steps
        sizes = torch.tensor(
            [
                [numel * self._steps, numel * health, *(b * health for b in blocks)]
                for numel, blocks in zip(self._group_numel, self._group_blocks, strict=True)
            ],
            dtype=torch.int64,
            device=self.device,
        )
        packed = torch.cat([per_group, sizes], dim=1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        rows = packed.tolist()
        report = self._report(rows)
        self._counts.zero_()
        self._steps = 0
        self._health_steps = 0
        self._skipped = 0
        return report

    def _report(self, rows: list[list[int]]) -> StallReport:
        """Host-side fractions from the reduced [group, counts + (element-steps, and over the
        health steps: element-steps, m block-steps, v block-steps)] rows."""
        counts = [row[:NUM_COUNTS] for row in rows]
        sizes = [row[NUM_COUNTS:] for row in rows]
        totals = [sum(col) for col in zip(*counts, strict=True)]
        size_totals = [sum(col) for col in zip(*sizes, strict=True)]
        element_steps = size_totals[0]
        present = [
            (name, row, size)
            for name, row, size in zip(GROUPS, counts, sizes, strict=True)
            if size[0] > 0
        ]
        state_counts, state_counts_by_group = {}, {}
        for tag, col in STATE_COUNT_TAGS.items():
            size_col = _HEALTH_SIZE_COLUMN.get(col, _HEALTH_ELEMENT_STEPS)
            if not size_totals[size_col]:
                continue  # no step counted them, or an unscaled state has no blocks
            state_counts[tag] = _fraction(totals[col], size_totals[size_col])
            state_counts_by_group[tag] = {
                name: _fraction(row[col], size[size_col])
                for name, row, size in present
                if size[size_col]
            }
        return StallReport(
            steps=self._steps,
            element_steps=element_steps,
            stalled={
                state: _fraction(totals[col], element_steps) for col, state in enumerate(STATES)
            },
            stalled_by_group={
                state: {name: _fraction(row[col], size[0]) for name, row, size in present}
                for col, state in enumerate(STATES)
            },
            param_changed=_fraction(totals[2], element_steps),
            param_changed_by_group={
                name: _fraction(row[2], size[0]) for name, row, size in present
            },
            nonfinite_grad_elements=totals[3],
            skipped_steps=self._skipped,
            state_counts=state_counts,
            state_counts_by_group=state_counts_by_group,
            health_steps=self._health_steps,
        )


def peak_flops(device: torch.device | str, override: float | None = None) -> float | None:
    """Dense BF16 peak FLOP/s of one device: the override, else by CUDA name, else None."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def model_flops_utilization(
    flops_per_token: float, tokens_per_s: float, peak: float | None, world_size: int
) -> float:
    """MFU = flops_per_token · global tokens/s / (peak · world_size); NaN when peak is unknown
    (a CPU, an unlisted GPU without ``train.peak_flops``)."""
    if not peak:
        return math.nan
    return flops_per_token * tokens_per_s / (peak * world_size)


class ThroughputMeter:
    """Global tokens/s and MFU over the window since the previous measurement."""

    def __init__(self, flops_per_token: float, peak: float | None, world_size: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self._tokens = 0
        self._start = time.perf_counter()

    def update(self, tokens: int) -> None:
        """Add tokens processed by all ranks together."""
        self._tokens += tokens

    def measure(self) -> tuple[float, float]:
        """(tokens/s, MFU) since the last call; call after a host sync (e.g. loss.item())."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        tokens_per_s = self._tokens / elapsed
        self._tokens = 0
        self._start = now
        mfu = model_flops_utilization(
            self.flops_per_token, tokens_per_s, self.peak, self.world_size
        )
        return tokens_per_s, mfu


def peak_memory_gib(device: torch.device | str) -> tuple[float, str]:
    """(peak GiB, source): CUDA max_memory_allocated, or the process's max RSS on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, MEMORY_CUDA
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = maxrss if sys.platform == "darwin" else maxrss * 1024
    return rss_bytes / GIB, MEMORY_MAXRSS


def _num(value: float, spec: str) -> str:
    """A number in the given format, or n/a for NaN."""
    return "n/a" if math.isnan(value) else format(value, spec)


def format_log_line(
    step: int,
    scalars: Mapping[str, float],
    report: StallReport | None = None,
    predicted: Mapping[str, float] | None = None,
    resets: Iterable[str] = (),
    memory_source: str = MEMORY_CUDA,
    progress: StepProgress | None = None,
) -> str:
    """One console line: step (of total, elapsed, ETA when ``progress`` is given), the known
    scalars present (and ``loss/val/<name>`` of each extra validation set), stalls
    measured/predicted, resets. NaN values read ``n/a``."""
    parts = progress.parts(step) if progress is not None else [f"step {step}"]
    fields = (
        (TAG_LOSS, "loss {}", ".4f"),
        (TAG_VAL_LOSS, "val loss {}", ".4f"),
        (TAG_LR, "lr {}", ".3e"),
        (TAG_GRAD_NORM, "gnorm {}", ".3f"),
        (TAG_TOKENS_PER_S, "{} tok/s", ",.0f"),
    )
    for tag, template, spec in fields:
        if tag in scalars:
            parts.append(template.format(_num(scalars[tag], spec)))
        if tag == TAG_VAL_LOSS:  # then the extra validation sets', loss/val/<name>
            parts.extend(
                f"val {key.removeprefix(tag + '/')} {_num(value, spec)}"
                for key, value in scalars.items()
                if key.startswith(tag + "/")
            )
    if TAG_MFU in scalars:
        mfu = scalars[TAG_MFU]
        parts.append("mfu n/a" if math.isnan(mfu) else f"mfu {100 * mfu:.1f}%")
    if TAG_MEMORY in scalars:
        suffix = f" ({memory_source})" if memory_source != MEMORY_CUDA else ""
        parts.append(f"mem {_num(scalars[TAG_MEMORY], '.2f')} GiB{suffix}")
    if report is not None:
        predicted = predicted or {}
        stall = " ".join(
            f"{state} {_num(report.stalled[state], '.3f')}/"
            f"{_num(predicted.get(state, math.nan), '.3f')}"
            for state in STATES
        )
        parts.append(f"stall {stall} chg {_num(report.param_changed, '.3f')}")
        if report.nonfinite_grad_elements or report.skipped_steps:
            parts.append(
                f"nonfinite {report.nonfinite_grad_elements} skipped {report.skipped_steps}"
            )
    reset = set(resets)
    reset_states = [state for state in STATES if state in reset]
    if reset_states:
        parts.append("reset " + ",".join(reset_states))
    return " | ".join(parts)


@contextlib.contextmanager
def _writing(path: Path, needed: int | None = None) -> Iterator[None]:
    """A write under ``path`` (``needed`` bytes, when known) that finds no room raises
    NoSpaceError (one line)."""
    try:
        yield
    except OSError as err:
        if out_of_space(err):
            raise no_space(path, needed) from None
        raise


def _tensorboard_write(method: Callable) -> Callable:
    """A MetricsLogger method that writes TensorBoard events: a full disk or file size limit
    hit by the writer (or its thread) is NoSpaceError naming the event directory."""

    @functools.wraps(method)
    def guarded(self: MetricsLogger, *args, **kwargs):
        if self._writer is None:
            return None
        with _writing(self.tb_dir):
            return method(self, *args, **kwargs)

    return guarded


class _QuietWriterThread:
    """While installed, TensorBoard's writer thread dying of a full disk prints nothing: the
    main thread's next write raises that error (see :func:`_tensorboard_write`). Every other
    thread's exception goes to the hook found at install."""

    def __init__(self) -> None:
        self._previous = threading.excepthook
        threading.excepthook = self

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        tensorboard = type(args.thread).__module__.startswith("tensorboard.")
        if not (tensorboard and args.exc_value is not None and out_of_space(args.exc_value)):
            self._previous(args)

    def uninstall(self) -> None:
        if threading.excepthook is self:
            threading.excepthook = self._previous


class MetricsLogger:
    """Rank-0 console lines and TensorBoard scalars under ``<run_dir>/tb``; no-op elsewhere.

    A write that finds no room (a full disk, ``ulimit -f``) raises NoSpaceError naming the
    event directory; TensorBoard's writer thread prints no traceback of its own for it."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        *,
        memory_source: str = MEMORY_CUDA,
        stream: TextIO | None = None,
        flush_secs: int = 10,
        purge_step: int | None = None,
    ) -> None:
        self.rank = rank
        self.memory_source = memory_source
        self._stream = stream
        self._pending_resets: set[str] = set()
        self._reset_step: dict[str, int] = {}
        self._writer: SummaryWriter | None = None
        self._quiet: _QuietWriterThread | None = None
        self.tb_dir = Path(run_dir) / TB_DIR
        if rank == 0:
            # purge_step: a resumed run drops events it is about to write again
            with _writing(self.tb_dir):
                self._writer = SummaryWriter(
                    log_dir=str(self.tb_dir), flush_secs=flush_secs, purge_step=purge_step
                )
            self._quiet = _QuietWriterThread()

    def log_text(self, msg: str) -> None:
        """Print a message on rank 0."""
        if self.rank == 0:
            print(msg, file=self._stream or sys.stdout, flush=True)

    @_tensorboard_write
    def log_step(
        self,
        step: int,
        scalars: Mapping[str, float],
        report: StallReport | None = None,
        predicted: Mapping[str, float] | None = None,
        progress: StepProgress | None = None,
    ) -> None:
        """Write scalars (keys are TensorBoard tags; an unknown, NaN MFU is left out), the
        stall report if given, and one line."""
        if self._writer is None:
            return
        for tag, value in scalars.items():
            if not (tag == TAG_MFU and math.isnan(value)):
                self._writer.add_scalar(tag, value, step)
        if report is not None:
            self.log_stalls(step, report, predicted or {})
        self.log_text(
            format_log_line(
                step,
                scalars,
                report,
                predicted,
                self._pending_resets,
                self.memory_source,
                progress,
            )
        )
        self._pending_resets.clear()
        self._writer.flush()

    @_tensorboard_write
    def log_stalls(self, step: int, report: StallReport, predicted: Mapping[str, float]) -> None:
        """Write measured and predicted stall fractions, the state counts' fractions
        (:data:`STATE_COUNT_TAGS`), non-finite counts and reset markers."""
        if self._writer is None:
            return
        add = self._writer.add_scalar
        for state in STATES:
            add(f"stall/{state}", report.stalled[state], step)
            for name, fraction in report.stalled_by_group[state].items():
                add(f"stall/{state}/{name}", fraction, step)
            if state in predicted:
                add(f"stall_predicted/{state}", predicted[state], step)
            if self._reset_step.get(state) != step:
                add(f"reset/{state}", 0.0, step)
        add("stall/param_changed", report.param_changed, step)
        for name, fraction in report.param_changed_by_group.items():
            add(f"stall/param_changed/{name}", fraction, step)
        for tag, fraction in report.state_counts.items():
            add(tag, fraction, step)
            for name, value in report.state_counts_by_group[tag].items():
                add(f"{tag}/{name}", value, step)
        add("nonfinite/grad_elements", report.nonfinite_grad_elements, step)
        add("nonfinite/skipped_steps", report.skipped_steps, step)
        self._writer.flush()

    @_tensorboard_write
    def log_update_sizes(self, sizes: Mapping[int, Mapping[str, float]]) -> None:
        """Write each measured step's update RMS against lr: ``update/rms`` over all sampled
        elements, ``update/rms/<group>`` per layer group."""
        if self._writer is None:
            return
        for step, by_group in sizes.items():
            for name, value in by_group.items():
                tag = TAG_UPDATE_RMS if name == "all" else f"{TAG_UPDATE_RMS}/{name}"
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    @_tensorboard_write
    def log_shadow(self, step: int, by_group: Mapping[str, Mapping[str, float]]) -> None:
        """Write the stored states' drift from their FP32 shadow at ``step``: each of
        :data:`SHADOW_TAGS` over all sampled elements (``"all"``) and with ``/<group>`` per
        layer group."""
        if self._writer is None:
            return
        for name, values in by_group.items():
            for metric, value in values.items():
                tag = SHADOW_TAGS[metric]
                self._writer.add_scalar(tag if name == "all" else f"{tag}/{name}", value, step)
        self._writer.flush()

    @_tensorboard_write
    def log_reset(self, step: int, states: Iterable[str]) -> None:
        """Mark states reset at this step (call before logging that step's stalls)."""
        if self._writer is None:
            return
        for state in states:
            if state not in STATES:
                raise ValueError(f"MetricsLogger.log_reset: state {state!r} is not one of {STATES}")
            self._writer.add_scalar(f"reset/{state}", 1.0, step)
            self._reset_step[state] = step
            self._pending_resets.add(state)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer (NoSpaceError if its last events find no
        room)."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                with _writing(self.tb_dir):
                    writer.close()
        finally:
            if self._quiet is not None:
                self._quiet.uninstall()
                self._quiet = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error in flight is the one to report
            self.close()


# ------------------------------------------------------------------ per-step record


def _strict(value: object) -> object:
    """``value`` with every non-finite float (NaN, ±Infinity) replaced by None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _line(record: Mapping[str, object]) -> str:
    return json.dumps(_strict(dict(record)), allow_nan=False) + "\n"


def append_records(run_dir: str | Path, records: Iterable[Mapping[str, float]]) -> None:
    """Append one JSON line per record to ``<run_dir>/metrics.jsonl`` (floats round-trip).

    The trainer writes one record per step: ``step`` and ``loss``; on a log step also
    ``grad_norm``, ``lr`` and (SRAdamW) ``stall_m``, ``stall_v``, ``param_changed`` and the
    state counts' fractions under their tags with ``_`` for ``/`` (:func:`record_key`); on a
    validation step also ``val_loss``. Lines are strict JSON: a non-finite value (NaN,
    ±Infinity) is written as null, which :func:`read_records` reads back as NaN."""
    lines = [_line(r) for r in records]
    path = Path(run_dir) / METRICS_FILE
    with _writing(path, sum(len(line.encode()) for line in lines)), path.open("a") as f:
        f.writelines(lines)


def record_key(tag: str) -> str:
    """The metrics.jsonl key of a TensorBoard tag: ``underflow/m`` → ``underflow_m``."""
    return tag.replace("/", "_")


def _as_record(line: str) -> dict | None:
    """The record of one metrics.jsonl line (null values as NaN); None if it is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return {k: math.nan if v is None else v for k, v in record.items()}


def parse_records(
    text: str, source: str | Path = METRICS_FILE, log: Callable[[str], None] | None = None
) -> list[dict]:
    """The records of a metrics.jsonl text in order, null values read as NaN.

    A line that is not a record (the last one cut short by a killed writer, or one garbled
    otherwise) is dropped; ``log`` then receives one line naming ``source`` and how many."""
    records, dropped = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        record = _as_record(line)
        if record is None:
            dropped.append(number)
        else:
            records.append(record)
    if dropped and log is not None:
        where = f"line {dropped[0]}" + (f" and {len(dropped) - 1} more" if dropped[1:] else "")
        last = dropped == [len(text.splitlines())]
        why = " (the last line, cut short by a killed writer)" if last else ""
        log(f"notice: {source}: dropped {len(dropped)} unreadable line(s): {where}{why}")
    return records


def read_records(run_dir: str | Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in order (empty when there is none; see
    :func:`parse_records` for null values and unreadable lines)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return parse_records(path.read_text(), path, log)


def trim_records(
    run_dir: str | Path, last_step: int, log: Callable[[str], None] | None = None
) -> None:
    """Keep the records up to ``last_step`` (0: none, a run starting afresh), dropping the
    steps a resumed run writes again and any unreadable line (``log``: see
    :func:`parse_records`).

    The kept records go to a new file beside ``metrics.jsonl`` (written, flushed to disk),
    which then replaces it with one rename: a kill at any moment leaves the old history or
    the new one, never a cut one."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [r for r in read_records(run_dir, log) if r["step"] <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    lines = [_line(r) for r in kept]
    try:
        with _writing(path, sum(len(line.encode()) for line in lines)), tmp.open("w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fault_point("metrics-trim")
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
