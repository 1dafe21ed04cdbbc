"""A write that ran out of room, told in one line: which directory, how much it needed, how
much there was.

Room runs out two ways: the file system is full (ENOSPC, EDQUOT for a quota) or the process's
file size limit (``ulimit -f``, RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with
EFBIG). :func:`out_of_space` recognises either in an exception and its causes, including the
forms torch gives them: DCP's CheckpointException, which holds each rank's failure, and
``torch.save``'s zip writer, which reports a short write as ``unexpected pos`` without the
errno. :func:`no_space` measures what is left and words the error.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path

MIB = 1 << 20
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# torch.save's zip writer when a write came up short (its errno is lost on the way).
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing")


class NoSpaceError(RuntimeError):
    """A write that found no room (disk full, quota or file size limit), in one line."""


def _causes(err: BaseException) -> list[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures DCP gathered in it."""
    seen: list[BaseException] = []
    pending = [err]
    while pending:
        current = pending.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        pending += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():
            # DCP keeps (exception, stack summary) pairs
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return [e for e in seen if isinstance(e, BaseException)]


def out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a write that found no room."""
    for cause in _causes(err):
        if isinstance(cause, NoSpaceError):
            return True
        if isinstance(cause, OSError) and cause.errno in _SPACE_ERRNOS:
            return True
        if isinstance(cause, RuntimeError) and any(s in str(cause) for s in _SHORT_WRITE):
            return True
    return False


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged write may still take on ``path``'s file system (its nearest
    existing ancestor's)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def file_size_limit() -> int | None:
    """The process's file size limit in bytes (``ulimit -f``); None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def no_space(
    path: str | os.PathLike[str],
    needed: int | None = None,
    largest_file: int | None = None,
    free: int | None = None,
) -> NoSpaceError:
    """The error of a write under ``path`` that found no room: ``needed`` bytes in all (None:
    not known), the largest file ``largest_file`` bytes (default ``needed``), ``free`` bytes
    free when it began (default: free now). Names the file size limit when it is what
    stopped the write, else the free space."""
    needed_text = "" if needed is None else f"{needed / MIB:.1f} MiB needed, "
    limit, largest = file_size_limit(), largest_file if largest_file is not None else needed
    if limit is not None and (largest is None or largest >= limit or needed is None):
        return NoSpaceError(
            f"no space left on {path}: {needed_text}{limit / MIB:.1f} MiB allowed per file by "
            "the file size limit (ulimit -f); raise it (ulimit -f unlimited) and run the same "
            "command again"
        )
    return NoSpaceError(
        f"no space left on {path}: {needed_text}"
        f"{(free_bytes(path) if free is None else free) / MIB:.1f} MiB free; free "
        "some space there (or choose a train.run_dir on another disk) and run the same command "
        "again"
    )
