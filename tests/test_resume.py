"""Fault tolerance with real processes: SIGKILL and resume bit for bit, resharded resume,
torchrun --max-restarts recovering a killed rank, restarts that keep one history and let a
run's own checkpoints win over checkpoint.load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from srtrain.checkpoint import latest
from srtrain.metrics import read_records

from conftest import tiny_overrides
from tb_server import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train")
pytestmark = pytest.mark.slow


def overrides(data: str, run_dir: Path, **extra) -> list[str]:
    values = {
        "train.steps": 24,
        "train.log_interval": 1,
        "train.val_interval": 0,
        "checkpoint.interval": 4,
        "checkpoint.keep": 3,
        "optim.m_format": "fp8",
        "optim.v_format": "fp4",
        "resets.mode": "adaptive",
        "resets.threshold": 0.3,
        "resets.window": 3,
        "resets.min_age": 5,
        "train.global_batch_size": 6,
    }
    values.update(extra)
    return tiny_overrides(data, run_dir, **values)


def torchrun(nproc: int, args: list[str], max_restarts: int = 0) -> subprocess.Popen:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        str(max_restarts),
        TRAIN,
        *args,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_at_step(proc: subprocess.Popen, step: int) -> str:
    """SIGKILL the whole job once rank 0 has logged ``step``."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {step}/"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    return "".join(seen)


def kill_during_save(proc: subprocess.Popen, run_dir: Path) -> bool:
    """SIGKILL the job while a checkpoint is being written; False if no save was caught."""
    ckpt_dir = run_dir / "checkpoints"
    while proc.poll() is None:
        if ckpt_dir.is_dir() and any(".tmp-" in e.name for e in os.scandir(ckpt_dir)):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            return True
        time.sleep(0.0005)
    return False


def test_sigkill_at_random_steps_resumes_bit_for_bit(tiny_data, tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    finish(torchrun(2, overrides(tiny_data, ref_dir)))
    reference = read_records(ref_dir)
    assert [r["step"] for r in reference] == list(range(1, 25))

    args = overrides(tiny_data, run_dir)
    kill_at_step(torchrun(2, args), 7)  # between checkpoints 4 and 8
    assert latest(run_dir).name == "step-4"
    caught = False
    for _ in range(3):  # a save takes milliseconds: try a few times to land inside one
        before = latest(run_dir)
        caught = kill_during_save(torchrun(2, args), run_dir)
        if caught:
            assert latest(run_dir) is not None and latest(run_dir).name.startswith("step-")
            assert any(".tmp-" in p.name for p in (run_dir / "checkpoints").iterdir())
            assert before is None or int(latest(run_dir).name[5:]) >= int(before.name[5:])
            break
    assert caught, "no save was interrupted"
    step_now = int(latest(run_dir).name[5:])
    if step_now < 20:
        kill_at_step(torchrun(2, args), min(step_now + 5, 22))
    out = finish(torchrun(2, args))
    assert "resumed from step" in out
    assert not any(".tmp-" in p.name for p in (run_dir / "checkpoints").iterdir())
    assert read_records(run_dir) == reference


def test_resharded_resume_continues_closely(tiny_data, tmp_path):
    """A 2-rank run killed after its step-8 checkpoint continues on 1 rank and on 3 (3 shards
    split the 512-row vocabulary unevenly), close to uninterrupted runs on those ranks."""
    kw = {"train.steps": 12, "resets.mode": "none"}
    killed = tmp_path / "killed"
    kill_at_step(torchrun(2, overrides(tiny_data, killed, **kw)), 10)
    assert latest(killed).name == "step-8"
    for after in (1, 3):
        ref_run, run = tmp_path / f"ref{after}", tmp_path / f"reshard2to{after}"
        finish(torchrun(after, overrides(tiny_data, ref_run, **kw)))
        shutil.copytree(killed, run)
        out = finish(torchrun(after, overrides(tiny_data, run, **kw)))
        assert "resumed from step 8" in out
        got, ref = read_records(run), read_records(ref_run)
        assert [r["step"] for r in got] == list(range(1, 13))
        for g, r in zip(got[8:], ref[8:], strict=True):
            assert abs(g["loss"] - r["loss"]) < 0.05, (after, g, r)


def test_torchrun_restarts_a_killed_rank_from_the_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "restart"
    proc = torchrun(2, overrides(tiny_data, run), max_restarts=1)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 10/"):
            workers = subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
            ).stdout.split()
            assert workers, "no worker processes found"
            os.kill(int(workers[-1]), signal.SIGKILL)
            break
    out = "".join(lines) + finish(proc)
    assert "resumed from step 8" in out
    records = read_records(run)
    assert [r["step"] for r in records] == list(range(1, 25))


# ------------------------------------------------------------------ restarts and signals


def one_process(args: list[str]) -> subprocess.Popen:
    """``train`` in one process, in its own session."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.Popen(
        [sys.executable, TRAIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def test_restarts_keep_one_history_and_checkpoint_load_only_seeds(tiny_data, tmp_path):
    """A run killed before its first checkpoint starts its history afresh; one seeded with
    checkpoint.load restarts from its own later checkpoint, and once finished stays so."""
    seed_run, run = tmp_path / "seed", tmp_path / "run"
    seed_args = overrides(tiny_data, seed_run, **{"train.steps": 6, "checkpoint.interval": 0})
    kill_at_step(one_process(seed_args), 3)
    assert latest(seed_run) is None and len(read_records(seed_run)) >= 2
    finish(one_process(seed_args))
    assert [r["step"] for r in read_records(seed_run)] == list(range(1, 7))

    seed = seed_run / "checkpoints" / "step-6"
    args = overrides(
        tiny_data,
        run,
        **{"train.steps": 12, "checkpoint.interval": 2, "checkpoint.load": str(seed)},
    )
    out = kill_at_step(one_process(args), 9)
    assert f"started from {seed} (step 6): {run} has no usable checkpoint of its own yet\n" in out
    assert latest(run).name == "step-8"
    out = finish(one_process(args))
    assert (
        f"resumed from step 8 of {run} (its own newest checkpoint: checkpoint.load={seed} "
        "seeds a run only before its first checkpoint)\n"
    ) in out
    assert [r["step"] for r in read_records(run)] == list(range(7, 13))
    again = finish(one_process(args))
    assert f"{run} already finished its 12 steps (checkpoint step-12)" in again
    assert [r["step"] for r in read_records(run)] == list(range(7, 13))
