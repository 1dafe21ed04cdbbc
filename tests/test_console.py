"""What a run says: ETA arithmetic, the closing line, a finished run started again, a resumed
run's metrics.jsonl with validation losses, the vocabulary taken from the prepared dir, and
the starts refused before step 1."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from srtrain.checkpoint import checkpoint_dirs
from srtrain.cli import main
from srtrain.console import RunClock, StepProgress, format_duration
from srtrain.data import load_meta, prepare
from srtrain.metrics import read_records
from srtrain.rundir import finished_message

from conftest import tiny_overrides


def test_durations_and_progress_fields() -> None:
    assert [format_duration(s) for s in (0, 41.9, 570, 3600 * 27 + 5)] == [
        "0:00:00",
        "0:00:41",
        "0:09:30",
        "27:00:05",
    ]
    assert StepProgress(300, 41.0, 570.0).parts(20) == [
        "step 20/300",
        "0:00:41 elapsed, ETA 0:09:30",
    ]
    assert StepProgress(300).parts(20) == ["step 20/300"]
    assert StepProgress(300, 5.0, None).parts(0) == ["step 0/300", "0:00:05 elapsed, ETA n/a"]


def test_eta_leaves_out_the_first_interval() -> None:
    clock = RunClock(start_step=100, total=300, now=1000.0)
    # the first interval (10 steps, 30 s with compilation) is all there is: 3 s a step
    first = clock.progress(110, now=1030.0)
    assert (first.total, first.elapsed_s, first.eta_s) == (300, 30.0, 190 * 3.0)
    # later: 20 steps in 10 s since step 110, 0.5 s a step, whatever the first interval took
    later = clock.progress(130, now=1040.0)
    assert (later.elapsed_s, later.eta_s) == (40.0, 170 * 0.5)
    assert clock.progress(300, now=1125.0).eta_s == 0.0
    assert clock.elapsed(now=1200.0) == 200.0


def test_finished_message_names_the_ways_on() -> None:
    assert finished_message("runs/tiny", 300, 300) == (
        "runs/tiny already finished its 300 steps (checkpoint step-300); to train longer: run "
        "again with train.steps=600 (same run dir; the learning-rate schedule stretches to the "
        "new length); to start fresh: remove runs/tiny or set train.run_dir"
    )
    assert finished_message("r", 200, 300).startswith(
        "r is already at step 300, past train.steps=200 (checkpoint step-300)"
    )


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under the run dir with its size and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
    }


def test_run_resume_and_finished_run_in_process(tiny_data, tmp_path, capsys) -> None:
    """./train's main three times in one process: a 4-step run (checkpoints at 2 and 4), the
    same run resumed from step 2 (metrics.jsonl rewritten bit for bit, validation losses
    included), then a start of the finished run, which changes nothing."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(
        tiny_data,
        run_dir,
        **{
            "train.steps": 4,
            "train.log_interval": 2,
            "train.val_interval": 2,
            "checkpoint.interval": 2,
            "train.global_batch_size": 4,
            "model.seq_len": 32,
        },
    )
    args = [a for a in args if not a.startswith("data.vocab_size=")]  # the dir's: 512
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert re.match(r"step 2/4 \| \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d \| loss ", steps[0])
    assert "mfu n/a" in steps[0] and steps[1].startswith("step 2/4 | val loss ")
    assert re.fullmatch(r"\d+:\d\d:\d\d;", out[-1].split()[4])
    assert out[-1] == (
        f"done: 4 steps in {out[-1].split()[4][:-1]}; run dir {run_dir}; last "
        f"checkpoint {run_dir / 'checkpoints' / 'step-4'}; curves: "
        f"tensorboard --logdir {run_dir / 'tb'}"
    )
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert float(steps[-1].split()[-1]) == pytest.approx(records[-1]["val_loss"], abs=5e-5)
    manifest = json.loads((dict(checkpoint_dirs(run_dir))[4] / "checkpoint.json").read_text())
    assert manifest["model"]["vocab_size"] == 512

    shutil.rmtree(dict(checkpoint_dirs(run_dir))[4])  # as if killed after step 2's save
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"resumed from step 2 of {run_dir}" in out
    assert out[-1].startswith("done: steps 3-4 in ")
    assert read_records(run_dir) == records

    before = _files(run_dir)
    assert main(args) == 0
    assert capsys.readouterr().out == finished_message(run_dir, 4, 4) + "\n"
    assert _files(run_dir) == before

    # another run dir from its last checkpoint, with no step left to train: refused at start
    other = tmp_path / "other"
    step4 = dict(checkpoint_dirs(run_dir))[4]
    assert main([*args, f"train.run_dir={other}", f"checkpoint.load={step4}"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint.load: {step4} is at step 4, which leaves nothing of train.steps=4 "
        "to train; set train.steps above 4\n"
    )
    assert not other.exists() and _files(run_dir) == before


def _refused(args: list[str], capsys) -> str:
    """The one line of a start that ``main`` refuses (exit code 2), with nothing on stdout
    but data notices."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert all(line.startswith("data: ") for line in captured.out.splitlines()), captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    return captured.err.removeprefix("error: ").rstrip("\n")


def test_data_that_would_fail_a_run_late_is_refused_at_start(
    tiny_data, tmp_path, capsys, monkeypatch
) -> None:
    """A mistyped data.dir is not prepared from the default corpus, and a validation split
    without one window of model.seq_len is refused before the run starts (the run dir is not
    created); with validation off the same data trains."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_data, run_dir, **{"train.steps": 1, "train.global_batch_size": 2})
    typo = [*args, "data.dir=data/bultin"]
    assert _refused(typo, capsys) == (
        "data.dir data/bultin does not exist; set data.source to prepare it there (builtin, "
        "packages, a Hugging Face dataset or files), or fix the path"
    )
    assert list(tmp_path.iterdir()) == []

    # 20 documents of about 100 tokens; one is held out: a val split shorter than 128 tokens
    source = tmp_path / "docs.jsonl"
    words = ["def", "value", "return", "self", "import", "while"]
    source.write_text(
        "".join(
            json.dumps({"text": " ".join(words[(i + j) % 6] for j in range(40))}) + "\n"
            for i in range(20)
        )
    )
    data = prepare(
        source, tmp_path / "short", tokenizer=f"{tiny_data}/tokenizer.model", val_fraction=0.05
    )
    val_tokens = load_meta(data).splits["val"].num_tokens
    assert 0 < val_tokens <= 128 < load_meta(data).splits["train"].num_tokens // 4
    short = [*args, f"data.dir={data}", "model.seq_len=128"]
    assert _refused(short, capsys) == (
        f"split 'val' of {data} has {val_tokens} tokens, not one window of "
        f"model.seq_len=128 (it needs 129); lower model.seq_len, prepare the data again with a "
        f"larger data.val_fraction (delete {data} or choose another data.dir), or set "
        "train.val_interval=0"
    )
    assert not run_dir.exists()
    assert main([*short, "train.val_interval=0", "checkpoint.enabled=false"]) == 0
    assert [r["step"] for r in read_records(run_dir)] == [1]
