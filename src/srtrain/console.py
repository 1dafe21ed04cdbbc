"""What a run tells its user beyond the metrics: where a log step stands (step of total,
elapsed time, ETA), progress of long data preparation, the closing line of a finished run and
the message for a run dir whose run has already finished."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

# Periodic progress lines come at most this often (lines that start or end a phase always
# come).
PROGRESS_EVERY_S = 5.0


def format_duration(seconds: float) -> str:
    """Whole seconds as H:MM:SS (hours unbounded), e.g. 0:09:30 or 27:00:05."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass(frozen=True)
class StepProgress:
    """Where a step stands: of how many steps, and (on a log step) the wall time since the
    process started training and the estimated time to the last step."""

    total: int
    elapsed_s: float | None = None
    eta_s: float | None = None

    def parts(self, step: int) -> list[str]:
        """The console fields: ``step N/total`` and, when timed, ``H:MM:SS elapsed, ETA
        H:MM:SS`` (``ETA n/a`` before any rate is known)."""
        parts = [f"step {step}/{self.total}"]
        if self.elapsed_s is not None:
            eta = "n/a" if self.eta_s is None else format_duration(self.eta_s)
            parts.append(f"{format_duration(self.elapsed_s)} elapsed, ETA {eta}")
        return parts


class RunClock:
    """Elapsed time and ETA of the steps ``start_step + 1 .. total`` one process trains.

    The ETA is the steps left over the step rate measured since the first log step, so the
    first interval (compilation, warm-up, first allocations) does not count; at the first
    log step that interval is all there is to go on. Validation and checkpoint time between
    log steps counts, as it will in the steps left. ``now`` arguments are
    ``time.monotonic()`` readings (taken when omitted).
    """

    def __init__(self, start_step: int, total: int, now: float | None = None) -> None:
        self.start_step = start_step
        self.total = total
        self.started = time.monotonic() if now is None else now
        self._first: tuple[int, float] | None = None  # the first log step and its time

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since training started in this process."""
        return (time.monotonic() if now is None else now) - self.started

    def progress(self, step: int, now: float | None = None) -> StepProgress:
        """The progress of log step ``step`` (steps must come in increasing order)."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (step, now)
        base_step, base_time = (
            self._first if step > self._first[0] else (self.start_step, self.started)
        )
        seconds = now - base_time
        eta = None
        if step > base_step and seconds > 0:
            eta = (self.total - step) * seconds / (step - base_step)
        return StepProgress(self.total, now - self.started, eta)


class Ticker:
    """Progress lines at a modest rate: :meth:`always` writes; periodic lines are written only
    when :meth:`due`, ``every_s`` seconds after the last line. ``write`` None writes nothing."""

    def __init__(
        self, write: Callable[[str], None] | None, every_s: float = PROGRESS_EVERY_S
    ) -> None:
        self._write = write
        self.every_s = every_s
        self._last = time.monotonic()

    def always(self, text: str) -> None:
        """Write a line that starts or ends a phase."""
        if self._write is not None:
            self._write(text)
            self._last = time.monotonic()

    def due(self) -> bool:
        """Whether a periodic line is due (never when writing nothing)."""
        return self._write is not None and time.monotonic() - self._last >= self.every_s


def print_line(text: str) -> None:
    """Print one console line at once (no buffering behind a pipe)."""
    print(text, flush=True)


def megabytes(num_bytes: int) -> str:
    """A byte count in MB (10^6 bytes) with one decimal, e.g. 12.3 MB."""
    return f"{num_bytes / 1e6:,.1f} MB"


# ----------------------------------------------------------------- start and end of a run


def closing_line(
    run_dir: str | Path, start: int, end: int, elapsed_s: float, checkpoint: Path | None
) -> str:
    """The last line of a run that trained steps ``start + 1 .. end``."""
    steps = f"{end} steps" if start == 0 else f"steps {start + 1}-{end}"
    saved = str(checkpoint) if checkpoint is not None else "none (checkpoint.enabled is false)"
    return (
        f"done: {steps} in {format_duration(elapsed_s)}; run dir {run_dir}; "
        f"last checkpoint {saved}; curves: tensorboard --logdir {Path(run_dir) / 'tb'}"
    )
