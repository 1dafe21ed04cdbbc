"""One owner per run directory: a lock file with a lease, and a watchdog for orphaned ranks.

Rank 0 of a run holds ``<run_dir>/.srtrain-lock.<n>``, a JSON record of the holder (host,
pid, torchrun launcher pid and run id, since when). Locks are generations: taking one over
means creating generation ``n + 1`` with an atomic exclusive create (write a private file,
``os.link`` it to the name), so of several processes racing to take over the same stale
lock exactly one wins; the winner deletes the older generations. A holder owns the run
directory while its generation is the newest one and still holds its token.

The holder renews a lease, the lock file's modification time, every ``RENEW_PERIOD_S``
seconds from a background thread. A lock is stale, and is taken over with a one-line notice,
when its lease is older than ``LEASE_TIMEOUT_S`` (on any host of a shared filesystem, whose
clocks are assumed synchronised), when its process has ended (same host: same hostname and
PID namespace), or when it was held by an earlier attempt of the same torchrun job (same run
id and launcher; torchrun ``--max-restarts``). A lock held by another launcher of the same
torchrun run id on another host is waited for until its lease expires (rank 0 may move
between nodes across restarts). Any other lock is refused at once with
:class:`RunDirInUseError`, naming the holder.

Under torchrun every rank also watches its launcher: workers run in their own sessions, so
killing the launcher leaves them running. When a rank's parent process changes (it was
reparented to init or a subreaper), or rank 0 finds its lock taken over, the process prints
one line to stderr and ends with exit code ``EXIT_STOPPED`` at once; :meth:`Ownership.check`
runs the same checks synchronously before every write of the training loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

from srtrain.config import ConfigError
from srtrain.rundir import LOCK_PREFIX

RENEW_PERIOD_S = 5.0  # the holder touches its lock this often
LEASE_TIMEOUT_S = 3 * RENEW_PERIOD_S  # a lock not renewed for this long is stale
WATCHDOG_PERIOD_S = 1.0  # how often a torchrun worker checks that its launcher is alive
EXIT_STOPPED = 1  # exit code of a rank stopped by the watchdog

_GENERATION = re.compile(re.escape(LOCK_PREFIX) + r"(\d+)")
_UNREADABLE_GRACE_S = 2.0  # a lock file younger than this may still be being written
_ACQUIRE_ATTEMPTS = 50


class RunDirInUseError(ConfigError):
    """The run directory is held by another live job."""


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot ("Z" for a zombie); None unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "Z" if fields[0] in ("Z", "X") else fields[19]


def _process_alive(pid: int, start: str | None) -> bool:
    """Whether ``pid`` still runs and is the process that started at ``start`` (if known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _process_start(pid)
    return now != "Z" and (start is None or now is None or now == start)


def _launcher_pid() -> int | None:
    """The torchrun launcher's pid (this process's parent) under torchrun, else None."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lock."""

    host: str
    pidns: str | None
    pid: int
    pid_start: str | None
    launcher_pid: int | None
    job: str | None  # TORCHELASTIC_RUN_ID
    since: float
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pidns=_pid_namespace(),
            pid=pid,
            pid_start=_process_start(pid),
            launcher_pid=_launcher_pid(),
            job=os.environ.get("TORCHELASTIC_RUN_ID"),
            since=time.time(),
            token=secrets.token_hex(8),
        )

    def describe(self) -> str:
        launcher = f", launcher pid {self.launcher_pid}" if self.launcher_pid else ""
        return f"job on host {self.host} (pid {self.pid}{launcher}) since {_utc(self.since)}"

    def same_host(self, other: Holder) -> bool:
        return self.host == other.host and self.pidns == other.pidns

    def same_launcher(self, other: Holder) -> bool:
        return (
            self.job is not None
            and self.job == other.job
            and self.same_host(other)
            and self.launcher_pid == other.launcher_pid
        )


@dataclass(frozen=True)
class _Seen:
    generation: int
    holder: Holder | None  # None: unreadable
    age: float  # seconds since the lease was last renewed


class RunDirLock:
    """The lock of one run directory, as seen and held by this process.

    :meth:`acquire` takes it (or raises :class:`RunDirInUseError`); :meth:`renew` extends the
    lease; :meth:`owned` says whether it is still ours; :meth:`release` removes it, only
    while it is ours. ``lease_timeout`` is how old another holder's lease must be to be
    stale.
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], *, lease_timeout: float = LEASE_TIMEOUT_S
    ) -> None:
        self.run_dir = Path(run_dir)
        self.lease_timeout = lease_timeout
        self.me = Holder.this_process()
        self.generation: int | None = None
        self._created: list[Path] = []  # directories acquire() made, deepest first

    def path(self, generation: int) -> Path:
        return self.run_dir / f"{LOCK_PREFIX}{generation}"

    def _generations(self) -> list[int]:
        try:
            names = os.listdir(self.run_dir)
        except FileNotFoundError:
            return []
        found = sorted(int(m[1]) for n in names if (m := _GENERATION.fullmatch(n)))
        newest = found[-1] if found else 0
        while self.path(newest + 1).exists():  # a listing may lag behind on NFS
            newest += 1
            found.append(newest)
        return found

    def _read(self, generation: int) -> _Seen | None:
        """The holder of ``generation`` and its lease's age; None if the file is gone."""
        try:
            with open(self.path(generation), "rb") as f:
                data, mtime = f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        age = time.time() - mtime
        try:
            return _Seen(generation, Holder(**json.loads(data)), age)
        except (ValueError, TypeError):
            return _Seen(generation, None, age)

    def _stale_reason(self, seen: _Seen) -> str | None:
        """Why the lock ``seen`` may be taken over; None while its holder is live."""
        holder = seen.holder
        if holder is None:
            return "its lock file is unreadable" if seen.age > _UNREADABLE_GRACE_S else None
        if self.me.same_launcher(holder):
            return "it was an earlier attempt of this torchrun job"
        if self.me.same_host(holder) and not _process_alive(holder.pid, holder.pid_start):
            return f"its process {holder.pid} has ended"
        if seen.age > self.lease_timeout:
            return f"its lease was last renewed {seen.age:.0f} s ago"
        return None

    def _create(self, generation: int) -> bool:
        """Atomically create ``generation`` holding this process's record; False if it
        exists."""
        tmp = self.run_dir / f"{LOCK_PREFIX}tmp-{self.me.token}"
        with open(tmp, "w") as f:
            json.dump(asdict(self.me), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path(generation))
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def acquire(self) -> str | None:
        """Take the lock; returns a one-line notice when a stale lock was taken over.

        Raises :class:`RunDirInUseError` naming the holder when another live job holds it.
        """
        if self.generation is not None:
            raise RuntimeError(f"{self.run_dir}: the lock is already held by this object")
        missing = self.run_dir
        while not missing.exists() and missing != missing.parent:
            self._created.append(missing)
            missing = missing.parent
        self.run_dir.mkdir(parents=True, exist_ok=True)
        deadline = None
        for _ in range(_ACQUIRE_ATTEMPTS):
            found = self._generations()
            newest = found[-1] if found else 0
            seen = self._read(newest) if newest else None
            if newest and seen is None:
                continue  # released or taken over while we looked
            notice = None
            if seen is not None:
                reason = self._stale_reason(seen)
                if reason is None:
                    holder = seen.holder
                    if holder is not None and holder.job is not None and holder.job == self.me.job:
                        # the same torchrun run id from another launcher (another node):
                        # an earlier attempt whose rank 0 ran elsewhere, until its lease says
                        if deadline is None:
                            deadline = time.monotonic() + self.lease_timeout + 1.0
                        if time.monotonic() < deadline:
                            time.sleep(min(1.0, self.lease_timeout / 4))
                            continue
                    who = holder.describe() if holder is not None else "a job"
                    raise RunDirInUseError(
                        f"{self.run_dir} is in use by {who}; stop it or choose "
                        "another train.run_dir"
                    )
                who = seen.holder.describe() if seen.holder is not None else "a job"
                notice = f"notice: taking over {self.run_dir} from the {who}: {reason}"
            if not self._create(newest + 1):
                continue  # another process took this generation first
            if self._generations()[-1] != newest + 1:
                self.path(newest + 1).unlink(missing_ok=True)  # we acted on an old view
                continue
            self.generation = newest + 1
            for older in found:
                self.path(older).unlink(missing_ok=True)
            return notice
        raise ConfigError(
            f"{self.run_dir}: could not take its lock after {_ACQUIRE_ATTEMPTS} "
            "attempts (other jobs keep starting on it); stop them and retry"
        )

    def owned(self) -> bool:
        """Whether this process still holds the lock (not released, not taken over)."""
        if self.generation is None:
            return False
        seen = self._read(self.generation)
        return (
            seen is not None
            and seen.holder is not None
            and seen.holder.token == self.me.token
            and not self.path(self.generation + 1).exists()
        )

    def holder_after_us(self) -> str:
        """Who took the lock over, for the message of a stopped holder."""
        found = self._generations()
        seen = self._read(found[-1]) if found else None
        if seen is None or seen.holder is None:
            return "another job"
        return f"the {seen.holder.describe()}"

    def renew(self) -> bool:
        """Extend the lease; False if the lock is no longer ours."""
        if not self.owned():
            return False
        try:
            os.utime(self.path(self.generation))
        except FileNotFoundError:
            return False
        return True

    def release(self) -> None:
        """Remove the lock file if this process still owns it; otherwise leave it alone.

        Directories that :meth:`acquire` created and that are empty again are removed, so a
        start refused after taking the lock leaves no trace."""
        if self.owned():
            self.path(self.generation).unlink(missing_ok=True)
        self.generation = None
        for made in self._created:
            try:
                made.rmdir()  # only while empty
            except OSError:
                break
        self._created = []


class Ownership:
    """This rank's part in owning a run directory while it trains.

    ``lock``: the held lock (rank 0), else None. ``launcher_pid``: the torchrun launcher
    to watch (every rank under torchrun), else None. :meth:`start` runs a daemon thread
    that renews the lease and watches the launcher; :meth:`check` runs its checks now
    (call it before each write); both end the process when this run must stop.
    """

    def __init__(
        self,
        lock: RunDirLock | None,
        launcher_pid: int | None,
        *,
        renew_period: float = RENEW_PERIOD_S,
        watchdog_period: float = WATCHDOG_PERIOD_S,
    ) -> None:
        self.lock = lock
        self.launcher_pid = launcher_pid
        self.renew_period = renew_period
        self.watchdog_period = watchdog_period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exiting = False

    def _stop_process(self, why: str) -> None:
        if self._exiting:  # released by release_before_exit: the process is ending anyway
            return
        print(f"error: process {os.getpid()} stopped: {why}", file=sys.stderr, flush=True)
        os._exit(EXIT_STOPPED)

    def _check_launcher(self) -> None:
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            self._stop_process(
                f"its launcher (pid {self.launcher_pid}) is gone; nothing more is written"
            )

    def _lost(self) -> None:
        self._stop_process(
            f"{self.lock.run_dir} was taken over by "
            f"{self.lock.holder_after_us()}; nothing more is written"
        )

    def check(self) -> None:
        """End the process if the launcher is gone or the lock was taken over."""
        self._check_launcher()
        if self.lock is not None and not self.lock.owned():
            self._lost()

    def _watch(self) -> None:
        renewed = time.monotonic()
        period = min(
            self.watchdog_period if self.launcher_pid is not None else math.inf,
            self.renew_period if self.lock is not None else math.inf,
        )
        while not self._stop.wait(period):
            self._check_launcher()
            if self.lock is not None and time.monotonic() - renewed >= self.renew_period:
                renewed = time.monotonic()
                try:
                    if not self.lock.renew():
                        self._lost()
                except OSError:
                    pass  # a transient filesystem error; the next renewal retries

    def start(self) -> None:
        if self.lock is None and self.launcher_pid is None:
            return
        self._check_launcher()
        self._thread = threading.Thread(target=self._watch, name="rundir-owner", daemon=True)
        self._thread.start()

    def release_before_exit(self) -> None:
        """Release the lock (if still ours) for a process about to end at once, from any
        thread: the checks no longer take the released lock for a takeover."""
        self._exiting = True
        self._stop.set()
        if self.lock is not None:
            self.lock.release()

    def close(self) -> None:
        """Stop the thread and release the lock (if still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lock is not None:
            self.lock.release()


@contextlib.contextmanager
def own_run_dir(
    run_dir: str | os.PathLike[str], rank: int, device: torch.device | None = None
) -> Iterator[Ownership]:
    """Own ``run_dir`` for the duration of the block (every rank of the run calls this).

    Rank 0 takes the lock (printing a notice to stderr when it takes over a stale one) and
    broadcasts the outcome; if it was refused, every rank raises the same
    :class:`RunDirInUseError`. The lock is released when the block ends, also by an exception.
    """
    launcher = _launcher_pid()
    lock, refusal = None, None
    if rank == 0:
        lock = RunDirLock(run_dir)
        try:
            notice = lock.acquire()
        except ConfigError as err:
            refusal = str(err)
        except OSError as err:
            refusal = f"{run_dir}: cannot lock it ({err.strerror}: {err.filename}); check it"
        else:
            if notice:
                print(notice, file=sys.stderr, flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcome = [refusal]
        dist.broadcast_object_list(outcome, src=0, device=device)
        refusal = outcome[0]
    if refusal is not None:
        raise RunDirInUseError(refusal)
    owner = Ownership(lock, launcher)
    try:
        owner.start()
        yield owner
    except Exception:
        # a rank whose launcher died may fail in a collective first (its peer stopped):
        # say that, as the watchdog would have, rather than the collective's error
        owner.check()
        raise
    finally:
        owner.close()
