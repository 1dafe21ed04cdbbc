"""Errors a user can cause: which they are, their one line, and agreeing on them across ranks.

A run's start is a sequence of steps, some rank-local (reading files, preparing data, writing
the run dir on rank 0). :func:`agree` runs one such step on every rank and, when it failed on
any rank, raises on every rank, so no rank waits forever in the next collective for one that
gave up. :func:`exit_code` turns the exception a run ended with into the command line's
output: one ``error: ...`` line from rank 0 and exit code 2 for an error a user can cause;
the traceback of a bug as usual. ``SRTRAIN_DEBUG=1`` prints the traceback of every error.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from srtrain.checkpoint import CheckpointError
from srtrain.config import ConfigError
from srtrain.corpus import DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError)
EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_SKIPPED = 3  # the run ended, but skipped too many steps (train.max_skipped_fraction)
DEBUG_ENV = "SRTRAIN_DEBUG"

T = TypeVar("T")


class SkippedStepsError(RuntimeError):
    """A run that reached its last step while skipping more than ``train.max_skipped_fraction``
    of its steps for non-finite gradients; one line."""


class RankFailedError(RuntimeError):
    """Raised on the ranks that did not fail when another rank failed at an agreement."""

    def __init__(self, message: str, rank: int, user_error: bool) -> None:
        super().__init__(f"{message} (on rank {rank})")
        self.rank = rank
        self.user_error = user_error


def user_message(err: BaseException) -> str | None:
    """The one line of an error a user can cause (config, data, checkpoint, a file system
    path they gave); None for anything else (a bug)."""
    if isinstance(err, RankFailedError):
        return str(err) if err.user_error else None
    if isinstance(err, USER_ERRORS):
        return str(err)
    if isinstance(err, OSError) and err.filename is not None:
        target = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else ""
        return f"{target or err.filename}: {err.strerror or err}"
    return None


def agree(action: Callable[[], T], device: torch.device) -> T:
    """Run this rank's part of ``action``; if it raised on any rank, raise on every rank.

    A failing rank re-raises its own exception; the others raise RankFailedError with the
    message of the lowest failing rank. Every rank of the default process group must call
    this at the same point (``device``: where the backend's tensors live).
    """
    error: Exception | None = None
    result = None
    try:
        result = action()
    except Exception as e:  # re-raised below, reported to the others
        error = e
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result
    world = dist.get_world_size()
    flag = torch.tensor(
        [dist.get_rank() if error is not None else world], dtype=torch.int64, device=device
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag)
    if first == world:
        return result
    note = [(str(error), user_message(error) is not None) if error is not None else None]
    dist.broadcast_object_list(note, src=first, device=device)
    if error is not None:
        raise error
    message, user_error = note[0]
    raise RankFailedError(message, first, user_error)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def exit_code(err: Exception) -> int:
    """Report the error a run ended with and return the process's exit code.

    A user's error: ``error: <one line>`` on rank 0's stderr, nothing on the other ranks,
    exit code 2. A run that skipped too many steps: ``warning: <one line>``, exit code 3.
    Another rank's bug: one line on rank 0, exit code 1. A bug on this rank is re-raised
    (its traceback). ``SRTRAIN_DEBUG=1`` adds the traceback on every rank.
    """
    if isinstance(err, SkippedStepsError):
        if _rank() == 0:
            print(f"warning: {err}", file=sys.stderr, flush=True)
        return EXIT_SKIPPED
    message = user_message(err)
    if message is None and not isinstance(err, RankFailedError):
        raise err
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(err, file=sys.stderr)
    if _rank() == 0:
        line = message or f"{err}; see that rank's traceback"
        print(f"error: {line}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR if message is not None else EXIT_BUG
