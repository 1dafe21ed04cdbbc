"""Side-by-side timing of two or more source trees of srtrain: a code change read against
the code before it on the same machine, in one call.

``python -m srtrain.bench --trees before=old/src,after=src --rounds 2 [mode options]`` runs
the bench's own mode (the kernels by default, or ``--model``, ``--host``, ``--sweep``,
``--sass`` and the like) once per tree and round, in that order round after round, each in
a fresh process that imports srtrain from that tree. Rows are matched by name (and by
occurrence, where a name repeats), and each row reports every tree's values over the
rounds, and the median time's ratio to the first tree's. Each run's output reaches stderr
as it comes, after ``[TREE ROUND/ROUNDS]``.
"""

from __future__ import annotations

import hashlib
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

# options of the caller that the per-tree runs do not take: their own trees and rounds, and
# their output file (each run writes its own)
_OWN_OPTIONS = {"--trees": 1, "--rounds": 1, "--json": 1}
# modes whose runs span several processes (training, checkpoints under torchrun) or take
# --rounds themselves
REFUSED_MODES = ("--train", "--checkpoint", "--compare")


def parse_trees(spec: str) -> dict[str, Path]:
    """``NAME=PATH,NAME=PATH,...`` → {name: path}; each path holds an ``srtrain`` package."""
    trees: dict[str, Path] = {}
    for item in spec.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--trees takes NAME=PATH,NAME=PATH; got {item!r}")
        if name in trees:
            raise ValueError(f"--trees names {name!r} twice")
        root = Path(path)
        if not (root / "srtrain" / "__init__.py").is_file():
            raise ValueError(
                f"--trees: {path!r} holds no srtrain package (give the directory "
                "that contains srtrain/, such as a checkout's src)"
            )
        trees[name] = root.resolve()
    if len(trees) < 2:
        raise ValueError("--trees needs two or more trees to compare")
    return trees


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


def tree_commit(root: Path) -> str:
    """The commit of the git checkout whose tracked files hold ``root``'s srtrain package
    (``git worktree add DIR COMMIT`` makes one of any commit), with ``+changes`` where its
    files differ from it; ``unknown`` for a tree git does not track (an export, or a copy
    in an ignored directory)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )

    try:
        head = git("rev-parse", "--short", "HEAD")
        tracked = git("ls-files", "--error-unmatch", "srtrain/__init__.py")
        if head.returncode != 0 or tracked.returncode != 0:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no", ".").stdout.strip()
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")


def tree_digest(root: Path) -> str:
    """SHA-256 (first 16 hex digits) over the relative paths and contents of the ``.py``
    files of ``root``'s srtrain package: which code ran, readable where git is not (a copy
    of a checkout); :func:`commit_digest` gives a commit's, to match it."""
    digest = hashlib.sha256()
    package = Path(root) / "srtrain"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def commit_digest(commit: str, repo: Path = Path(".")) -> str:
    """:func:`tree_digest` of ``src/srtrain`` as committed at ``commit`` in ``repo``."""

    def git(*args: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=True
        ).stdout

    digest = hashlib.sha256()
    listing = git("ls-tree", "-r", "--name-only", commit, "src/srtrain").decode().split()
    files = sorted(
        (Path(name).relative_to("src/srtrain").as_posix(), name)
        for name in listing
        if name.endswith(".py")
    )
    for relative, name in files:
        digest.update(relative.encode() + b"\0")
        digest.update(git("show", f"{commit}:{name}") + b"\0")
    return digest.hexdigest()[:16]


def commit_with_digest(digest: str, repo: Path = Path("."), limit: int = 100) -> str | None:
    """The commit among the last ``limit`` of ``repo``'s history that changed src/srtrain
    whose sources have ``digest`` (:func:`tree_digest`): the commit that introduced the code
    a result was measured on; None if none has."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "rev-list", f"--max-count={limit}", "HEAD", "--", "src/srtrain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for commit in listed:
        if commit_digest(commit, repo) == digest:
            return commit[:7]
    return None


def _run_tree(root: Path, arguments: list[str], timeout: float | None, label: str) -> dict:
    """One bench run importing srtrain from ``root``; its JSON result (its environment's
    commit is the tree's). Its output goes to stderr as it comes, each line after
    ``[label]``, and its wall time after it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(
            os.environ,
            SRTRAIN_COMMIT=tree_commit(root),
            PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "srtrain.bench", *arguments, "--json", str(out)],
            env=env,
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
