"""Named points where a fault-injection test kills a run: ``SRTRAIN_FAULT_AT=<point>``.

A process started with ``SRTRAIN_FAULT_AT`` set to one of :data:`POINTS` sends itself SIGKILL
the first time it reaches that point, as a crash or the OOM killer would, leaving its files
exactly as they are at that moment. The variable is read once, at import; unset (every real
run), :func:`fault_point` is one comparison.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "SRTRAIN_FAULT_AT"
POINTS = {
    "metrics-trim": "metrics.jsonl's trimmed copy written, before it replaces the file",
    "save": "a checkpoint's files written, before its COMPLETE marker",
    "checkpoint": "before a run's first checkpoint is saved",
}
_AT = os.environ.get(FAULT_ENV) or None
if _AT is not None and _AT not in POINTS:
    raise ValueError(f"{FAULT_ENV}={_AT!r} is not one of {', '.join(POINTS)}")


def fault_point(name: str) -> None:
    """SIGKILL this process here if ``SRTRAIN_FAULT_AT`` names ``name`` (one of POINTS)."""
    if name == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
