"""Test helper: ports and torchrun's environment for ranks on this host (gloo on the CPU)."""

from __future__ import annotations

import os
import socket
import sys

import torch

from srtrain.parallel import DistInfo, init_distributed

HOST = "127.0.0.1"
WORKER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives one worker of ``world_size`` on this host, whose group
    meets at 127.0.0.1:``port``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
    }


def set_worker_env(rank: int, world_size: int, port: int, **extra: str) -> None:
    """Put :func:`worker_env` (and ``extra``) into this process's environment: a rank that
    torch.multiprocessing started, as torchrun would have started it."""
    os.environ.update(worker_env(rank, world_size, port), **extra)


def join_gloo(rank: int, world_size: int, port: int) -> DistInfo:
    """Join a gloo group of ``world_size`` ranks on one thread each; one rank runs with no
    torchrun variables at all (a group of its own). Its DistInfo."""
    for key in WORKER_KEYS:
        os.environ.pop(key, None)
    if world_size > 1:
        set_worker_env(rank, world_size, port)
    torch.set_num_threads(1)
    return init_distributed("cpu")


def leave_worker() -> None:
    """End a rank that torch.multiprocessing started, once its results are written and its
    group is destroyed, without the interpreter's teardown: with three or more gloo ranks a
    gloo thread aborted that teardown now and then (SIGABRT, "terminate called without an
    active exception"; about 1 run in 6 of a 3-rank spawn on a 2-core machine), failing a run
    that had passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
