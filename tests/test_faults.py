"""Fault injection: full disks, kills at named points, torn and forged files, path escapes,
lost peers and signals. Each case asserts one line (no traceback), nothing lost (metrics
history, a loadable checkpoint) and, where a resume is promised, a bitwise continuation.

With ``SRTRAIN_FAULTS_RESULTS=<file>`` every case appends what it observed to that JSON-lines
file (before asserting, :mod:`fault_record`); ``python tools/faults_table.py <file>`` renders
docs/faults.md's table, with tests/test_user_faults.py's cases.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from srtrain.checkpoint import (
    CHECKPOINTS_DIR,
    MANIFEST,
    MARKER,
    CheckpointManager,
    CorruptCheckpointError,
    latest,
    load,
    load_latest_valid,
    verify,
)
from srtrain.errors import lost_peer
from srtrain.faultpoints import FAULT_ENV
from srtrain.metrics import (
    METRICS_FILE,
    MetricsLogger,
    append_records,
    read_records,
    trim_records,
)
from srtrain.models import build_model, init_weights
from srtrain.nospace import NoSpaceError, out_of_space
from srtrain.optim import SRAdamW
from srtrain.resume import trainer_state_problem

from conftest import tiny_overrides
from distributed import free_port, worker_env
from fault_record import one_error_line, record
from forged import forge

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train")
LIMIT = 1 << 20  # a file size limit below one checkpoint file of the runs here (~4 MiB)
TB_LIMIT = 8 << 10  # above config.yaml, below a few steps' TensorBoard events


# ------------------------------------------------------------------ in-process helpers

VOCAB, SEQ = 64, 8
TRAINER_EXTRA = {
    "loader": {"split": "train", "seed": 0, "seq_len": SEQ, "num_windows": 10, "position": 4},
    "resets": {
        "age_m": 1,
        "age_v": 1,
        "window_m": 0,
        "window_v": 0,
        "window_elements": 0,
        "window_steps": 0,
    },
}


def _model_and_optimizer(seed: int = 3):
    model = build_model("llama-tiny", VOCAB, SEQ, device="cpu")
    init_weights(model, seed)
    return model, SRAdamW(model.parameters(), lr=1e-2, backend="torch")


def _step(model, optimizer, step: int) -> None:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _saved(run_dir: Path, steps=(1, 2)) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints of one run at ``steps`` with the trainer's extra; its parameters at each."""
    model, optimizer = _model_and_optimizer()
    params = {}
    with CheckpointManager(run_dir, keep=5) as manager:
        for step in steps:
            _step(model, optimizer, step)
            manager.save(step, model, optimizer, {**TRAINER_EXTRA, "step": step})
            params[step] = _params(model)
    return params


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run dir with checkpoints at steps 1 and 2 (saved once per module), and its
    parameters at each; tests forge copies of it (:func:`copy_of`)."""
    run_dir = tmp_path_factory.mktemp("two_checkpoints")
    return run_dir, _saved(run_dir)


def copy_of(two_checkpoints, tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    source, params = two_checkpoints
    shutil.copytree(source, tmp_path / "run")
    return tmp_path / "run", params


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """This process's file size limit (``ulimit -f``) lowered to ``limit`` bytes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _forge(path: Path, name: str, change: Callable[[dict], None]) -> None:
    """Change a checkpoint's JSON file and recompute its entry in COMPLETE, as a forger would."""
    value = json.loads((path / name).read_text())
    change(value)
    forge(path, name, json.dumps(value).encode())


# ------------------------------------------------------------------ full disk, in process


def test_out_of_space_is_recognised_in_the_forms_torch_gives_it():
    """ENOSPC, EDQUOT and EFBIG, torch.save's short write and DCP's gathered failures are out
    of space; other errors are not."""
    from torch.distributed.checkpoint.api import CheckpointException

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert out_of_space(OSError(errno.EFBIG, "File too large"))
    assert out_of_space(CheckpointException("write", {1: (short, None)}))
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"))
    assert not out_of_space(CheckpointException("write", {0: (ValueError("x"), None)}))


def test_full_disk_at_a_save_leaves_the_previous_checkpoint(tmp_path):
    """A save past the file size limit: NoSpaceError naming the directory, what it needed and
    the limit; its temporary directory removed, the previous checkpoint the newest, loadable
    bit for bit."""
    params = _saved(tmp_path, steps=(1,))
    model, optimizer = _model_and_optimizer()
    with CheckpointManager(tmp_path, keep=5) as manager:
        _step(model, optimizer, 1)
        _step(model, optimizer, 2)
        with file_size_limit(LIMIT), pytest.raises(NoSpaceError) as info:
            manager.save(2, model, optimizer, {**TRAINER_EXTRA, "step": 2})
    message = str(info.value)
    pattern = (
        rf"no space left on {re.escape(str(tmp_path / CHECKPOINTS_DIR))}: [\d.]+ MiB needed, "
        r"1\.0 MiB allowed per file by the file size limit \(ulimit -f\); raise it"
    )
    left = sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir())
    restored, _ = _model_and_optimizer(seed=9)
    found = load_latest_valid(tmp_path, restored, None, log=print)
    lost = left != ["step-1"] or found is None or found[0] != 1
    wrong = not lost and any(not torch.equal(p, params[1][n]) for n, p in _params(restored).items())
    record(
        "disk full: checkpoint save",
        one_line="\n" not in message and re.match(pattern, message) is not None,
        traceback=False,
        silent_wrong=wrong,
        lost=lost,
    )


def test_full_disk_in_the_metrics_writers_is_one_line(tmp_path, capfd):
    """metrics.jsonl appended or trimmed, and TensorBoard events (its writer thread included)
    past the file size limit: NoSpaceError naming the file, no thread traceback, the history
    as it was."""
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 4)]
    append_records(tmp_path, records)
    before = (tmp_path / METRICS_FILE).read_bytes()
    size = len(before)
    full = pytest.raises(NoSpaceError, match=rf"^no space left on .*{METRICS_FILE}: 0\.0 MiB")
    with file_size_limit(size + 10), full:
        append_records(tmp_path, [{"step": s, "loss": 0.5, "pad": "x" * 40} for s in (4, 5)])
    appended_lost = read_records(tmp_path)[:3] != records
    (tmp_path / METRICS_FILE).write_bytes(before)
    full = pytest.raises(NoSpaceError, match=rf"^no space left on .*{METRICS_FILE}")
    with file_size_limit(size // 2), full:
        trim_records(tmp_path, 2)
    trimmed_lost = (tmp_path / METRICS_FILE).read_bytes() != before or any(
        p.name.endswith(".tmp") for p in tmp_path.iterdir()
    )
    record(
        "disk full: metrics.jsonl",
        one_line=True,
        traceback=False,
        silent_wrong=False,
        lost=appended_lost or trimmed_lost,
    )

    capfd.readouterr()
    logger = MetricsLogger(tmp_path / "run", 0, flush_secs=1)
    with file_size_limit(200), pytest.raises(NoSpaceError) as info, logger:
        for step in range(1, 200):
            logger.log_step(step, {"loss": 1.0, "lr": 1e-3})
    err = capfd.readouterr().err
    record(
        "disk full: TensorBoard writer",
        one_line=str(info.value).startswith(f"no space left on {tmp_path / 'run' / 'tb'}: ")
        and "\n" not in str(info.value),
        traceback="Traceback" in err or "Exception in thread" in err,
        silent_wrong=False,
        lost=False,
    )


# ------------------------------------------------------------------ forged and torn files


def _params_entry_without_shape(manifest: dict) -> None:
    del next(iter(manifest["params"].values()))["shape"]


FORGERIES = {
    "manifest without params": (MANIFEST, lambda m: m.pop("params"), "has no params"),
    "manifest params entry without shape": (
        MANIFEST,
        _params_entry_without_shape,
        r"has params\.\S+ malformed",
    ),
    "manifest optimizer_state a string": (
        MANIFEST,
        lambda m: m.update(optimizer_state="yes"),
        "has optimizer_state of type str",
    ),
    "manifest extra without loader": (
        MANIFEST,
        lambda m: m["extra"].pop("loader"),
        r"has extra\.loader missing",
    ),
    "manifest extra position a string": (
        MANIFEST,
        lambda m: m["extra"]["loader"].update(position="4"),
        r"has extra\.loader\.position of type str",
    ),
    "manifest extra a list": (MANIFEST, lambda m: m.update(extra=[1]), "has extra of type list"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_manifest_is_corrupt_and_falls_back(two_checkpoints, tmp_path, forgery):
    """A manifest whose COMPLETE hashes were recomputed but whose fields are missing or of the
    wrong type: corrupt (one line), never a KeyError or TypeError; the previous checkpoint is
    loaded bit for bit instead."""
    run_dir, params = copy_of(two_checkpoints, tmp_path)
    newest = run_dir / CHECKPOINTS_DIR / "step-2"
    name, change, message = FORGERIES[forgery]
    _forge(newest, name, change)
    model, optimizer = _model_and_optimizer(seed=9)
    with pytest.raises(CorruptCheckpointError) as info:
        load(newest, model, optimizer, check_extra=trainer_state_problem)
    lines: list[str] = []
    found = load_latest_valid(
        run_dir, model, optimizer, log=lines.append, check_extra=trainer_state_problem
    )
    wrong = found is None or found[0] != 1
    wrong = wrong or any(not torch.equal(p, params[1][n]) for n, p in _params(model).items())
    record(
        f"forged: {forgery}",
        one_line="\n" not in str(info.value)
        and re.search(message, str(info.value)) is not None
        and len(lines) == 1
        and lines[0].endswith("resuming from step-1 instead"),
        traceback=False,
        silent_wrong=wrong,
        lost=False,
    )


MARKER_FORGERIES = {
    "marker entry without sha256": lambda files: files["rank-0.json"].pop("sha256"),
    "marker names a file outside": lambda files: files.update(
        {"../../escape": {"bytes": 1, "sha256": "0" * 64}}
    ),
    "marker bytes a string": lambda files: files["rank-0.json"].update(bytes="12"),
}


@pytest.mark.parametrize("forgery", list(MARKER_FORGERIES))
def test_forged_marker_is_corrupt_and_falls_back(two_checkpoints, tmp_path, forgery):
    """A COMPLETE marker with an entry that is malformed or names a file outside its
    directory: corrupt in one line (no file outside is read); the previous one loads."""
    run_dir, _ = copy_of(two_checkpoints, tmp_path)
    newest = run_dir / CHECKPOINTS_DIR / "step-2"
    marker = json.loads((newest / MARKER).read_text())
    MARKER_FORGERIES[forgery](marker["files"])
    (newest / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CorruptCheckpointError) as info:
        verify(newest)
    lines: list[str] = []
    model, optimizer = _model_and_optimizer(seed=9)
    found = load_latest_valid(run_dir, model, optimizer, log=lines.append)
    record(
        f"escape/forged: {forgery}",
        one_line="\n" not in str(info.value) and "malformed" in str(info.value) and len(lines) == 1,
        traceback=False,
        silent_wrong=found is None or found[0] != 1,
        lost=False,
    )


@pytest.mark.parametrize("torn", ["checkpoint file cut short", "metrics.jsonl last line cut"])
def test_torn_files_fall_back_and_keep_the_history(two_checkpoints, tmp_path, torn):
    """A checkpoint file cut short falls back to the previous checkpoint in one line; a
    metrics.jsonl whose last line was cut keeps every whole record, with one notice."""
    if torn == "checkpoint file cut short":
        run_dir, params = copy_of(two_checkpoints, tmp_path)
        data = run_dir / CHECKPOINTS_DIR / "step-2" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        lines: list[str] = []
        model, optimizer = _model_and_optimizer(seed=9)
        found = load_latest_valid(run_dir, model, optimizer, log=lines.append)
        wrong = found is None or found[0] != 1
        wrong = wrong or any(not torch.equal(p, params[1][n]) for n, p in _params(model).items())
        record(
            f"torn: {torn}",
            one_line=len(lines) == 1 and "truncated or overwritten" in lines[0],
            traceback=False,
            silent_wrong=wrong,
            lost=False,
        )
        return
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 5)]
    append_records(tmp_path, records)
    path = tmp_path / METRICS_FILE
    path.write_bytes(path.read_bytes()[:-7])
    notes: list[str] = []
    kept = read_records(tmp_path, log=notes.append)
    record(
        f"torn: {torn}",
        one_line=len(notes) == 1 and "cut short by a killed writer" in notes[0],
        traceback=False,
        silent_wrong=kept != records[:3],
        lost=kept[:3] != records[:3],
    )


def test_lost_peer_is_recognised_in_the_backends_words():
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:17300. This is typically caused by a remote worker crashing."
    )
    assert lost_peer(gloo) == "Connection closed by peer"
    assert lost_peer(ValueError("shapes differ")) is None


# ------------------------------------------------------------------ whole runs

RUN = {
    "train.steps": 6,
    "train.log_interval": 1,
    "train.val_interval": 0,
    "checkpoint.interval": 2,
    "checkpoint.keep": 3,
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **extra,
    )
    for key in (FAULT_ENV, "SRTRAIN_DEBUG"):
        if key not in extra:
            env.pop(key, None)
    return env


def _fault(point: str | None) -> dict[str, str]:
    return {FAULT_ENV: point} if point else {}


def _limit_files(limit: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(
        resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
    )


def train(
    args: list[str], fault: str | None = None, limit: int | None = None
) -> subprocess.CompletedProcess:
    """``train`` in one process, killed at ``fault`` (SRTRAIN_FAULT_AT) or under a file size
    limit of ``limit`` bytes."""
    return subprocess.run(
        [sys.executable, TRAIN, *args],
        capture_output=True,
        text=True,
        env=_env(**_fault(fault)),
        preexec_fn=_limit_files(limit) if limit else None,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> list[dict]:
    """The records of the uninterrupted run every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    done = train(tiny_overrides(tiny_data, run_dir, **RUN))
    assert done.returncode == 0, done.stderr[-3000:]
    return read_records(run_dir)


def _temporaries(run_dir: Path) -> list[str]:
    root = run_dir / CHECKPOINTS_DIR
    return [p.name for p in root.iterdir() if ".tmp-" in p.name] if root.is_dir() else []


@pytest.mark.slow
def test_kills_inside_a_save_and_a_trim_then_a_full_disk_resume_bit_for_bit(
    tiny_data, tmp_path, reference
):
    """One run dir through three faults: SIGKILL inside the save of step 4 (step-2 stays the
    newest, the history to step 4 intact), SIGKILL inside the restart's metrics trim (the old
    history intact), a restart whose save of step 4 meets a full disk (one line, exit 2,
    nothing half-written left); then a restart continues as the uninterrupted run, bit for
    bit."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_data, run_dir, **RUN)

    killed = train(args, fault="save:2")
    history = read_records(run_dir)
    record(
        "kill: inside a save",
        one_line=None if killed.returncode == -signal.SIGKILL else False,
        traceback="Traceback" in killed.stderr,
        silent_wrong=latest(run_dir).name != "step-2" or not _temporaries(run_dir),
        lost=history != reference[:4],
    )

    killed = train(args, fault="metrics-trim")
    record(
        "kill: inside the metrics trim",
        one_line=None if killed.returncode == -signal.SIGKILL else False,
        traceback="Traceback" in killed.stderr,
        silent_wrong=latest(run_dir).name != "step-2",
        lost=read_records(run_dir) != history,
    )

    full = train(args, limit=LIMIT)
    left = latest(run_dir)
    record(
        "disk full: a run's save",
        one_line=one_error_line(full.stderr, full.returncode)
        and f"no space left on {run_dir / CHECKPOINTS_DIR}: " in full.stderr,
        traceback="Traceback" in full.stderr,
        silent_wrong=bool(_temporaries(run_dir)),
        lost=left is None or left.name != "step-2" or verify(left) is None,
    )

    done = train(args)
    assert done.returncode == 0, done.stderr[-3000:]
    record(
        "resume after the faults",
        one_line=done.stderr == "" and "resumed from step 2 of" in done.stdout,
        traceback="Traceback" in done.stderr,
        silent_wrong=read_records(run_dir) != reference,
        lost=bool(_temporaries(run_dir)),
    )


@pytest.mark.slow
def test_kill_before_the_first_checkpoint_starts_afresh(tiny_data, tmp_path, reference):
    """SIGKILL as the first checkpoint is due: no checkpoint, the history logged so far kept;
    the restart starts afresh and reproduces the uninterrupted run."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_data, run_dir, **RUN)
    killed = train(args, fault="checkpoint")
    logged = read_records(run_dir)
    done = train(args)
    record(
        "kill: before the first checkpoint",
        one_line=None if killed.returncode == -signal.SIGKILL else False,
        traceback="Traceback" in killed.stderr + done.stderr,
        silent_wrong=done.returncode != 0 or read_records(run_dir) != reference,
        lost=logged != reference[:2],
    )


def two_ranks(
    args: list[str], faults: tuple[str | None, str | None] = (None, None), limits=(None, None)
) -> list[subprocess.CompletedProcess]:
    """``train`` on 2 gloo ranks, each its own process as torchrun starts them, with a fault
    point or file size limit of its own."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, TRAIN, *args],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(**worker_env(r, 2, port), **({FAULT_ENV: faults[r]} if faults[r] else {})),
            preexec_fn=_limit_files(limits[r]) if limits[r] else None,
        )
        for r in range(2)
    ]
    return [
        subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs
    ]


@pytest.mark.slow
def test_a_rank_that_lost_its_peer_says_so_in_one_line(tiny_data, tmp_path):
    """Rank 0's TensorBoard writer meets its file size limit: rank 0 prints the error, rank 1
    (whose next collective finds rank 0 gone) one line saying it lost its peer; exit 2 on
    both. Then rank 1 is killed as its second checkpoint is due: rank 0 says it lost its
    peer, the step-2 checkpoint stays the newest."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_data, run_dir, **RUN)
    lost_line = re.compile(r"rank (\d) lost its peer \([^)]+\): another rank's process ended")

    no_space, peer = two_ranks(
        [*args, "checkpoint.enabled=false", "train.steps=60"], limits=(TB_LIMIT, None)
    )
    record(
        "lost peer: after another rank's error",
        one_line=one_error_line(no_space.stderr, no_space.returncode)
        and f"no space left on {run_dir}/" in no_space.stderr
        and peer.returncode == 2
        and peer.stderr.count("\n") == 1
        and lost_line.match(peer.stderr) is not None,
        traceback="Traceback" in no_space.stderr + peer.stderr,
        silent_wrong=False,
        lost=False,
    )

    run_dir = tmp_path / "killed"
    peer, killed = two_ranks(
        tiny_overrides(tiny_data, run_dir, **RUN), faults=(None, "checkpoint:2")
    )
    left = latest(run_dir)
    record(
        "lost peer: another rank killed",
        one_line=killed.returncode == -signal.SIGKILL
        and peer.returncode == 2
        and peer.stderr.count("\n") == 1
        and lost_line.match(peer.stderr) is not None,
        traceback="Traceback" in peer.stderr + killed.stderr,
        silent_wrong=False,
        lost=left is None or left.name != "step-2" or verify(left) is None,
    )


# ------------------------------------------------------------------ signals


def _signalled(proc: subprocess.Popen, *signals: int) -> str:
    """Send the first signal once rank 0 logged step 2, the others once the stop is
    announced; the whole output once the process has ended."""
    lines, pending = [], list(signals)
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/") and pending:
            proc.send_signal(pending.pop(0))
        elif ": stopping after the step in flight" in line and pending:
            for signum in pending:
                proc.send_signal(signum)
            pending = []
    out, _ = proc.communicate(timeout=300)
    return "".join(lines) + out


SIGNAL_CASES = {
    "one process, SIGINT twice": (1, (signal.SIGINT, signal.SIGINT), 128 + signal.SIGINT),
    "2-rank torchrun, SIGINT": (2, (signal.SIGINT,), 128 + signal.SIGINT),
    "2-rank torchrun, SIGTERM then SIGINT": (
        2,
        (signal.SIGTERM, signal.SIGINT),
        128 + signal.SIGINT,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SIGNAL_CASES))
def test_signals_end_in_one_line_with_the_checkpoints_intact(tiny_data, tmp_path, case):
    """A signal stops the run with one line and no traceback; a second one at once; every
    checkpoint left is complete and the history matches them."""
    ranks, signals, code = SIGNAL_CASES[case]
    run_dir = tmp_path / "run"
    args = tiny_overrides(
        tiny_data, run_dir, **{**RUN, "train.steps": 1000, "checkpoint.interval": 500}
    )
    env = _env(GPUS=str(ranks), PYTHON=sys.executable)
    env.pop("TORCHRUN", None)
    command = (
        [str(REPO / "launch" / "single_node.sh"), *args]
        if ranks > 1
        else [sys.executable, TRAIN, *args]
    )
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    out = _signalled(proc, *signals)
    stops = [line for line in out.splitlines() if line.startswith("stopped")]
    left = latest(run_dir)
    history = [r["step"] for r in read_records(run_dir)]
    saved = left is not None and history[-1] == int(left.name.removeprefix("step-"))
    record(
        f"signal: {case}",
        one_line=proc.returncode == code and len(stops) >= 1 and len(set(stops)) == 1,
        traceback="Traceback" in out,
        silent_wrong=bool(_temporaries(run_dir)) and left is None,
        lost=not history
        or history != list(range(1, len(history) + 1))
        or (len(signals) == 1 and not saved),
    )
