"""Study tooling: grids, the grid runner with its summary and deadline, frozen weights, report."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from experiments.study.__main__ import main
from experiments.study.frozen import FrozenSetup, write_frozen
from experiments.study.grid import PUBLISHED_PERIODS, load_grid
from experiments.study.report import FIGURES, RESULTS_MD, loss_figure, write_report
from experiments.study.runner import RESULTS_FILE, SUMMARY_FILE, run_grid, run_overrides
from experiments.study.summary import summarize
from srtrain.config import load_config
from srtrain.metrics import read_records
from srtrain.models import build_model, param_group_of
from srtrain.numerics.formats import get_format
from srtrain.optim.resets import schedule_from_config
from srtrain.stopping import EXIT_SAVED
from srtrain.theory import block_stall_at_age, p_stall_at_age, stall_probability

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FILES = {"config.yaml", "metrics.jsonl", "train.log", "events.json"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _tiny_extra(data_dir: str, **extra) -> list[str]:
    """Tiny-run overrides for every run of a grid (the runner sets each run's directory)."""
    return [
        o for o in tiny_overrides(data_dir, "unused", **extra) if not o.startswith("train.run_dir=")
    ]


def _grid_file(path: Path, runs: dict[str, list[str]]) -> Path:
    path.write_text(
        json.dumps(
            {
                "name": "tiny",
                "config": str(TINY_CONFIG),
                "runs": [{"name": n, "overrides": o} for n, o in runs.items()],
            }
        )
    )
    return path


# ---------------------------------------------------------------------------------- grids


def _flat(cfg) -> dict:
    return {f"{s}.{k}": v for s, values in cfg.to_dict().items() for k, v in values.items()}


def test_ablation_grid_runs_load_in_priority_order():
    grid = load_grid("ablation")
    assert grid.names[:7] == ["fp32", "bf16-nr", "bf16-sr", "fp8-sr", "fp4-sr", "fp8-nr", "fp4-nr"]
    assert len(grid.names) == 17 and all("resets" in n for n in grid.names[7:])
    configs = {r.name: load_config(r.config, r.overrides) for r in grid.runs}
    flats = {name: _flat(cfg) for name, cfg in configs.items()}
    varying = {
        "optim.m_format",
        "optim.v_format",
        "optim.m_rounding",
        "optim.v_rounding",
        "resets.mode",
        "resets.m_period",
        "resets.v_period",
        "resets.rewarmup",
    }
    for flat in flats.values():  # same model, data, seed and steps for every run
        assert {k: v for k, v in flat.items() if k not in varying} == {
            k: v for k, v in flats["fp32"].items() if k not in varying
        }
    base = configs["fp32"]
    assert (base.model.preset, base.model.seq_len, base.optim.beta2, base.optim.lr) == (
        "llama-60m",
        256,
        0.999,
        1e-3,
    )
    assert (
        base.train.steps,
        base.optim.warmup_steps,
        base.train.global_batch_size,
        base.train.micro_batch_size,
        base.train.log_interval,
    ) == (3000, 300, 16, 16, 10)
    assert (base.parallel.device, base.data.dir, base.checkpoint.enabled) == (
        "cuda",
        "data/study",
        False,
    )
    assert (base.optim.m_format, base.optim.v_rounding, base.resets.mode) == (
        "fp32",
        "nearest",
        "none",
    )
    assert configs["fp32-resets"].resets.m_period == configs["fp32-resets"].resets.v_period == 1000
    for fmt in ("bf16", "fp8", "fp4"):
        v_format = "fp4_e2m2" if fmt == "fp4" else fmt
        for suffix, rounding in (("nr", "nearest"), ("sr", "stochastic")):
            cfg = configs[f"{fmt}-{suffix}"]
            assert (
                cfg.optim.v_format,
                cfg.optim.m_rounding,
                cfg.optim.v_rounding,
                cfg.resets.mode,
            ) == (v_format, rounding, rounding, "none")
            assert configs[f"{fmt}-{suffix}-resets"].resets.mode == "theory"
        sym = configs[f"{fmt}-sr-resets-sym"].resets
        assert (sym.mode, sym.m_period, sym.v_period) == (
            "periodic",
            PUBLISHED_PERIODS[fmt],
            PUBLISHED_PERIODS[fmt],
        )
        theory = configs[f"{fmt}-sr-resets"]
        periods = schedule_from_config(theory.resets, theory.optim, "cpu").periods
        assert periods["m"] != periods["v"] > 0  # asymmetric


def test_stall_neox_grid():
    grid = load_grid("stall-neox")
    assert grid.names == ["bf16-nr", "bf16-sr", "fp8-sr", "fp4-sr", "fp8-nr"]
    for run in grid.runs:
        cfg = load_config(run.config, run.overrides)
        assert (cfg.model.preset, cfg.resets.mode, cfg.train.steps) == ("neox-160m", "none", 3000)


def test_lean_grid_pairs_fp32_master_with_bf16_weights():
    grid = load_grid("lean")
    assert grid.names == [
        "fp32",
        "fp8-sr",
        "fp8-sr-bf16w",
        "fp4-sr",
        "fp4-sr-bf16w",
        "bf16-sr-bf16w",
    ]
    configs = {run.name: load_config(run.config, run.overrides) for run in grid.runs}
    for name, cfg in configs.items():
        assert (cfg.model.preset, cfg.resets.mode) == ("llama-60m", "none")
        assert cfg.parallel.bf16_params == name.endswith("-bf16w")
        if cfg.parallel.bf16_params:
            assert cfg.optim.param_rounding == "stochastic"
    for fmt, m_format in (("fp8", "fp8"), ("fp4", "fp4_e2m1")):
        master, lean = configs[f"{fmt}-sr"], configs[f"{fmt}-sr-bf16w"]
        assert master.optim.m_format == lean.optim.m_format == m_format
        assert (master.optim.m_rounding, lean.optim.v_rounding) == ("stochastic", "stochastic")


def test_steps_override_rescales_warmup():
    run = load_grid("ablation").runs[0]
    cfg = load_config(run.config, run_overrides(run, ["train.steps=500"], True, Path("r")))
    assert (cfg.train.steps, cfg.optim.warmup_steps, cfg.parallel.device) == (500, 50, "cpu")
    cfg = load_config(
        run.config,
        run_overrides(run, ["train.steps=500", "optim.warmup_steps=7"], False, Path("r")),
    )
    assert (cfg.optim.warmup_steps, cfg.parallel.device, cfg.train.run_dir) == (7, "cuda", "r")


# -------------------------------------------------------------------------------- summary


def test_summary_predicts_at_the_state_age_since_each_reset():
    cfg = load_config(
        None,
        [
            "optim.v_rounding=nearest",
            "resets.mode=periodic",
            "resets.v_period=25",
            "train.steps=60",
            "train.log_interval=10",
        ],
    )
    config = cfg.to_dict()
    records = [{"step": s, "loss": 10.0 - s / 10} for s in range(1, 61)]
    for r in records:
        if r["step"] % 10 == 0:
            r.update(stall_m=0.01 * r["step"] / 10, stall_v=0.1 * r["step"] / 10)
    events = {"val_loss": {"60": 3.5}, "resets": {"m": [], "v": [25, 50]}}
    entry = summarize(config, records, events)
    assert entry["steps_reached"] == 60 and entry["final_val_loss"] == 3.5
    assert entry["final_train_loss"] == pytest.approx(sum(r["loss"] for r in records) / 60)
    # the last 20% of 6 logged records: steps 50 and 60
    assert entry["stall"]["v"]["measured"] == pytest.approx((0.5 + 0.6) / 2)
    assert entry["stall"]["v"]["window_steps"] == [41, 60]
    eps = get_format("bf16").eps
    ages = {41: 15, 50: 24, 51: 0, 60: 9}  # step -> age of the state it updates
    per_record = [
        sum(p_stall_at_age(eps, 0.999, ages[41] + i, "nearest", "v") for i in range(9)) / 10
        + p_stall_at_age(eps, 0.999, ages[50], "nearest", "v") / 10,
        sum(p_stall_at_age(eps, 0.999, ages[51] + i, "nearest", "v") for i in range(10)) / 10,
    ]
    assert entry["stall"]["v"]["predicted_plain_at_age"] == pytest.approx(sum(per_record) / 2)
    assert entry["stall"]["v"]["predicted_plain_steady"] == stall_probability(
        "bf16", 0.999, "nearest", "v"
    )
    # the block model: same ages, NR v on its biased drift (BF16 has no block scale)
    block = [
        sum(block_stall_at_age("bf16", 0.999, ages[41] + i, "nearest", "v") for i in range(9)) / 10
        + block_stall_at_age("bf16", 0.999, ages[50], "nearest", "v") / 10,
        sum(block_stall_at_age("bf16", 0.999, ages[51] + i, "nearest", "v") for i in range(10))
        / 10,
    ]
    assert entry["stall"]["v"]["predicted_at_age"] == pytest.approx(sum(block) / 2)
    assert entry["stall"]["v"]["predicted_steady"] == stall_probability(
        "bf16", 0.999, "nearest", "v"
    )
    # without extracted events the resets come from the config's schedule
    assert summarize(config, records, None)["resets"] == {"m": [], "v": [25, 50]}


def test_recompute_predictions_rewrites_only_the_theory(tmp_path):
    from experiments.study.report import recompute_predictions, stall_table
    from srtrain.theory import block_stall_probability

    cfg = load_config(
        None,
        [
            "optim.m_format=fp4_e2m1",
            "optim.v_format=fp8",
            "optim.block_size=16",
            "train.steps=40",
            "train.log_interval=10",
        ],
    )
    records = [{"step": s, "loss": 5.0} for s in range(1, 41)]
    for r in records:
        if r["step"] % 10 == 0:
            r.update(stall_m=0.3, stall_v=0.9)
    entry = summarize(cfg.to_dict(), records, None)
    for state in ("m", "v"):  # stale predictions, as an older model wrote them
        entry["stall"][state].update(predicted_steady=0.5, predicted_at_age=0.5)
        for key in ("block_size", "predicted_plain_steady", "predicted_plain_at_age"):
            del entry["stall"][state][key]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / SUMMARY_FILE).write_text(
        json.dumps({"grid": "g", "runs": [{"name": "run", "status": "complete", **entry}]})
    )
    assert recompute_predictions(tmp_path) == 1
    stall = json.loads((tmp_path / SUMMARY_FILE).read_text())["runs"][0]["stall"]
    fresh = summarize(cfg.to_dict(), records, None)["stall"]
    assert stall == fresh
    assert stall["m"]["predicted_steady"] == block_stall_probability(
        "fp4_e2m1", 0.9, "stochastic", "m", 16
    )
    assert stall["m"]["predicted_plain_steady"] == stall_probability(
        "fp4_e2m1", 0.9, "stochastic", "m"
    )
    assert stall["m"]["measured"] == pytest.approx(0.3)
    from experiments.study.report import load_study

    table = stall_table(load_study([tmp_path]).grids["g"])
    assert "m plain" in table[0] and f"{stall['m']['predicted_plain_steady']:.3f}" in table[2]


# --------------------------------------------------------------------------------- runner


@pytest.fixture(scope="module")
def study_dir(tiny_data, tmp_path_factory) -> Path:
    """A finished two-run tiny grid (BF16 states, NR and SR), run through the CLI on CPU."""
    tmp = tmp_path_factory.mktemp("study")
    grid = _grid_file(
        tmp / "grid.json",
        {
            "bf16-nr": ["optim.m_rounding=nearest", "optim.v_rounding=nearest"],
            "bf16-sr": ["optim.m_rounding=stochastic", "optim.v_rounding=stochastic"],
        },
    )
    extra = [o for o in _tiny_extra(tiny_data) if not o.startswith("optim.warmup_steps")]
    out = tmp / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.study",
            "run",
            "--grid",
            str(grid),
            "--out",
            str(out),
            "--gpus",
            "cpu",
            "--per-gpu",
            "2",
            "--export",
            str(tmp / "export"),
            "--",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tiny: 2 complete" in proc.stdout
    return out


@pytest.mark.slow
def test_runner_summary_matches_the_runs(study_dir):
    summary = json.loads((study_dir / SUMMARY_FILE).read_text())
    assert summary["grid"] == "tiny" and summary["stopped_by"] is None
    model = build_model("llama-tiny", 512, 64)
    assert [e["name"] for e in summary["runs"]] == ["bf16-nr", "bf16-sr"]
    for entry in summary["runs"]:
        run_dir = study_dir / entry["name"]
        records = read_records(run_dir)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["optim"]["warmup_steps"] == 3  # 10% of train.steps
        assert entry["status"] == "complete" and entry["returncode"] == 0
        assert entry["steps_reached"] == entry["steps_total"] == 30 and entry["wall_s"] > 0
        assert entry["final_train_loss"] == pytest.approx(
            sum(r["loss"] for r in records) / len(records)
        )
        log = (run_dir / "train.log").read_text()
        val_lines = [line for line in log.splitlines() if "| val loss " in line]
        assert val_lines[-1].startswith("step 30/30 |")
        assert entry["final_val_loss"] == pytest.approx(float(val_lines[-1].split()[-1]), abs=1e-4)
        assert entry["resets"] == {"m": [], "v": []}
        events = json.loads((run_dir / "events.json").read_text())
        sizes = {
            g: sum(p.numel() for n, p in model.named_parameters() if param_group_of(n) == g)
            for g in ("attention", "mlp")
        }
        logged = [r for r in records if "stall_m" in r]  # steps 5..30; last 20%: 25, 30
        rounding = config["optim"]["v_rounding"]
        for state, beta in (("m", 0.9), ("v", 0.999)):
            stall = entry["stall"][state]
            assert stall["measured"] == pytest.approx(
                (logged[-2][f"stall_{state}"] + logged[-1][f"stall_{state}"]) / 2
            )
            assert stall["predicted_plain_steady"] == stall_probability(
                "bf16", beta, rounding, state
            )
            assert stall["predicted_steady"] == stall["predicted_plain_steady"]  # no blocks
            expected = (
                sum(
                    p_stall_at_age(get_format("bf16").eps, beta, step - 1, rounding, state)
                    for step in range(21, 31)
                )
                / 10
            )
            assert stall["predicted_plain_at_age"] == pytest.approx(expected)
            block = (
                sum(
                    block_stall_at_age("bf16", beta, step - 1, rounding, state)
                    for step in range(21, 31)
                )
                / 10
            )
            assert stall["predicted_at_age"] == pytest.approx(block)
            by_group = {
                g: dict(map(tuple, pairs)) for g, pairs in events["stall_by_group"][state].items()
            }
            assert set(by_group) == {"attention", "mlp", "embeddings", "norms", "head"}
            dense = [
                (
                    sizes["attention"] * by_group["attention"][step]
                    + sizes["mlp"] * by_group["mlp"][step]
                )
                / (sizes["attention"] + sizes["mlp"])
                for step in (25, 30)
            ]
            assert stall["measured_dense"] == pytest.approx(sum(dense) / 2, rel=1e-6)
    with tarfile.open(study_dir / RESULTS_FILE) as tar:
        names = set(tar.getnames())
        assert names == {SUMMARY_FILE} | {
            f"{run}/{f}" for run in ("bf16-nr", "bf16-sr") for f in RUN_FILES
        }
        packed = tar.extractfile("bf16-sr/metrics.jsonl").read()
        assert packed == (study_dir / "bf16-sr" / "metrics.jsonl").read_bytes()
        assert json.loads(tar.extractfile(SUMMARY_FILE).read()) == summary
    export = study_dir.parent / "export"
    assert sorted(p.name for p in export.iterdir()) == sorted([RESULTS_FILE, SUMMARY_FILE])
    for name in (SUMMARY_FILE, RESULTS_FILE):
        assert (export / name).read_bytes() == (study_dir / name).read_bytes()


@pytest.mark.slow
def test_deadline_stops_runs_and_still_summarises(tiny_data, tmp_path):
    grid = load_grid(str(_grid_file(tmp_path / "grid.json", {"long": [], "later": []})))
    start = time.monotonic()
    summary = run_grid(
        grid,
        tmp_path / "out",
        ["cpu"],
        per_gpu=1,
        deadline_s=3,
        extra=_tiny_extra(tiny_data, **{"train.steps": 100000}),
    )
    assert time.monotonic() - start >= 3
    long, later = summary["runs"]
    assert summary["stopped_by"] == "deadline"
    assert (long["status"], later["status"]) == ("incomplete", "not_started")
    # SIGTERM: saved after its step (75), or stopped before training started (128 + 15)
    assert long["returncode"] in (EXIT_SAVED, 128 + signal.SIGTERM) and long["wall_s"] >= 3
    assert later["steps_reached"] == 0 and later["wall_s"] == 0
    assert json.loads((tmp_path / "out" / SUMMARY_FILE).read_text()) == summary
    with tarfile.open(tmp_path / "out" / RESULTS_FILE) as tar:
        assert "long/train.log" in tar.getnames()


def _start_runner(tiny_data: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A runner CLI with one endless run, once that run has logged two stall records."""
    grid = _grid_file(tmp_path / "grid.json", {"long": ["optim.v_rounding=nearest"]})
    out = tmp_path / "out"
    extra = _tiny_extra(tiny_data, **{"train.steps": 100000, "train.val_interval": 0})
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments.study",
            "run",
            "--grid",
            str(grid),
            "--out",
            str(out),
            "--gpus",
            "cpu",
            "--",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    metrics = out / "long" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (
        not metrics.exists() or len(read_records(out / "long")) < 10
    ):
        assert runner.poll() is None
        time.sleep(0.2)
    return runner, out


def _stopped_growing(path: Path) -> bool:
    size = path.stat().st_size
    time.sleep(2.0)
    return path.stat().st_size == size


@pytest.mark.slow
def test_sigterm_stops_runs_and_summarises_what_they_logged(tiny_data, tmp_path):
    runner, out = _start_runner(tiny_data, tmp_path)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 0
    summary = json.loads((out / SUMMARY_FILE).read_text())
    (entry,) = summary["runs"]
    assert summary["stopped_by"] == "SIGTERM" and entry["status"] == "incomplete"
    records = read_records(out / "long")
    logged = [r for r in records if "stall_v" in r]
    assert entry["steps_reached"] == records[-1]["step"] >= 10
    k = math.ceil(0.2 * len(logged))
    assert entry["stall"]["v"]["measured"] == pytest.approx(
        sum(r["stall_v"] for r in logged[-k:]) / k
    )
    assert entry["final_train_loss"] == pytest.approx(
        sum(r["loss"] for r in records[-100:]) / len(records[-100:])
    )
    assert _stopped_growing(out / "long" / "metrics.jsonl")


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_a_child_dies_with_its_killed_parent():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from experiments.study.runner import die_with_parent\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
            "preexec_fn=die_with_parent)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_second_invocation_keeps_the_other_runs(tmp_path):
    from experiments.study.runner import Study

    grid = load_grid(str(_grid_file(tmp_path / "grid.json", {"a": [], "b": [], "c": []})))
    out = tmp_path / "out"
    for name in ("a", "b"):
        (out / name).mkdir(parents=True)
    old = [
        {"name": "a", "status": "complete", "steps_reached": 30},
        {"name": "b", "status": "running", "steps_reached": 10},
        {"name": "c", "status": "complete", "steps_reached": 30},
    ]  # its directory is gone
    (out / SUMMARY_FILE).write_text(json.dumps({"grid": "tiny", "runs": old}))
    summary = Study(grid.select(["b"]), out, [], cpu=True).write()
    assert [(e["name"], e["status"]) for e in summary["runs"]] == [
        ("a", "complete"),
        ("b", "pending"),
    ]
    summary = Study(grid.select(["c"]), out, [], cpu=True).write()
    assert [(e["name"], e["status"]) for e in summary["runs"]] == [
        ("a", "complete"),
        ("b", "not_started"),
        ("c", "pending"),
    ]
    other = load_grid("stall-neox")
    with pytest.raises(ValueError, match="holds results of grid 'tiny', not 'stall-neox'"):
        Study(other, out, [], cpu=True)


def test_summary_records_where_its_runs_trained(tmp_path, monkeypatch):
    import torch
    import triton

    from experiments.study.runner import Study, checkout_commit

    grid = load_grid(str(_grid_file(tmp_path / "grid.json", {"a": []})))
    out = tmp_path / "out"
    out.mkdir()
    # a summary from before the runner recorded provenance
    (out / SUMMARY_FILE).write_text(
        json.dumps({"grid": "tiny", "started": "2026-11-29T21:59:35+0000", "runs": []})
    )
    monkeypatch.setenv("SRTRAIN_COMMIT", "abc1234")
    summary = Study(grid, out, [], cpu=True).write()
    assert summary["commit"] == "abc1234" and summary["device"]
    assert (summary["torch"], summary["triton"]) == (torch.__version__, triton.__version__)
    old, new = summary["invocations"]
    assert old == {
        "started": "2026-11-29T21:59:35+0000",
        "commit": "unknown",
        "device": "unknown",
        "torch": "unknown",
        "triton": "unknown",
    }
    assert new == {"started": summary["started"], **{k: summary[k] for k in old if k != "started"}}
    monkeypatch.setenv("SRTRAIN_COMMIT", "def5678")
    again = Study(grid, out, [], cpu=True).write()
    assert [i["commit"] for i in again["invocations"]] == ["unknown", "abc1234", "def5678"]
    monkeypatch.delenv("SRTRAIN_COMMIT")
    assert checkout_commit(tmp_path) == "unknown"  # not a git checkout
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", checkout_commit())


@pytest.mark.slow
def test_resume_keeps_complete_runs_and_continues_from_checkpoints(tiny_data, tmp_path):
    """A grid cut short and run again with resume: the completed run is not started again,
    the cut run resumes from its checkpoint and ends with the same records as if uncut."""
    grid = load_grid(str(_grid_file(tmp_path / "grid.json", {"a": [], "b": []})))
    extra = _tiny_extra(
        tiny_data,
        **{
            "train.steps": 8,
            "train.log_interval": 2,
            "train.val_interval": 4,
            "checkpoint.enabled": "true",
            "checkpoint.interval": 4,
        },
    )
    out = tmp_path / "out"
    first = run_grid(grid, out, ["cpu"], per_gpu=2, extra=extra)
    assert [e["status"] for e in first["runs"]] == ["complete", "complete"]
    records = (out / "b" / "metrics.jsonl").read_text()
    a_log = (out / "a" / "train.log").read_bytes()
    # as if the runner had been stopped after b's checkpoint at step 4
    shutil.rmtree(out / "b" / "checkpoints" / "step-8")
    summary = json.loads((out / SUMMARY_FILE).read_text())
    summary["runs"][1]["status"] = "incomplete"
    (out / SUMMARY_FILE).write_text(json.dumps(summary))
    second = run_grid(grid, out, ["cpu"], per_gpu=2, extra=extra, resume=True)
    assert [(e["name"], e["status"]) for e in second["runs"]] == [
        ("a", "complete"),
        ("b", "complete"),
    ]
    assert (out / "a" / "train.log").read_bytes() == a_log
    log = (out / "b" / "train.log").read_text()
    assert log.count("+ ") == 2 and "resumed from step 4" in log
    assert (out / "b" / "metrics.jsonl").read_text() == records


# --------------------------------------------------------------------------------- frozen


@pytest.fixture(scope="module")
def frozen_dir(tiny_data, tmp_path_factory) -> Path:
    """frozen.json of llama-tiny at lr 1e-4, where NR freezes the largest weights."""
    out = tmp_path_factory.mktemp("frozen")
    write_frozen(
        FrozenSetup(
            preset="llama-tiny", data_dir=tiny_data, steps=6, lr=1e-4, batch=8, seq_len=64, bins=20
        ),
        out,
    )
    return out


def test_frozen_nearest_freezes_large_weights(frozen_dir):
    frozen = json.loads((frozen_dir / "frozen.json").read_text())
    assert set(frozen["environment"]) == {"date", "commit", "device", "torch", "triton"}
    lr, edges, counts = frozen["lr"], frozen["bins"]["edges"], frozen["bins"]["count"]
    nr = frozen["variants"]["nearest"]
    sr = frozen["variants"]["stochastic"]
    assert len(counts) == 20 and sum(counts) == frozen["elements"]
    assert nr["ever_changed_by_bin"][-1] < sr["ever_changed_by_bin"][-1]
    assert sr["ever_changed"] >= nr["ever_changed"]
    for i, count in enumerate(counts):
        if not count:
            continue
        if edges[i + 1] < 128 * lr:  # half an ULP is below lr/2: the first update lands
            assert nr["ever_changed_by_bin"][i] == 1.0
        if edges[i] >= 512 * lr:  # half an ULP is at least lr: updates are dropped
            assert nr["ever_changed_by_bin"][i] < 0.1
            assert sr["ever_changed_by_bin"][i] > 0.5
    assert 128 * lr < frozen["threshold"]["measured_abs_w"] < 1024 * lr
    assert frozen["threshold"]["predicted_256_lr"] == pytest.approx(256 * lr)
    assert len(nr["losses"]) == len(sr["losses"]) == 6
    assert nr["losses"][0] == sr["losses"][0]  # same init and data
    assert 0 < nr["changed_last_step"] <= nr["ever_changed"]


# --------------------------------------------------------------------------------- report


@pytest.mark.slow
def test_report_writes_tables_and_figures(study_dir, frozen_dir, tmp_path):
    written = write_report([study_dir, frozen_dir], tmp_path / "docs" / "results")
    grid = json.loads((study_dir / SUMMARY_FILE).read_text())["grid"]
    figures = {*FIGURES, loss_figure(grid)}
    assert {p.name for p in written} == {RESULTS_MD, *figures}
    for name in figures:
        data = (tmp_path / "docs" / "results" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    md = (tmp_path / "docs" / "results" / RESULTS_MD).read_text()
    summary = json.loads((study_dir / SUMMARY_FILE).read_text())
    for entry in summary["runs"]:
        row = next(line for line in md.splitlines() if line.startswith(f"| {entry['name']} |"))
        assert f"{entry['final_val_loss']:.4f}" in row
        assert f"{entry['final_train_loss']:.4f}" in row
    assert "## Frozen BF16 weights" in md and "256·lr" in md
    # the runs log the FP32 shadow: the health table has a row per run
    assert f"## Grid `{grid}`: state health against the FP32 shadow" in md
    for entry in summary["runs"]:
        assert f"| {entry['name']} | bf16/bf16 " in md.split("state health")[1]


def test_report_reads_the_exported_tarball_alone(study_dir):
    from experiments.study.report import load_study

    data = load_study([study_dir.parent / "export"])  # summary.json and results.tar.gz only
    runs = data.grids["tiny"].runs
    assert list(runs) == ["bf16-nr", "bf16-sr"]
    assert [r["step"] for r in runs["bf16-sr"].records] == list(range(1, 31))
    assert runs["bf16-sr"].records == read_records(study_dir / "bf16-sr")
    assert runs["bf16-nr"].config == yaml.safe_load(
        (study_dir / "bf16-nr" / "config.yaml").read_text()
    )


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--grid", "nope", "--out", "{tmp}/o"], "error: unknown grid 'nope'; allowed: "),
        (
            ["run", "--grid", "ablation", "--only", "fp32,bf16-xx", "--out", "{tmp}/o"],
            "error: unknown run name(s) bf16-xx in grid ablation; runs: fp32, ",
        ),
        (
            ["run", "--grid", "ablation", "--out", "{tmp}/missing/o", "--gpus", "cpu"],
            "error: --out {tmp}/missing/o: parent directory {tmp}/missing does not exist",
        ),
        (
            ["run", "--grid", "ablation", "--out", "{tmp}/o", "--gpus", "0,x"],
            "error: --gpus '0,x': expected 'cpu' or distinct GPU indices like 0,1",
        ),
        (
            [
                "run",
                "--grid",
                "ablation",
                "--out",
                "{tmp}/o",
                "--gpus",
                "cpu",
                "--",
                "optim.v_format=fp6",
            ],
            "error: run fp32: optim.v_format: unknown format 'fp6'",
        ),
        (["frozen", "--out", "{tmp}/missing/f"], "error: --out {tmp}/missing/f: parent directory"),
        (
            [
                "run",
                "--grid",
                "ablation",
                "--out",
                "{tmp}/o",
                "--gpus",
                "cpu",
                "--",
                "data.dir={tmp}/no-data",
            ],
            "error: no prepared data at {tmp}/no-data",
        ),
        (["report", "{tmp}/nothing"], "error: report input {tmp}/nothing is not a directory"),
    ],
)
def test_boundary_errors_are_one_line(argv, message, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert not (tmp_path / "o" / "summary.json").exists()
