"""Faults a user causes, met through the commands a user runs: non-finite or empty config
values, a device that is not there, malformed model configs and safetensors files, binary
YAML, forged or escaping checkpoint files, a broken data dir, a bad export, a run that skips
its steps, a deleted COMPLETE marker, ``checkpoint.load`` beside a run's own checkpoints.

Each case runs ``train`` or ``python -m srtrain`` in a process of its own, as a user would,
and records (:mod:`fault_record`) whether it ended in one line, showed a traceback, was
silently wrong (a run dir or output written by a refused start, a checkpoint used whose
bytes COMPLETE does not cover) or lost something (history, a checkpoint, progress).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from srtrain.checkpoint import CHECKPOINTS_DIR, MARKER, latest
from srtrain.data.meta import META_FILE
from srtrain.metrics import METRICS_FILE, read_records

from conftest import tiny_overrides
from fault_record import one_error_line, record
from forged import MALFORMED_SAFETENSORS, forge, metadata_pointing_at

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train")
RUN = {
    "train.steps": 4,
    "train.log_interval": 1,
    "train.val_interval": 0,
    "checkpoint.interval": 2,
    "checkpoint.keep": 3,
}

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for key in ("SRTRAIN_DEBUG", "SRTRAIN_FAULT_AT"):
        env.pop(key, None)
    return env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``args`` (a command line after the interpreter) in a process of its own, in ``cwd``."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )


def train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run([TRAIN, *args], cwd)


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (empty when absent), by relative path."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4; cases work on copies."""
    cwd = tmp_path_factory.mktemp("finished")
    done = train(tiny_overrides(tiny_data, cwd / "run", **RUN), cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / "run"


@pytest.fixture(scope="module")
def exported(finished, tmp_path_factory) -> Path:
    """The finished run exported as a Hugging Face model directory."""
    out = tmp_path_factory.mktemp("exported") / "hf"
    done = run(["-m", "srtrain", "export", str(finished), str(out)], out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


class Case:
    """What a case needs: a scratch dir, the shared data, a finished run and its export."""

    def __init__(self, tmp: Path, data: str, finished: Path, exported: Path) -> None:
        self.tmp, self.data, self.finished, self.exported = tmp, data, finished, exported

    def overrides(self, run_dir: Path | None = None, **extra) -> list[str]:
        return tiny_overrides(self.data, run_dir or self.tmp / "run", **{**RUN, **extra})

    def copy_run(self) -> Path:
        return Path(shutil.copytree(self.finished, self.tmp / "run"))

    def copy_model(self) -> Path:
        return Path(shutil.copytree(self.exported, self.tmp / "hf"))


# ------------------------------------------------------------------ refused starts


def _refused(case: Case, extra: list[str], expected: str, cwd: Path | None = None) -> dict:
    """A start refused in one ``error:`` line naming ``expected``, before the run dir (or
    the directory it runs in) holds anything."""
    cwd = cwd or case.tmp
    cwd.mkdir(exist_ok=True)
    before = tree(cwd)
    proc = train([*case.overrides(), *extra], cwd)
    return dict(
        one_line=one_error_line(proc.stderr, proc.returncode) and expected in proc.stderr,
        traceback="Traceback" in proc.stderr,
        silent_wrong=tree(cwd) != before,
        lost=False,
    )


NON_FINITE = {
    "optim.lr=.inf": "optim.lr: must be a finite number, got inf",
    "optim.lr=.nan": "optim.lr: must be a finite number, got nan",
    "optim.eps=.nan": "optim.eps: must be a finite number, got nan",
    "optim.weight_decay=.nan": "optim.weight_decay: must be a finite number",
    "optim.grad_clip=.nan": "optim.grad_clip: must be a finite number",
}


def _non_finite(value: str) -> Callable[[Case], dict]:
    return lambda case: _refused(case, [value], NON_FINITE[value])


def empty_run_dir(case: Case) -> dict:
    return _refused(case, ["train.run_dir="], "train.run_dir", cwd=case.tmp / "cwd")


def binary_yaml(case: Case) -> dict:
    config = case.tmp / "binary.yaml"
    config.write_bytes(b"\x00\xff\xfe\x80 not text")
    return _refused(case, ["--config", str(config)], str(config))


def cuda_without_cuda(case: Case) -> dict:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    return _refused(case, ["parallel.device=cuda"], "no CUDA device is available here")


def _hf_config(case: Case, **changes) -> Path:
    config = json.loads((case.exported / "config.json").read_text())
    config.update(changes)
    path = case.tmp / "config.json"
    path.write_text(json.dumps(config))
    return path


def hidden_size_a_string(case: Case) -> dict:
    path = _hf_config(case, hidden_size="big")
    return _refused(case, [f"model.hf_config={path}"], "hidden_size")


def hidden_size_not_divisible(case: Case) -> dict:
    path = _hf_config(case, hidden_size=130)
    return _refused(case, [f"model.hf_config={path}"], "hidden size (130)")


def mistyped_data_dir(case: Case) -> dict:
    typo = case.tmp / "data" / "bultin"
    return _refused(case, [f"data.dir={typo}"], f"data.dir {typo} does not exist")


def data_dir_without_meta(case: Case) -> dict:
    data = Path(shutil.copytree(case.data, case.tmp / "data"))
    (data / META_FILE).unlink()
    return _refused(case, [f"data.dir={data}"], f"data.dir {data} has no {META_FILE}")


WEIGHTS = "model.safetensors"


def _malformed_weights(kind: str) -> Callable[[Case], dict]:
    def case_(case: Case) -> dict:
        model = case.copy_model()
        (model / WEIGHTS).write_bytes(MALFORMED_SAFETENSORS[kind])
        return _refused(case, [f"model.init_from={model}"], "is not a readable safetensors file")

    return case_


def index_escape(case: Case) -> dict:
    """A safetensors index naming a file outside its directory (a copy of the real weights)."""
    model = case.copy_model()
    shard = "model-00001-of-00001.safetensors"
    (model / WEIGHTS).rename(model / shard)
    shutil.copy(model / shard, case.tmp / "outside.safetensors")
    with safe_open(model / shard, "pt") as weights:
        names = list(weights.keys())
    weight_map = {name: shard for name in names}
    weight_map[names[0]] = "../outside.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (model / f"{WEIGHTS}.index.json").write_text(json.dumps(index))
    return _refused(case, [f"model.init_from={model}"], "outside")


# ------------------------------------------------------------------ checkpoints


def _resumed_past(case: Case, run_dir: Path, passed_over: str) -> dict:
    """Resume ``run_dir`` to step 6: one line names the newest checkpoint as passed over
    (``passed_over`` in it), the run resumes from step 2 and its history runs 1..6."""
    proc = train(case.overrides(run_dir, **{"train.steps": 6}), case.tmp)
    notices = [line for line in proc.stdout.splitlines() if "is corrupt" in line]
    return dict(
        one_line=proc.returncode == 0
        and len(notices) == 1
        and passed_over in notices[0]
        and proc.stderr == "",
        traceback="Traceback" in proc.stderr,
        silent_wrong="resumed from step 2 of" not in proc.stdout,
        lost=[r["step"] for r in read_records(run_dir)] != list(range(1, 7)),
    )


def metadata_outside(case: Case) -> dict:
    """.metadata pointing every tensor at a copy outside the checkpoint, hashes recomputed."""
    run_dir = case.copy_run()
    newest = latest(run_dir)
    (case.tmp / "outside.distcp").write_bytes((newest / "__0_0.distcp").read_bytes())
    forge(newest, ".metadata", metadata_pointing_at(newest, "../../../outside.distcp"))
    return _resumed_past(case, run_dir, "outside the checkpoint")


def metadata_garbage(case: Case) -> dict:
    run_dir = case.copy_run()
    forge(latest(run_dir), ".metadata", b"\x80\x04garbage, not a pickle" * 8)
    return _resumed_past(case, run_dir, "is not DCP metadata")


def marker_deleted(case: Case) -> dict:
    """The newest checkpoint's COMPLETE deleted: one line says it is passed over, the run
    resumes from the one before, and no directory without a marker is left behind."""
    run_dir = case.copy_run()
    newest = latest(run_dir)
    (newest / MARKER).unlink()
    proc = train(case.overrides(run_dir, **{"train.steps": 6}), case.tmp)
    mentions = [line for line in proc.stdout.splitlines() if newest.name in line]
    left = sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir())
    return dict(
        one_line=proc.returncode == 0 and len(mentions) == 1 and proc.stderr == "",
        traceback="Traceback" in proc.stderr,
        silent_wrong="resumed from step 2 of" not in proc.stdout,
        lost=[r["step"] for r in read_records(run_dir)] != list(range(1, 7))
        or any(not (run_dir / CHECKPOINTS_DIR / name / MARKER).is_file() for name in left),
    )


def load_beside_own(case: Case) -> dict:
    """``checkpoint.load`` seeds a new run; started again, the run's own newest wins, with
    one line saying so, and no step is trained twice."""
    seed = case.finished / CHECKPOINTS_DIR / "step-2"
    run_dir = case.tmp / "seeded"
    args = [f"checkpoint.load={seed}"]
    first = train([*case.overrides(run_dir, **{"train.steps": 6}), *args], case.tmp)
    again = train([*case.overrides(run_dir, **{"train.steps": 8}), *args], case.tmp)
    said = [line for line in again.stdout.splitlines() if "checkpoint.load" in line]
    steps = [r["step"] for r in read_records(run_dir)]
    return dict(
        one_line=first.returncode == 0 and again.returncode == 0 and len(said) == 1,
        traceback="Traceback" in first.stderr + again.stderr,
        silent_wrong="resumed from step 6 of" not in again.stdout,
        lost=steps != list(range(3, 9)),
    )


def _garble(run_dir: Path) -> None:
    for step in (run_dir / CHECKPOINTS_DIR).iterdir():
        data = step / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))


def _command_refused(case: Case, args: list[str], out: Path, expected: str) -> dict:
    """A command refused in one ``error:`` line naming ``expected``, ``out`` not written."""
    proc = run(["-m", "srtrain", *args], case.tmp)
    return dict(
        one_line=one_error_line(proc.stderr, proc.returncode) and expected in proc.stderr,
        traceback="Traceback" in proc.stderr,
        silent_wrong=out.exists(),
        lost=False,
    )


def export_corrupt(case: Case) -> dict:
    run_dir = case.copy_run()
    _garble(run_dir)
    out = case.tmp / "out"
    args = ["export", str(run_dir), str(out)]
    return _command_refused(case, args, out, "does not match its sha256")


def export_bad_tokenizer(case: Case) -> dict:
    data = Path(shutil.copytree(case.data, case.tmp / "data"))
    (data / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    out = case.tmp / "out"
    args = ["export", str(case.finished), str(out), "--tokenizer", str(data)]
    return _command_refused(case, args, out, "is not a SentencePiece model")


def eval_corrupt(case: Case) -> dict:
    run_dir = case.copy_run()
    _garble(run_dir)
    args = ["eval", "--checkpoint", str(run_dir), "--data", case.data, "--device", "cpu"]
    return _command_refused(case, args, case.tmp / "none", "does not match its sha256")


# ------------------------------------------------------------------ runs that end badly


def skipped_steps(case: Case) -> dict:
    """optim.lr=1e3: every step after the first skipped for a non-finite gradient norm; one
    warning line and exit 3; metrics.jsonl strict JSON."""
    run_dir = case.tmp / "run"
    proc = train(case.overrides(run_dir, **{"optim.lr": 1000.0, "train.steps": 6}), case.tmp)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]

    def refuse(token: str) -> None:
        raise ValueError(token)

    try:
        for line in (run_dir / METRICS_FILE).read_text().splitlines():
            json.loads(line, parse_constant=refuse)
        strict = True
    except ValueError:
        strict = False
    return dict(
        one_line=proc.returncode == 3 and len(warnings) == 1 and len(proc.stderr.splitlines()) == 1,
        traceback="Traceback" in proc.stderr,
        silent_wrong=not strict,
        lost=[r["step"] for r in read_records(run_dir)] != list(range(1, 7)),
    )


CASES: dict[str, Callable[[Case], dict]] = {
    **{f"config: {value}": _non_finite(value) for value in NON_FINITE},
    "config: train.run_dir empty": empty_run_dir,
    "config: a binary YAML file": binary_yaml,
    "config: parallel.device=cuda without CUDA": cuda_without_cuda,
    "model: hf_config hidden_size a string": hidden_size_a_string,
    "model: hf_config hidden_size not divisible by the heads": hidden_size_not_divisible,
    **{
        f"model: model.safetensors {kind}": _malformed_weights(kind)
        for kind in MALFORMED_SAFETENSORS
    },
    "escape: a safetensors index names a file outside": index_escape,
    "escape: .metadata points outside the checkpoint": metadata_outside,
    "forged: .metadata not a pickle": metadata_garbage,
    "data: data.dir mistyped": mistyped_data_dir,
    "data: meta.json deleted": data_dir_without_meta,
    "export: every checkpoint corrupt": export_corrupt,
    "export: a tokenizer that is not one": export_bad_tokenizer,
    "eval: every checkpoint corrupt": eval_corrupt,
    "quiet: COMPLETE marker deleted": marker_deleted,
    "quiet: most steps skipped": skipped_steps,
    "restart: checkpoint.load beside the run's own checkpoints": load_beside_own,
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_user_fault_is_one_line_and_loses_nothing(name, tmp_path, tiny_data, finished, exported):
    record(name, **CASES[name](Case(tmp_path, tiny_data, finished, exported)))
