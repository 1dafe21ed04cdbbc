"""Recorded result files carry their provenance in fields the writing code produces or
docs/performance.md documents (#result-files), never in a free-form note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
STUDY = sorted((ROOT / "docs" / "results" / "data").glob("*/*.json"))
# the environment fields of benchmarks/results files (docs/performance.md#result-files)
ENVIRONMENT = {
    "date",
    "device",
    "torch",
    "triton",
    "commit",
    "command",
    "commit_recorded",
    "source_digest",
    "trees",
    "commits",
    "configs",
    "changes",
    "tests",
    "units",
    "shape",
    "data",
    "ncu",
    "PYTORCH_CUDA_ALLOC_CONF",
}
PROVENANCE = ("commit", "device", "torch", "triton")


def _keys(value, path=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}/{key}", key
            yield from _keys(item, f"{path}/{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _keys(item, f"{path}[{i}]")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", BENCH + STUDY, ids=_name)
def test_no_free_form_notes(path):
    notes = [where for where, key in _keys(json.loads(path.read_text())) if "note" in key]
    assert not notes, f"{_name(path)}: {notes}"


@pytest.mark.parametrize("path", BENCH, ids=_name)
def test_bench_environment_fields_are_documented(path):
    env = json.loads(path.read_text())["environment"]
    assert {"date", "device"} <= set(env), _name(path)
    assert set(env) <= ENVIRONMENT, f"{_name(path)}: {sorted(set(env) - ENVIRONMENT)}"
    assert "commit" in env or {"trees", "commits", "changes"} & set(env), _name(path)
    if "commit_recorded" in env:
        assert env["commit"] != env["commit_recorded"], _name(path)


@pytest.mark.parametrize("path", STUDY, ids=_name)
def test_study_files_say_where_they_ran(path):
    data = json.loads(path.read_text())
    fields = data.get("environment", data)  # frozen.json: environment; summary.json: top level
    assert all(fields.get(key) for key in PROVENANCE), _name(path)
