"""Errors a user can cause: which they are, their one line, and agreeing on them across ranks.

A run's start is a sequence of steps, some rank-local (reading files, preparing data, writing
the run dir on rank 0). :func:`agree` runs one such step on every rank and, when it failed on
any rank, raises on every rank, so no rank waits forever in the next collective for one that
gave up. :func:`exit_code` turns the exception a run ended with into the command line's
output: one ``error: ...`` line from rank 0 and exit code 2 for an error a user can cause;
the traceback of a bug as usual. ``SRTRAIN_DEBUG=1`` prints the traceback of every error.

Two errors are a rank's own rather than the run's: its environment's (a full disk, a file
system path), which another rank may never see, and a collective failing because another
rank's process ended (:func:`lost_peer`). The first is printed by the rank it happened on;
the second is one line saying which rank lost its peer, so the error of the rank that failed
first stays the one ``error:`` line.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from srtrain.checkpoint import AGREED, CheckpointError
from srtrain.config import ConfigError
from srtrain.corpus import DataError
from srtrain.nospace import NoSpaceError

USER_ERRORS = (ConfigError, DataError, CheckpointError, NoSpaceError)
EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_SKIPPED = 3  # the run ended, but skipped too many steps (train.max_skipped_fraction)
DEBUG_ENV = "SRTRAIN_DEBUG"
# How torch.distributed's backends and store report a peer whose process has ended.
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crashing"
    r"|NCCL communicator was aborted|Socket closed|recvValue failed|failed to recv"
)

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


def lost_peer(err: BaseException) -> str | None:
    """What a collective that failed because another rank's process ended said (the
    backend's phrase); None for any other error."""
    seen: list[BaseException] = []
    while err is not None and not any(err is e for e in seen):
        seen.append(err)
        match = _LOST_PEER.search(str(err))
        if match:
            return match.group(0)
        err = err.__cause__ or err.__context__
    return None


def _rank_local(err: BaseException) -> bool:
    """Whether ``err`` is this rank's environment's, unknown to the other ranks (a full disk,
    a path; not one every rank raised after agreeing on it)."""
    if getattr(err, AGREED, False) or not (dist.is_available() and dist.is_initialized()):
        return False
    return isinstance(err, NoSpaceError) or (isinstance(err, OSError) and err.filename is not None)


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
        setattr(error, AGREED, True)
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
    exit code 2; an error of one rank's environment (:func:`_rank_local`) on another rank:
    ``error: rank K: <one line>`` from that rank. A collective that lost its peer (another
    rank's process ended first): ``rank K lost its peer ...`` from this rank, exit code 2.
    A run that skipped too many steps: ``warning: <one line>``, exit code 3. Another rank's
    bug: one line on rank 0, exit code 1. A bug on this rank is re-raised (its traceback).
    ``SRTRAIN_DEBUG=1`` adds the traceback on every rank.
    """
    rank = _rank()
    if isinstance(err, SkippedStepsError):
        if rank == 0:
            print(f"warning: {err}", file=sys.stderr, flush=True)
        return EXIT_SKIPPED
    message = user_message(err)
    peer = lost_peer(err) if message is None else None
    if message is None and peer is None and not isinstance(err, RankFailedError):
        raise err
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(err, file=sys.stderr)
    if peer is not None:
        line = (
            f"rank {rank} lost its peer ({peer}): another rank's process ended first; its "
            "error is the run's (above, or in the launcher's report)"
        )
        print(line, file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if rank == 0:
        line = message or f"{err}; see that rank's traceback"
        print(f"error: {line}", file=sys.stderr, flush=True)
    elif message is not None and _rank_local(err):
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR if message is not None else EXIT_BUG
