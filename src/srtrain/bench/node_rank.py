"""One rank of a ``python -m srtrain.bench.node`` launch (run under torchrun).

``trial SPEC.json ROW.json [--after replicas|checkpoint] [--root DIR]``: a capacity trial
(:func:`srtrain.bench.capacity_trial.run_trial`) on every rank, each rank writing its own row;
``--after replicas`` then compares the replicas' parameters and optimizer states bit for bit,
``--after checkpoint`` times DCP saves and a load under ``--root``.

``train ROW.json OVERRIDES...``: ``srtrain.trainer.run`` with the overrides; rank 0 writes the
run's summary with every rank's peak memory. A failure is written as a row (``fit`` false,
``oom``, the error) by the rank that saw it, and the process exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from srtrain.bench.capacity_trial import (
    GIB,
    TrialSpec,
    error_line,
    is_oom,
    run_trial,
    write_row,
)

REPLICATE_DIM = "replicate"


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (any dtype, 0-d included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare_replicas(model, optimizer, mesh, info) -> dict:
    """Compare, bit for bit, this rank's parameter shards and optimizer states with those of
    the ranks holding the same shards in the other replicas (an all-gather over the mesh's
    replicate dim); the counts are summed over all ranks. Nothing to compare on a 1-D mesh."""
    from srtrain.optim.shards import local_shard

    if mesh.ndim != 2:
        return {}
    group = mesh.get_group(REPLICATE_DIM)
    replicas = dist.get_world_size(group)
    tensors, others = [], []
    for name, p in model.named_parameters():
        tensors.append(local_shard(p))
        for key, value in sorted(optimizer.state[p].items()):
            if isinstance(value, torch.Tensor):
                tensors.append(local_shard(value))
            else:
                others.append((name, key, value))
    mismatched = compared = 0
    for t in tensors:
        mine = _bytes_of(t)
        gathered = [torch.empty_like(mine) for _ in range(replicas)]
        dist.all_gather(gathered, mine, group=group)
        mismatched += sum(not torch.equal(g, mine) for g in gathered)
        compared += mine.numel()
    values: list = [None] * replicas
    dist.all_gather_object(values, others, group=group)
    mismatched += sum(v != others for v in values)
    totals = torch.tensor([mismatched, compared, len(tensors)], device=info.device)
    dist.all_reduce(totals)
    mismatched, compared, count = (int(x) for x in totals.tolist())
    return {
        "replicas_identical": mismatched == 0,
        "replica_mismatches": mismatched,
        "replica_tensors_compared": count,
        "replica_bytes_compared": compared,
    }


def time_checkpoints_after(model, optimizer, mesh, info, root: str | None) -> dict:
    """Checkpoint save (sync, async) and load times and bytes of the trained model."""
    from srtrain.bench.checkpoint_bench import time_checkpoints

    return {"checkpoints": time_checkpoints(model, optimizer, info, root)}


def _peaks(device: torch.device) -> dict:
    """This process's peak memory, GiB: CUDA allocated and reserved, else the CPU's max RSS."""
    from srtrain.metrics import peak_memory_gib

    if device.type == "cuda":
        return {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_allocated_gib": peak_memory_gib(device)[0]}


def _report(report) -> dict:
    """A stall report as JSON data (NaN as None)."""

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        return None if isinstance(x, float) and math.isnan(x) else x

    return clean(
        {
            "stalled": report.stalled,
            "stalled_by_group": report.stalled_by_group,
            "param_changed": report.param_changed,
            "param_changed_by_group": report.param_changed_by_group,
            "state_counts": report.state_counts,
            "state_counts_by_group": report.state_counts_by_group,
            "health_steps": report.health_steps,
            "element_steps": report.element_steps,
        }
    )


def run_training(overrides: list[str], out: Path) -> None:
    """Train with ``overrides``; rank 0 writes the summary (a failing rank its error row)."""
    from srtrain.config import load_config
    from srtrain.parallel import init_distributed
    from srtrain.trainer import predicted_stalls, run

    row: dict = {}
    try:
        cfg = load_config(None, overrides)
        info = init_distributed(None if cfg.parallel.device == "auto" else cfg.parallel.device)
        result = run(cfg)
        peaks: list = [None] * info.world_size
        dist.all_gather_object(peaks, _peaks(info.device))
        if info.rank != 0:
            return
        rates = result.tokens_per_s[1:] or result.tokens_per_s
        mfus = result.mfu[1:] or result.mfu
        reports = sorted(result.stall_reports.items())
        row = {
            "fit": True,
            "world_size": info.world_size,
            "steps": cfg.train.steps,
            "losses": result.losses,
            "tokens_per_s": statistics.median(rates) if rates else None,
            "mfu": statistics.median(mfus) if mfus else None,
            "per_rank_peak_allocated_gib": [p["peak_allocated_gib"] for p in peaks],
            "peak_allocated_gib": max(p["peak_allocated_gib"] for p in peaks),
            "state_bytes_per_param": result.state_bytes_per_param,
            "skipped_steps": result.skipped_steps,
            "resets": {str(k): v for k, v in result.resets.items()},
            "predicted_stalls": predicted_stalls(cfg),
            "stall_reports": {str(step): _report(r) for step, r in reports},
        }
        if "peak_reserved_gib" in peaks[0]:
            row["per_rank_peak_reserved_gib"] = [p["peak_reserved_gib"] for p in peaks]
    except Exception as err:  # the failure is the launch's result
        row = {"fit": False, "oom": is_oom(err), "error": error_line(err)}
        if torch.cuda.is_initialized():
            row["failure_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    write_row(row, out)


def main(argv: list[str]) -> int:
    """Run one job of this rank (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m srtrain.bench.node_rank")
    jobs = parser.add_subparsers(dest="job", required=True)
    trial = jobs.add_parser("trial")
    trial.add_argument("spec", type=Path)
    trial.add_argument("row", type=Path)
    trial.add_argument("--after", choices=("replicas", "checkpoint"))
    trial.add_argument("--root")
    train = jobs.add_parser("train")
    train.add_argument("row", type=Path)
    train.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.job == "trial":
        after = {
            None: None,
            "replicas": compare_replicas,
            "checkpoint": partial(time_checkpoints_after, root=args.root),
        }[args.after]
        spec = TrialSpec.from_dict(json.loads(args.spec.read_text()))
        write_row(run_trial(spec, after), args.row)
    else:
        run_training(args.overrides, args.row)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
