"""Named points where a fault-injection test kills a run: ``SRTRAIN_FAULT_AT=<point>[:<n>]``.

A process started with ``SRTRAIN_FAULT_AT`` naming one of :data:`POINTS` sends itself SIGKILL
the ``n``-th time (default: the first) it reaches that point, as a crash or the OOM killer
would, leaving its files exactly as they are at that moment. The variable is read once, at
import; unset (every real run), :func:`fault_point` is one comparison.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "SRTRAIN_FAULT_AT"
POINTS = {
    "metrics-trim": "metrics.jsonl's trimmed copy written, before it replaces the file",
    "save": "a checkpoint's files written, before its COMPLETE marker",
    "checkpoint": "a checkpoint is due, before any of its files is written",
}


def _parse(value: str | None) -> tuple[str | None, int]:
    """The point and count ``SRTRAIN_FAULT_AT`` names (None: no point)."""
    if not value:
        return None, 0
    point, _, count = value.partition(":")
    if point not in POINTS or not (count or "1").isdigit() or int(count or "1") < 1:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected <point>[:<n>] with a point of {', '.join(POINTS)}"
        )
    return point, int(count or "1")


_AT, _LEFT = _parse(os.environ.get(FAULT_ENV))


def fault_point(name: str) -> None:
    """SIGKILL this process here if ``SRTRAIN_FAULT_AT`` names ``name`` and this is the time
    it counts down to."""
    global _LEFT
    if name == _AT:
        _LEFT -= 1
        if _LEFT == 0:
            os.kill(os.getpid(), signal.SIGKILL)
