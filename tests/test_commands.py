"""`srtrain COMMAND` / `python -m srtrain COMMAND`: the commands an installed package runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from srtrain.__main__ import COMMANDS, main

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[1]


def srtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "srtrain", *args], capture_output=True, text=True, timeout=600
    )


def test_help_lists_every_command():
    proc = srtrain("--help")
    assert proc.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in proc.stdout


def test_no_command_is_usage_and_exit_2(capsys):
    assert main([]) == 2
    assert "usage: srtrain COMMAND" in capsys.readouterr().err


def test_unknown_command_is_one_line(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown command 'trian'")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    proc = srtrain(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_console_script_is_the_dispatcher():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"srtrain": "srtrain.__main__:main"}


def test_theory_prints_the_table():
    proc = srtrain("theory", "--format", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert "fp8" in proc.stdout and "reset v every" in proc.stdout


def test_train_runs_from_the_package(tiny_data, tmp_path):
    """`python -m srtrain train` trains from any directory, like `./train` in a checkout."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_data, run_dir, **{"train.steps": 4, "train.val_interval": 4})
    proc = subprocess.run(
        [sys.executable, "-m", "srtrain", "train", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps[-1] == 4
