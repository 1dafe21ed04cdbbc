"""``python -m experiments.study``: run a grid, the frozen-weights run, or write the report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from experiments.study.grid import GRIDS, GridError, load_grid
from srtrain.config import ConfigError, load_config
from srtrain.data import DataError


def _run(args: argparse.Namespace) -> int:
    from experiments.study.runner import check_out_dir, parse_gpus, run_grid, run_overrides
    from srtrain.data import load_meta

    grid = load_grid(args.grid)
    if args.only:
        grid = grid.select(n.strip() for n in args.only.split(",") if n.strip())
    gpus = parse_gpus(args.gpus)
    out = Path(args.out)
    data_dirs = set()
    for run in grid.runs:  # every config must load before anything starts
        try:
            cfg = load_config(
                run.config, run_overrides(run, args.overrides, gpus == ["cpu"], out / run.name)
            )
        except ConfigError as err:
            raise ConfigError(f"run {run.name}: {err}") from None
        data_dirs.add(cfg.data.dir)
    check_out_dir(out)
    if args.export:
        check_out_dir(Path(args.export))
    for data_dir in sorted(data_dirs):  # prepared once beforehand, never by each run
        load_meta(data_dir)
    export = Path(args.export) if args.export else None
    summary = run_grid(
        grid, out, gpus, args.per_gpu, args.deadline, args.overrides, export, args.resume
    )
    counts: dict[str, int] = {}
    for entry in summary["runs"]:
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    print(
        f"{grid.name}: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; summary in {out / 'summary.json'}",
        flush=True,
    )
    return 0


def _frozen(args: argparse.Namespace) -> int:
    import torch

    from experiments.study.frozen import FrozenSetup, write_frozen
    from experiments.study.runner import check_out_dir
    from srtrain.models import PRESETS

    if args.preset not in PRESETS:
        raise GridError(f"--preset {args.preset!r}: unknown; allowed: {', '.join(PRESETS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise GridError("--device cuda: no CUDA device is available; use --device cpu")
    for name in ("steps", "batch", "seq_len", "bins"):
        if getattr(args, name) < 1:
            raise GridError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not args.lr > 0:
        raise GridError(f"--lr {args.lr}: must be > 0")
    out = check_out_dir(Path(args.out))
    setup = FrozenSetup(
        preset=args.preset,
        data_dir=args.data_dir,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        batch=args.batch,
        seq_len=args.seq_len,
        weight_decay=args.weight_decay,
        device=args.device,
        bins=args.bins,
    )
    path = write_frozen(setup, out)
    print(f"frozen weights: {path}", flush=True)
    return 0


def _report(args: argparse.Namespace) -> int:
    from experiments.study.report import write_report

    written = write_report([Path(d) for d in args.dirs], Path(args.out))
    print("\n".join(str(p) for p in written), flush=True)
    return 0


def _list(args: argparse.Namespace) -> int:
    grid = load_grid(args.grid)
    for run in grid.runs:
        print(f"{run.name:<20} {run.config.name}  {' '.join(run.overrides)}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m experiments.study``."""
    p = argparse.ArgumentParser(prog="python -m experiments.study", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    grids = f"{', '.join(GRIDS)}, or a .yaml/.json grid file"

    run = sub.add_parser("run", help="train every run of a grid, a few per GPU")
    run.add_argument("--grid", required=True, help=grids)
    run.add_argument("--out", required=True, help="output directory (its parent must exist)")
    run.add_argument("--gpus", help="'cpu' or GPU indices like 0,1 (default: every GPU)")
    run.add_argument("--per-gpu", type=int, default=1, help="runs at a time on each GPU")
    run.add_argument(
        "--deadline", type=float, help="seconds from start after which runs still going are stopped"
    )
    run.add_argument("--only", help="comma-separated run names (default: all, in grid order)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue an earlier call on --out: completed runs are kept, runs "
        "with a checkpoint resume from it (give them checkpoint.enabled=true "
        "and a checkpoint.interval), others start afresh",
    )
    run.add_argument("--export", help="also keep summary.json and results.tar.gz (only) here")
    run.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="after --: overrides for every run (train.steps also sets the "
        "warmup to 10%% of the steps unless optim.warmup_steps is given)",
    )
    run.set_defaults(fn=_run)

    frozen = sub.add_parser("frozen", help="BF16 weights without master copy: NR vs SR")
    frozen.add_argument("--out", required=True, help="output directory for frozen.json")
    frozen.add_argument("--steps", type=int, default=300)
    frozen.add_argument("--lr", type=float, default=1e-4, help="constant learning rate")
    frozen.add_argument("--preset", default="llama-60m")
    frozen.add_argument("--data-dir", default="data/study", help="a prepared data directory")
    frozen.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available"
    )
    frozen.add_argument("--seed", type=int, default=0)
    frozen.add_argument("--batch", type=int, default=16)
    frozen.add_argument("--seq-len", type=int, default=256)
    frozen.add_argument("--weight-decay", type=float, default=0.0)
    frozen.add_argument("--bins", type=int, default=30, help="log-spaced bins of initial |w|")
    frozen.set_defaults(fn=_frozen)

    report = sub.add_parser("report", help="results.md and figures from study outputs")
    report.add_argument(
        "dirs",
        nargs="+",
        help="directories with summary.json, results.tar.gz, run directories or frozen.json",
    )
    report.add_argument("--out", default="docs/results", help="where results.md and PNGs go")
    report.set_defaults(fn=_report)

    show = sub.add_parser("list", help="print a grid's runs and their overrides")
    show.add_argument("--grid", required=True, help=grids)
    show.set_defaults(fn=_list)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run it; configuration and input errors are one line."""
    args = parser().parse_args(argv)
    if getattr(args, "device", "unset") is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return args.fn(args)
    except (GridError, ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
