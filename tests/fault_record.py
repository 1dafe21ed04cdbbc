"""What a fault-injection case observed: appended to $SRTRAIN_FAULTS_RESULTS (one JSON line a
case, rendered by ``tools/faults_table.py``), then asserted."""

from __future__ import annotations

import json
import os

RESULTS_ENV = "SRTRAIN_FAULTS_RESULTS"


def record(case: str, *, one_line: bool | None, traceback: bool, silent_wrong: bool, lost: bool):
    """Append what ``case`` observed to $SRTRAIN_FAULTS_RESULTS (one JSON line), if set, then
    assert the promise: one line (None: a SIGKILLed process, which can print nothing), no
    traceback, nothing silently wrong, nothing lost."""
    path = os.environ.get(RESULTS_ENV)
    if path:
        row = {
            "case": case,
            "one_line": one_line,
            "traceback": traceback,
            "silent_wrong": silent_wrong,
            "lost": lost,
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    assert one_line is not False, f"{case}: not one line"
    assert not traceback, f"{case}: traceback"
    assert not silent_wrong, f"{case}: silently wrong"
    assert not lost, f"{case}: lost"


def one_error_line(stderr: str, code: int, expected: int = 2) -> bool:
    """Exit code ``expected`` and exactly one ``error:`` line on stderr, beside ``notice:``
    lines at most (a run taking over a killed run's directory says so)."""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    others = [line for line in lines if not line.startswith(("error: ", "notice: "))]
    return code == expected and len(errors) == 1 and not others
