"""Run a command and print the peak of the summed resident memory of it and all its
descendant processes (sampled from /proc every 50 ms), and its wall time.

    python tools/peak_rss.py -- python -m srtrain.data prepare ...
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def _tree_rss(root: int) -> int:
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        with contextlib.suppress(OSError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    return total


def main(argv: list[str]) -> int:
    """Run ``argv`` (after ``--``); print its peak summed RSS and wall time."""
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    start = time.monotonic()
    proc = subprocess.Popen(command)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    print(
        f"peak_rss: {peak / 2**30:.2f} GiB (all processes), wall {time.monotonic() - start:.1f} s",
        file=sys.stderr,
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
