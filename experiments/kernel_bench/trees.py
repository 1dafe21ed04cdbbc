"""Side-by-side timing of two or more source trees of srtrain: a code change read against
the code before it on the same machine, in one call.

``python -m experiments.kernel_bench --trees before=old/src,after=src --rounds 2 [mode
options]`` runs the bench's mode (the kernels by default, or ``--model``, ``--host``,
``--sweep``, ``--sass`` and the like) once per tree and round, in that order round after
round, each in a fresh process that imports srtrain from that tree and runs that tree's own
kernel bench (``experiments.kernel_bench`` beside its ``src``, or ``srtrain.bench`` in trees
that still carried it). Rows are matched by name (and by occurrence, where a name repeats),
and each row reports every tree's values over the rounds, and the median time's ratio to the
first tree's. Each run's output reaches stderr as it comes, after ``[TREE ROUND/ROUNDS]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path

from srtrain.bench.trees import tree_commit

# options of the caller that the per-tree runs do not take: their own trees and rounds, and
# their output file (each run writes its own)
_OWN_OPTIONS = {"--trees": 1, "--rounds": 1, "--json": 1}
# modes whose runs span several processes (training, checkpoints under torchrun) or take
# --rounds themselves
REFUSED_MODES = ("--train", "--checkpoint", "--compare")


def tree_arguments(argv: list[str]) -> list[str]:
    """The caller's arguments without the options only it takes (``--trees``, ``--rounds``,
    ``--json``), for the per-tree runs; refuses modes that cannot run that way."""
    for mode in REFUSED_MODES:
        if any(a == mode or a.startswith(mode + "=") for a in argv):
            raise ValueError(
                f"--trees runs the kernel, --model, --host, --sweep, --sass and "
                f"--dry modes; {mode} is not one of them"
            )
    kept, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        option = arg.split("=", 1)[0]
        if option in _OWN_OPTIONS:
            skip = _OWN_OPTIONS[option] if "=" not in arg else 0
            continue
        kept.append(arg)
    return kept


def bench_of(root: Path) -> tuple[str, list[str], Path | None]:
    """The kernel bench of the tree whose ``srtrain`` is in ``root``: its module, the import
    paths and the directory it runs in (the checkout's ``experiments`` beside ``src``, run
    from that checkout so that ``-m`` finds it first; else the ``srtrain.bench`` of trees
    that carried the kernel bench in the package)."""
    checkout = root.parent
    if (checkout / "experiments" / "kernel_bench" / "__main__.py").is_file():
        return "experiments.kernel_bench", [str(root), str(checkout)], checkout
    return "srtrain.bench", [str(root)], None


def _run_tree(root: Path, arguments: list[str], timeout: float | None, label: str) -> dict:
    """One bench run importing srtrain from ``root``; its JSON result (its environment's
    commit is the tree's). Its output goes to stderr as it comes, each line after
    ``[label]``, and its wall time after it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        module, paths, cwd = bench_of(root)
        env = dict(
            os.environ,
            SRTRAIN_COMMIT=tree_commit(root),
            PYTHONPATH=os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", module, *arguments, "--json", str(out)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        tail: deque[str] = deque(maxlen=40)
        pump = threading.Thread(target=_relay, args=(proc, label, tail), daemon=True)
        pump.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        pump.join()
        seconds = time.perf_counter() - started
        print(f"[{label}] exit {code} after {seconds:.0f} s", file=sys.stderr, flush=True)
        if code != 0 or not out.is_file():
            why = f"timed out after {timeout:g} s" if code is None else f"exit {code}"
            raise RuntimeError(f"the bench run on {root} failed ({why}):\n{''.join(tail)}")
        return json.loads(out.read_text())


def _relay(proc: subprocess.Popen, label: str, tail: deque[str]) -> None:
    """Copy ``proc``'s output to stderr line by line, keeping its last lines in ``tail``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        print(f"[{label}] {line}", end="", file=sys.stderr, flush=True)


def _keyed(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """Rows by (name, occurrence of that name)."""
    seen: Counter = Counter()
    keyed = {}
    for row in rows:
        name = row["name"]
        keyed[(name, seen[name])] = row
        seen[name] += 1
    return keyed


def _measures(row: dict) -> list[str]:
    """The numeric fields of a row that a tree can change (not its size or round)."""
    return [
        k
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("numel", "round")
    ]


def compare_trees(
    trees: dict[str, Path], arguments: list[str], rounds: int, timeout: float | None = None
) -> tuple[list[dict], dict]:
    """Runs every tree ``rounds`` times in turn; (rows, {tree: its runs' environments}).

    Each row holds, per tree, the values of every measure over the rounds (``TREE.FIELD``),
    and where rows are timed, the first tree's median time over each other tree's
    (``TREE.speedup``). A row some tree lacks says how many of its runs had it."""
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for round_index in range(rounds):
        for name, root in trees.items():
            label = f"{name} {round_index + 1}/{rounds}"
            results[name].append(_run_tree(root, arguments, timeout, label))
    keyed = {name: [_keyed(r["rows"]) for r in runs] for name, runs in results.items()}
    first = next(iter(trees))
    rows = []
    for key, template in keyed[first][0].items():
        row: dict = {"name": key[0]}
        for name in trees:
            found = [run[key] for run in keyed[name] if key in run]
            if len(found) < rounds:
                row[f"{name}.runs_with_row"] = len(found)
            for field in _measures(template):
                values = [r[field] for r in found if field in r]
                if values:
                    row[f"{name}.{field}"] = values
        base = row.get(f"{first}.median_us")
        for name in list(trees)[1:]:
            times = row.get(f"{name}.median_us")
            if base and times and statistics.median(times) > 0:
                row[f"{name}.speedup"] = statistics.median(base) / statistics.median(times)
        rows.append(row)
    environments = {name: [r["environment"] for r in runs] for name, runs in results.items()}
    return rows, environments
