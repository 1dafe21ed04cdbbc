"""Checkpoint save and load times: synchronous and asynchronous DCP saves of a sharded run."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_checkpoint_bench(
    preset: str = "llama-1b",
    state_format: str = "fp8",
    vocab_size: int = 32000,
    root: str | None = None,
) -> list[dict]:
    """Save (sync, async) and load one checkpoint of ``preset`` with ``state_format`` states."""
    from srtrain.models import build_model, init_weights
    from srtrain.optim import SRAdamW
    from srtrain.parallel import apply_fsdp, device_mesh, init_distributed

    info = init_distributed()
    model = build_model(preset, vocab_size, 1024)
    apply_fsdp(model, device_mesh(info))
    model.to_empty(device=info.device)
    init_weights(model, 0)
    m_format = "fp4_e2m1" if state_format == "fp4" else state_format
    v_format = "fp4_e2m2" if state_format == "fp4" else state_format
    optimizer = SRAdamW(model.parameters(), lr=1e-4, m_format=m_format, v_format=v_format)
    for p in model.parameters():  # one real step so states hold non-zero codes
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rows = time_checkpoints(model, optimizer, info, root)
    return [{"preset": preset, "states": state_format, **row} for row in rows]


def time_checkpoints(model, optimizer, info, root: str | None = None) -> list[dict]:
    """Save ``model`` and ``optimizer`` synchronously, then asynchronously, then load the
    second save: one row each (``blocking_s`` until the call returned, ``complete_s`` until
    the checkpoint was whole, ``bytes`` on disk). Every rank calls it. The checkpoints go to a
    fresh directory under ``root`` (default: the system's temporary directory); the first is
    removed before the second is written, so the disk holds one at a time."""
    from srtrain.checkpoint import CheckpointManager, load

    work = Path(tempfile.mkdtemp(dir=root)) if info.rank == 0 else None
    shared = [str(work) if work is not None else None]
    dist.broadcast_object_list(shared, src=0)
    work = Path(shared[0])
    rows = []
    try:
        for mode in ("sync", "async"):
            manager = CheckpointManager(work / mode, keep=1, async_save=mode == "async")
            _sync(info.device)
            dist.barrier()
            start = time.perf_counter()
            path = manager.save(1, model, optimizer, {"step": 1})
            returned = time.perf_counter() - start
            manager.wait()
            total = time.perf_counter() - start
            manager.close()
            dist.barrier()
            rows.append(
                {
                    "name": f"save {mode}",
                    "world_size": info.world_size,
                    "blocking_s": returned,
                    "complete_s": total,
                    "bytes": _dir_bytes(path),
                }
            )
            if mode == "sync" and info.rank == 0:
                shutil.rmtree(work / mode)
            dist.barrier()
        start = time.perf_counter()
        load(path, model, optimizer)
        _sync(info.device)
        elapsed = time.perf_counter() - start
        rows.append(
            {
                "name": "load",
                "world_size": info.world_size,
                "blocking_s": elapsed,
                "complete_s": elapsed,
                "bytes": _dir_bytes(path),
            }
        )
    finally:
        dist.barrier()
        if info.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return rows
