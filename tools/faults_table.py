#!/usr/bin/env python3
"""docs/faults.md's table from the cases tests/test_faults.py and tests/test_user_faults.py
recorded.

Usage: SRTRAIN_FAULTS_RESULTS=faults.jsonl \
           pytest tests/test_faults.py tests/test_user_faults.py -n 2
       python tools/faults_table.py faults.jsonl [--record OUT.json]
Each row counts one case's runs: tried, ended in one line (a process killed by SIGKILL prints
nothing at all and counts as such), showed a traceback, was silently wrong, lost something.
``--record`` files the cases with the date, host, torch and Triton versions and commit they ran at
(docs/results/data/faults/; ``tools/figures.py`` renders docs/faults.md's table from the newest).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpu_record import environment, write

COLUMNS = ("tried", "one line", "traceback", "silent wrong", "lost")


def read_cases(path: Path) -> list[dict]:
    """The cases a test run appended to ``path`` (one JSON object a line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows(cases: list[dict]) -> dict[str, dict[str, int]]:
    """Per case (in the order first recorded), the count of each column."""
    table: dict[str, dict[str, int]] = {}
    for case in cases:
        row = table.setdefault(case["case"], dict.fromkeys(COLUMNS, 0))
        row["tried"] += 1
        row["one line"] += case["one_line"] is not False
        row["traceback"] += bool(case["traceback"])
        row["silent wrong"] += bool(case["silent_wrong"])
        row["lost"] += bool(case["lost"])
    return table


def render(table: dict[str, dict[str, int]]) -> str:
    """The markdown table, sorted by case, with a total row."""
    lines = ["| case | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for case in sorted(table):
        lines.append(f"| {case} | " + " | ".join(str(table[case][c]) for c in COLUMNS) + " |")
    totals = [str(sum(row[c] for row in table.values())) for c in COLUMNS]
    lines.append("| **all** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    return "\n".join(lines)


def record(cases: list[dict], cases_file: Path, out: Path) -> dict:
    """Write the cases to ``out`` with the environment they ran in; returns what it wrote."""
    command = (
        f"SRTRAIN_FAULTS_RESULTS={cases_file.name} pytest tests/test_faults.py "
        "tests/test_user_faults.py -n 2 && "
        f"python tools/faults_table.py {cases_file.name} --record {out.name}"
    )
    data = {
        "environment": environment(command, "src", "tests"),
        "cases": cases,
    }
    return write(out, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", type=Path, help="the file SRTRAIN_FAULTS_RESULTS named")
    parser.add_argument("--record", type=Path, help="also file the cases here (JSON)")
    args = parser.parse_args(argv)
    cases = read_cases(args.cases)
    if args.record:
        record(cases, args.cases, args.record)
    print(render(rows(cases)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
