"""A run directory has one owner: the lock (acquire, refuse, stale locks, same-job takeover,
an atomic race, release by the owner only), and with real launches: a second job refused,
a killed torchrun launcher whose workers stop before writing again, a restart taking over."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from srtrain.checkpoint import checkpoint_dirs
from srtrain.config import ConfigError
from srtrain.metrics import read_records
from srtrain.rundir_lock import LEASE_TIMEOUT_S, LOCK_PREFIX, RunDirInUseError, RunDirLock

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train")
FORK = mp.get_context("fork")  # the children only touch files: no re-import of torch


def lock_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(LOCK_PREFIX))


def _hold(run_dir: Path, env: dict[str, str], conn, then: str) -> None:
    """Child: take the lock, report, then exit without releasing or wait for orders."""
    os.environ.update(env)
    lock = RunDirLock(run_dir)
    try:
        conn.send(("ok", lock.acquire(), os.getpid()))
    except ConfigError as err:
        conn.send(("refused", str(err), os.getpid()))
        os._exit(0)
    if then == "exit":
        os._exit(0)  # a dead holder: no release
    while (order := conn.recv()) != "quit":
        if order == "owned":
            conn.send(lock.owned())
        elif order == "release":
            lock.release()
            conn.send(None)
    os._exit(0)


def spawn_holder(run_dir: Path, then: str = "wait", **env: str):
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_hold, args=(run_dir, env, child, then))
    proc.start()
    return proc, parent, parent.recv()


def test_acquire_refuse_release_and_stale_locks(tmp_path):
    run = tmp_path / "run"
    # a live holder in another process: refused at once, naming it
    holder, conn, (status, notice, pid) = spawn_holder(run)
    assert (status, notice) == ("ok", None)
    assert lock_files(run) == [f"{LOCK_PREFIX}1"]
    mine = RunDirLock(run)
    start = time.monotonic()
    with pytest.raises(RunDirInUseError) as err:
        mine.acquire()
    assert time.monotonic() - start < LEASE_TIMEOUT_S  # at once, not when the lease runs out
    assert re.fullmatch(
        rf"{re.escape(str(run))} is in use by job on host {re.escape(socket.gethostname())} "
        rf"\(pid {pid}\) since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC; stop it or choose another "
        r"train\.run_dir",
        str(err.value),
    ), str(err.value)
    assert isinstance(err.value, ConfigError)

    # an expired lease (the holder alive but no longer renewing): taken over
    time.sleep(0.4)
    taker = RunDirLock(run, lease_timeout=0.3)
    notice = taker.acquire()
    assert notice.startswith(f"notice: taking over {run} from the job on host ")
    assert re.search(r"its lease was last renewed \d+ s ago$", notice), notice
    assert lock_files(run) == [f"{LOCK_PREFIX}2"]
    conn.send("owned")
    assert conn.recv() is False
    assert taker.owned() and taker.renew()
    conn.send("release")  # not its lock any more: left alone
    conn.recv()
    assert lock_files(run) == [f"{LOCK_PREFIX}2"] and taker.owned()
    conn.send("quit")
    holder.join()
    taker.release()
    assert lock_files(run) == []

    # a holder whose process has ended: taken over at once
    dead, _, (status, _, dead_pid) = spawn_holder(run, then="exit")
    dead.join()
    assert status == "ok" and lock_files(run) == [f"{LOCK_PREFIX}1"]
    taker = RunDirLock(run)
    notice = taker.acquire()
    assert notice.endswith(
        f"(pid {dead_pid}) since {notice.split(' since ')[1][:23]}: "
        f"its process {dead_pid} has ended"
    )
    assert lock_files(run) == [f"{LOCK_PREFIX}2"]
    taker.release()


def test_release_removes_only_the_empty_directories_acquire_made(tmp_path):
    fresh = RunDirLock(tmp_path / "a" / "b" / "run")
    fresh.acquire()
    fresh.release()  # a start refused after locking: nothing left behind
    assert list(tmp_path.iterdir()) == []
    used = RunDirLock(tmp_path / "a" / "run")
    used.acquire()
    (tmp_path / "a" / "run" / "config.yaml").write_text("x")
    used.release()  # a run that wrote something keeps its directory
    assert sorted(p.name for p in (tmp_path / "a" / "run").iterdir()) == ["config.yaml"]


def test_same_torchrun_job_takes_over_another_job_is_refused(tmp_path):
    """Two children of this process stand for two attempts under one torchrun launcher."""
    run = tmp_path / "run"
    first, conn, (status, _, _) = spawn_holder(run, TORCHELASTIC_RUN_ID="job-a")
    assert status == "ok"
    other, _, (status, message, _) = spawn_holder(run, TORCHELASTIC_RUN_ID="job-b")
    other.join()
    assert status == "refused"
    assert f"(pid {first.pid}, launcher pid {os.getpid()})" in message
    again, conn2, (status, notice, _) = spawn_holder(run, TORCHELASTIC_RUN_ID="job-a")
    assert status == "ok"
    assert notice.endswith("it was an earlier attempt of this torchrun job")
    conn.send("owned")
    assert conn.recv() is False
    for c, p in ((conn, first), (conn2, again)):
        c.send("quit")
        p.join()


def _race(run_dirs: list[Path], barrier, results) -> None:
    """Racer: for each run dir, take its stale lock at the same moment as the other racer."""
    won: list[bool] | str = []
    try:
        for run in run_dirs:
            lock = RunDirLock(run)
            barrier.wait(timeout=60)
            try:
                lock.acquire()
                won.append(True)
            except RunDirInUseError:
                won.append(False)
            barrier.wait(timeout=60)  # both decided before the winner lets go
            lock.release()
    except Exception as err:  # reported to the test, which fails with it
        won = f"{type(err).__name__}: {err}"
        barrier.abort()
    results.put((os.getpid(), won))


@pytest.mark.slow
def test_two_processes_racing_for_a_stale_lock_one_wins(tmp_path):
    runs = [tmp_path / f"run{i}" for i in range(30)]
    for run in runs:  # each with the lock of a process that has ended
        dead, _, (status, _, _) = spawn_holder(run, then="exit")
        dead.join()
        assert status == "ok"
    # spawned, not forked: a fork of this multi-threaded test process can hang in the child
    spawn = mp.get_context("spawn")
    barrier, results = spawn.Barrier(2), spawn.Queue()
    racers = [spawn.Process(target=_race, args=(runs, barrier, results)) for _ in range(2)]
    for p in racers:
        p.start()
    outcomes = [results.get(timeout=180)[1] for _ in racers]
    for p in racers:
        p.join()
        assert p.exitcode == 0
    assert all(isinstance(o, list) for o in outcomes), outcomes
    assert all(a != b for a, b in zip(*outcomes, strict=True)), outcomes
    assert all(lock_files(run) == [] for run in runs)


# ------------------------------------------------------------------ real launches


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_second_launch_refused_killed_launcher_stops_workers_restart_takes_over(
    tiny_data, tmp_path
):
    run = tmp_path / "run"
    args = tiny_overrides(
        tiny_data,
        run,
        **{
            "train.steps": 100_000,
            "train.log_interval": 1,
            "train.val_interval": 0,
            "checkpoint.interval": 10,
            "checkpoint.keep": 2,
        },
    )
    log = (tmp_path / "torchrun.log").open("w")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            TRAIN,
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(),
        start_new_session=True,
    )
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists(), 120, "training to start")
        workers = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, check=False
            ).stdout.split()
        ]
        assert len(workers) == 2, workers

        # a second job on the live run directory: one line naming the holder, exit code 2
        second = subprocess.run(
            [sys.executable, TRAIN, *args], capture_output=True, text=True, env=_env(), timeout=120
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        last = second.stderr.strip().splitlines()[-1]
        m = re.fullmatch(
            rf"error: {re.escape(str(run))} is in use by job on host "
            rf"{re.escape(socket.gethostname())} \(pid (\d+), launcher pid "
            rf"{launcher.pid}\) since .* UTC; stop it or choose another "
            r"train\.run_dir",
            last,
        )
        assert m and int(m[1]) in workers, last

        # SIGKILL the launcher alone, away from a checkpoint save
        _wait_for(lambda: 3 <= len(read_records(run)) % 10 <= 6, 60, "a step between saves")
        os.kill(launcher.pid, signal.SIGKILL)
        records, saved = len(read_records(run)), checkpoint_dirs(run)
        # left alone they would train on; they stop without another write but the one whose
        # check of the launcher came before the kill (rank 0 may be appending it right now)
        _wait_for(lambda: not any(_alive(w) for w in workers), 60, "the workers to stop")
        assert records <= len(read_records(run)) <= records + 1
        assert checkpoint_dirs(run) == saved and saved
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert output.count(f"stopped: its launcher (pid {launcher.pid}) is gone") == 2, output[-3000:]

    # a restart takes over the dead job's lock and completes
    step = saved[-1][0]
    restart = subprocess.run(
        [sys.executable, TRAIN, *args, f"train.steps={step + 2}"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert restart.returncode == 0, restart.stderr[-3000:]
    notice = [line for line in restart.stderr.splitlines() if line.startswith("notice:")]
    assert len(notice) == 1 and notice[0].startswith(f"notice: taking over {run} from the job")
    assert notice[0].endswith("has ended"), notice
    assert f"resumed from step {step}" in restart.stdout
    assert [r["step"] for r in read_records(run)][-2:] == [step + 1, step + 2]
    assert lock_files(run) == []


# A torchrun worker on a rank other than 0 whose launcher exits; the moment it sees that, it
# fails as a collective fails when its peer has stopped.
WORKER = """
import os, sys, time
from pathlib import Path
from srtrain.rundir_lock import own_run_dir
run_dir, ready = sys.argv[1], Path(sys.argv[2])
with own_run_dir(run_dir, rank=1):
    launcher = os.getppid()
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").rename(ready)
    while os.getppid() == launcher:
        time.sleep(0.001)
    raise RuntimeError("Connection reset by peer")
"""
LAUNCHER = """
import os, subprocess, sys, time
worker, run_dir, ready, stderr = sys.argv[1:5]
env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
with open(stderr, "w") as err:
    subprocess.Popen([sys.executable, "-c", worker, run_dir, ready], stderr=err, env=env)
while not os.path.exists(ready):
    time.sleep(0.01)
os._exit(0)
"""


def test_a_rank_failing_after_its_launcher_died_says_why(tmp_path):
    """The error a rank meets once its launcher is gone (a peer that stopped breaks its
    collective) ends it with the watchdog's one line, not the collective's traceback."""
    ready, stderr = tmp_path / "ready", tmp_path / "worker.err"
    subprocess.run(
        [sys.executable, "-c", LAUNCHER, WORKER, str(tmp_path / "run"), str(ready), str(stderr)],
        env=_env(),
        check=True,
        timeout=120,
    )
    worker = int(ready.read_text())
    _wait_for(lambda: not _alive(worker), 60, "the worker to stop")
    text = stderr.read_text()
    assert "Traceback" not in text, text
    assert re.fullmatch(
        rf"error: process {worker} stopped: its launcher \(pid \d+\) is gone; "
        "nothing more is written",
        text.strip().splitlines()[-1],
    ), text
