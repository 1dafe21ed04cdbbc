"""``python -m experiments.kernel_bench``: the fused step's kernel benchmarks (the lab).

Run from a checkout's root. Kernel rows on a CUDA device (``--dry`` counts bytes only),
``--sweep`` of launch shapes, ``--sass`` instruction counts compiled for sm_90 (no GPU
needed), ``--model`` and ``--host`` whole-model step and host time, ``--compare`` a launch
option side by side, ``--trees`` any of these on several source trees. What users measure
(the headline table and its guard, capacity) is ``srtrain bench``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.kernel_bench.host_time import host_time_rows
from experiments.kernel_bench.rows import (
    BENCH_COLS,
    STATE_PAIRS,
    bench_shape,
    dry_run,
    launch_sweep,
    run_kernel_bench,
    run_model_bench,
)
from experiments.kernel_bench.sass import instruction_report, launch_shape_report, line_report
from experiments.kernel_bench.side_by_side import (
    COMPARE_STATES,
    LAUNCH_OPTIONS,
    compare_launch_option,
    parse_compare,
    parse_states,
)
from experiments.kernel_bench.trees import compare_trees, tree_arguments
from srtrain.bench.__main__ import environment
from srtrain.bench.trees import parse_trees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_bench", description=__doc__)
    parser.add_argument("--numel", type=int, default=2**28)
    parser.add_argument(
        "--cols",
        type=int,
        default=BENCH_COLS,
        help="row length of the fused step's tensor (kernels, --dry, --sweep, "
        f"--compare; default {BENCH_COLS}); --numel must be a multiple",
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--json",
        "--out",
        type=Path,
        help="write results here",
    )
    parser.add_argument(
        "--dry",
        action="store_true",
        help="byte accounting only, no GPU",
    )
    parser.add_argument(
        "--states",
        help="state pairs of bf16, fp8, fp4, fp8-fp4 for the kernel bench, --model, --dry and "
        "--sweep (default bf16,fp8,fp4), --compare (default all) and "
        "--sass --by-line (default fp8)",
    )
    parser.add_argument("--sweep", action="store_true", help="fused-step launch-shape sweep")
    parser.add_argument(
        "--sass",
        action="store_true",
        help="instructions per element of the fused step compiled for sm_90 "
        "(no GPU needed); with --sweep, at the sweep's launch shapes",
    )
    parser.add_argument(
        "--by-line",
        action="store_true",
        help="with --sass: a full tile's instructions by source line, for --states (default fp8)",
    )
    parser.add_argument(
        "--health",
        action="store_true",
        help="with --sass: the step of a log step, which counts the health counts "
        "(underflow, saturated, scale_changed); else the ordinary step",
    )
    parser.add_argument(
        "--model", metavar="PRESET", help="whole-model optimizer step over this preset's shards"
    )
    parser.add_argument(
        "--shadow-sample",
        type=int,
        default=0,
        metavar="N",
        help="--model: also time the step with an FP32 shadow on one block in N (0: not)",
    )
    parser.add_argument(
        "--compare",
        metavar="OPTION=V1,V2",
        help="fused step at each value of a launch option, side by side "
        f"(options: {', '.join(LAUNCH_OPTIONS)})",
    )
    parser.add_argument(
        "--trees",
        metavar="NAME=PATH,NAME=PATH",
        help="run this bench mode on each source tree (a directory holding "
        "srtrain/, one process each), side by side",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds of --compare and --trees"
    )
    parser.add_argument(
        "--host", metavar="PRESET", help="host time of the optimizer step over this preset's shards"
    )
    parser.add_argument("--worlds", default="8,1", help="world sizes of --host and --model")
    args = parser.parse_args(argv)
    try:
        trees = parse_trees(args.trees) if args.trees else None
        tree_argv = tree_arguments(sys.argv[1:] if argv is None else argv) if trees else None
        compared = parse_compare(args.compare) if args.compare else None
        if compared:
            pairs = parse_states(args.states or ",".join(COMPARE_STATES))
        elif args.by_line:
            pairs = parse_states(args.states or "fp8")
        else:
            pairs = parse_states(args.states) if args.states else STATE_PAIRS
        if not (args.model or args.host or args.sass):
            bench_shape(args.numel, args.cols)
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError as err:
        parser.error(str(err))
    if args.by_line and not args.sass:
        parser.error("--by-line goes with --sass")
    if args.health and (not args.sass or args.sweep):
        parser.error("--health goes with --sass (not --sweep)")
    if args.rounds < 1 or min(worlds) < 1:
        parser.error("--rounds and --worlds take positive integers")
    if args.shadow_sample < 0:
        parser.error("--shadow-sample takes a non-negative integer (0: no shadow rows)")
    extra = {}
    if trees:
        try:
            rows, runs = compare_trees(trees, tree_argv, args.rounds)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        extra = {
            "trees": {name: {"path": str(path), "runs": runs[name]} for name, path in trees.items()}
        }
    elif args.dry:
        rows = dry_run(args.numel, pairs, args.cols)
    elif args.sass:
        if args.by_line:
            rows = line_report(pairs, args.health)
        else:
            rows = launch_shape_report() if args.sweep else instruction_report(args.health)
    elif args.model:
        rows = run_model_bench(args.model, args.repeats, pairs, worlds, args.shadow_sample)
    elif args.sweep:
        rows = launch_sweep(args.numel, args.repeats, pairs, args.cols)
    elif args.host:
        try:
            rows = host_time_rows(args.host, args.repeats, worlds)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print(
            "error: benchmarks need a CUDA device (use --dry for byte accounting)", file=sys.stderr
        )
        return 2
    elif compared:
        rows = compare_launch_option(
            *compared, pairs, args.numel, args.repeats, args.rounds, args.cols
        )
    else:
        rows = run_kernel_bench(args.numel, args.repeats, pairs, args.cols)
    result = {
        "environment": {**environment("python -m experiments.kernel_bench"), **extra},
        "rows": rows,
    }
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    for row in rows:
        cells = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
        print(" | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
