#!/usr/bin/env python3
"""docs/faults.md's table from the cases tests/test_faults.py recorded.

Usage: SRTRAIN_FAULTS_RESULTS=faults.jsonl pytest tests/test_faults.py -n 2
       python tools/faults_table.py faults.jsonl
Each row counts one case's runs: tried, ended in one line (a process killed by SIGKILL prints
nothing at all and counts as such), showed a traceback, was silently wrong, lost something.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("tried", "one line", "traceback", "silent wrong", "lost")


def rows(path: Path) -> dict[str, dict[str, int]]:
    """Per case (in the order first recorded), the count of each column."""
    table: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        case = json.loads(line)
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    print(render(rows(Path(sys.argv[1]))))
