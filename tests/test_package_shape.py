"""The package's shape: no import circles, and nothing of the lab or an optional extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.package_shape import cycles, import_edges, modules

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_of_srtrain_imports_itself_in_a_circle():
    assert cycles(import_edges(modules(ROOT / "src"))) == []


def test_a_circle_is_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


@pytest.mark.slow
def test_every_module_imports_without_the_lab_or_matplotlib():
    """Each srtrain module imports in a fresh process where matplotlib and the checkout's
    experiments cannot be imported."""
    names = [n for n in modules(ROOT / "src") if not n.endswith("__main__")]
    script = (
        "import importlib, sys\n"
        "sys.modules['matplotlib'] = None\n"
        "sys.modules['experiments'] = None\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT / "src", timeout=300)
