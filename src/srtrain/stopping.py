"""Stopping a run on SIGTERM or SIGINT: finish the step in flight, save, end with one line.

SLURM sends SIGTERM ahead of a time limit and on preemption, torchrun forwards the SIGTERM or
SIGINT it receives to its workers, Ctrl-C sends SIGINT. While a run trains, the first such
signal only records a request; at the next step boundary the ranks agree on it (one tiny
all-reduce per step, :meth:`StopSignals.agree`), every rank finishes the step, the trainer
saves a checkpoint and the run ends with :class:`RunStopped`: one line saying where it saved
and how to resume, exit code :data:`EXIT_SAVED`. Before training starts a signal stops at
once (nothing trained yet). A second signal ends the process at once from a watcher thread
(the main thread may be waiting inside a collective), with one line and exit code
128 + the signal's number. A SIGTERM that repeats within :data:`REPEAT_WINDOW_S` of the first
is the same request delivered twice (SLURM signals every process of a job step and torchrun
forwards it to its workers again), not a second one.

Nothing here imports torch until the ranks agree, so the handlers are in place before the
heavy imports of a start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_SAVED = 75  # stopped by a signal once a checkpoint was saved: run the same command again
REPEAT_WINDOW_S = 2.0

_active: StopSignals | None = None


def signal_exit_code(signum: int) -> int:
    """The exit code of a run a signal stopped without saving: 128 + its number."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """SIGTERM, SIGINT, ... for a signal number."""
    return signal.Signals(signum).name


class RunStopped(BaseException):
    """A run a signal ended: its one line and the process's exit code. A BaseException, as
    KeyboardInterrupt, so that no ``except Exception`` on the way out takes it for a
    failure."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line = line
        self.code = code


class StopSignals:
    """The SIGTERM and SIGINT handling of a run (install in the main thread).

    ``signum``: the first signal this process received (None: none yet). :meth:`training`
    switches from stopping at once to recording a request for the step boundary.
    ``on_exit`` runs before an immediate exit (it releases the run directory's lock).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
        self.signum: int | None = None
        self.on_exit: Callable[[], None] | None = None
        self._first_at = 0.0
        self._training = False
        self._raised = False
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ installing

    def install(self) -> bool:
        """Install the handlers; False (nothing installed) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handler)
        self._thread = threading.Thread(target=self._watch, name="stop-signals", daemon=True)
        self._thread.start()
        return True

    def restore(self) -> None:
        """Put back the handlers found at :meth:`install` and stop the watcher."""
        if self._pipe is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(self._previous_fd)
        read, write = self._pipe
        os.close(write)  # the watcher reads end-of-file and ends
        if self._thread is not None:
            self._thread.join()
        os.close(read)
        self._pipe = self._thread = None

    @property
    def in_training(self) -> bool:
        """Whether :meth:`training` was called (signals are requests for the boundary)."""
        return self._training

    def check(self) -> None:
        """Before training: raise RunStopped if a signal has come. Its exception from the
        handler may have been swallowed (torch's C import of numpy does that)."""
        if self.signum is not None and not self._training:
            raise self._before_training(self.signum)

    def training(self) -> None:
        """From now on the first signal is a request read at the step boundary (raises
        RunStopped if one came before: see :meth:`check`)."""
        self.check()
        self._training = True

    def _before_training(self, signum: int) -> RunStopped:
        return RunStopped(
            f"stopped by {signal_name(signum)} before training started; nothing to save",
            signal_exit_code(signum),
        )

    # ------------------------------------------------------------------ receiving

    def _handler(self, signum: int, frame: object) -> None:
        """The main thread's handler: before training, stop at once (the watcher counts)."""
        if not self._training and not self._raised:
            self._raised = True
            raise self._before_training(signum)

    def _watch(self) -> None:
        """The watcher thread: each received signal's number arrives through the wakeup fd."""
        read = self._pipe[0]
        while data := os.read(read, 64):
            for signum in data:
                if signum in SIGNALS:
                    self._received(signum)

    def _received(self, signum: int) -> None:
        now = time.monotonic()
        with self._lock:
            first = self.signum is None
            if first:
                self.signum, self._first_at = signum, now
            elif signum == self.signum == signal.SIGTERM and now - self._first_at < REPEAT_WINDOW_S:
                return  # the same request, delivered twice
        if not first:
            self._exit_now(signum)
        if self._training:
            self._say(
                f"{signal_name(signum)}: stopping after the step in flight with a checkpoint "
                "(a second signal stops at once)"
            )

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def _exit_now(self, signum: int) -> None:
        """End the process at once: one line, the lock released, 128 + the signal."""
        try:
            self._say(
                f"stopped at once by a second signal ({signal_name(signum)}); a restart "
                "resumes from the latest complete checkpoint"
            )
            sys.stderr.flush()
            if self.on_exit is not None:
                self.on_exit()
        finally:
            os._exit(signal_exit_code(signum))

    # ------------------------------------------------------------------ agreeing

    def agree(self, group: Any) -> int | None:
        """The signal any rank has received, the same on every rank (None: none); every rank
        of ``group`` (a CPU process group, or None for a single process) calls it at the same
        step boundary."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int32)
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag) or None

    def failed(self, signum: int, err: BaseException) -> RunStopped:
        """The stop of a run that failed after ``signum``: before training (its interrupted
        setup), or in its remaining step or save."""
        if not self._training:
            return self._before_training(signum)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return RunStopped(
            f"stopped by {signal_name(signum)}: the step in flight or its checkpoint failed "
            f"({first}); a restart resumes from the latest complete checkpoint",
            signal_exit_code(signum),
        )


@contextlib.contextmanager
def handling() -> Iterator[StopSignals]:
    """SIGTERM and SIGINT handled for the block (see :class:`StopSignals`); nested blocks
    share the outermost one. Outside the main thread nothing is installed."""
    global _active
    if _active is not None:
        yield _active
        return
    stop = StopSignals()
    installed = stop.install()
    if installed:
        _active = stop
    try:
        yield stop
    finally:
        if installed:
            _active = None
            stop.restore()
