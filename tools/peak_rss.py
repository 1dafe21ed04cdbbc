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


def sampled_run(
    command: list[str],
    *,
    cwd: Path | None = None,
    marker: str | None = None,
    echo: bool = False,
    check: bool = True,
) -> dict:
    """Run ``command``, its output read line by line as it comes (printed too with ``echo``),
    sampling the summed RSS of it and its descendants every 50 ms: its return code, wall time
    (s), peak RSS (GiB), the seconds until a line containing ``marker`` appeared and the peak
    RSS until then (None: not watched or never) and its output. With ``check``, a non-zero
    exit raises RuntimeError holding the output."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    os.set_blocking(proc.stdout.fileno(), False)
    peak, lines, seen, peak_seen = 0, [], None, None
    while True:
        line = proc.stdout.readline()
        if line:
            lines.append(line)
            if echo:
                print(line, end="", flush=True)
            if marker and seen is None and marker in line:
                seen, peak_seen = time.monotonic() - start, peak
            continue
        if proc.poll() is not None:
            rest = proc.stdout.readlines()
            lines += rest
            if echo:
                print("".join(rest), end="", flush=True)
            break
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    output = "".join(lines)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{output}")
    return {
        "returncode": proc.returncode,
        "wall_s": round(time.monotonic() - start, 1),
        "peak_rss_gib": round(peak / 2**30, 3),
        "marker_s": None if seen is None else round(seen, 1),
        "peak_rss_before_marker_gib": None if peak_seen is None else round(peak_seen / 2**30, 3),
        "output": output,
    }


def main(argv: list[str]) -> int:
    """Run ``argv`` (after ``--``); print its peak summed RSS and wall time."""
    command = argv[argv.index("--") + 1 :] if "--" in argv else argv
    run = sampled_run(command, echo=True, check=False)
    print(
        f"peak_rss: {run['peak_rss_gib']:.2f} GiB (all processes), wall {run['wall_s']:.1f} s",
        file=sys.stderr,
    )
    return run["returncode"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
