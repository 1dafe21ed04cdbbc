"""``python -m srtrain.bench``: kernel benchmarks on a CUDA device (``--dry`` counts bytes only)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from srtrain.bench import headline
from srtrain.bench.capacity import (
    Recorder,
    build_plan,
    parse_names,
    read_rows,
    run_capacity,
    summarize,
    summary_table,
)
from srtrain.bench.checkpoint_bench import run_checkpoint_bench
from srtrain.bench.end_to_end import run_variants
from srtrain.bench.host_time import host_time_rows
from srtrain.bench.kernels import (
    BENCH_COLS,
    STATE_PAIRS,
    bench_shape,
    dry_run,
    launch_sweep,
    run_kernel_bench,
    run_model_bench,
)
from srtrain.bench.sass import instruction_report, launch_shape_report, line_report
from srtrain.bench.side_by_side import (
    COMPARE_STATES,
    LAUNCH_OPTIONS,
    compare_launch_option,
    parse_compare,
    parse_states,
)
from srtrain.bench.trees import compare_trees, parse_trees, tree_arguments


def environment() -> dict:
    """Date, device, software versions and commit (``SRTRAIN_COMMIT`` or git) of a result."""
    commit = os.environ.get("SRTRAIN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            commit = ""
    commit = commit or "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "command": " ".join(["python -m srtrain.bench", *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m srtrain.bench", description=__doc__)
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
        help="write results here (--capacity: rewritten after every trial)",
    )
    parser.add_argument(
        "--dry",
        action="store_true",
        help="byte accounting only, no GPU (--capacity: the CPU path on small shapes)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="end-to-end training of each --variants entry instead of kernels",
    )
    parser.add_argument(
        "--variants",
        help="--train: of torch,fp32,bf16,fp8,fp4 (default all); "
        "--capacity: of torch,fp8,fp8-bf16w,fp4-bf16w (default all); "
        f"--headline: of {','.join(headline.TRAIN_VARIANTS)} (default all)",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="largest LLaMA shape each variant trains on one GPU, and the best "
        "tokens/s at 7B (one process per trial)",
    )
    parser.add_argument(
        "--rungs", help="--capacity: ladder rungs to search (default 7b,13b,20b,26b,30b,35b)"
    )
    parser.add_argument(
        "--start",
        help="--capacity: start rung per variant, e.g. "
        "torch=7b,fp4-bf16w=26b (default: the largest rung srtrain.plan "
        "expects to fit)",
    )
    parser.add_argument(
        "--ladder",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--capacity: search the ladder",
    )
    parser.add_argument(
        "--throughput",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--capacity: search micro-batch and checkpointing at --throughput-rung",
    )
    parser.add_argument(
        "--throughput-rung", help="--capacity: shape of the throughput search (default 7b)"
    )
    parser.add_argument(
        "--micro-batches",
        help="--capacity: micro-batches of the throughput search (default 1,2,4,8)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="--capacity: seconds one trial may take (default 300)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="--capacity: seconds for the whole run; no trial starts that could not finish in time",
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="--capacity: summarize recorded result files, run nothing",
    )
    parser.add_argument("--nproc", type=int, default=1, help="GPUs for --train")
    parser.add_argument(
        "--checkpoint",
        metavar="PRESET",
        help="time checkpoint save/load of this preset (run under torchrun)",
    )
    parser.add_argument(
        "--states",
        help="state format for --checkpoint (default fp8); state "
        "pairs of bf16, fp8, fp4, fp8-fp4 for the kernel bench, --model, --dry and "
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
        f"(options: {', '.join(LAUNCH_OPTIONS)}); with --headline: a recorded "
        "headline.json to compare against",
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
    parser.add_argument(
        "--headline",
        action="store_true",
        help="the headline table: the optimizer step at default arguments, the LLaMA-1B "
        "recipes end to end, the recorded capacity (--out DIR: headline.json and .md); with "
        "--trees and/or --compare BASELINE.json, the regression guard",
    )
    parser.add_argument(
        "--parts",
        default=",".join(headline.PARTS),
        help=f"--headline: which parts to measure (default {','.join(headline.PARTS)})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=headline.DEFAULT_STEPS,
        help="--headline: training steps of each end-to-end row "
        f"(default {headline.DEFAULT_STEPS})",
    )
    parser.add_argument(
        "--data-dir",
        default=headline.DEFAULT_DATA_DIR,
        help="--headline: the built-in corpus at a 32k vocabulary, prepared there on first "
        f"use (default {headline.DEFAULT_DATA_DIR})",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=headline.DEFAULT_TOLERANCE,
        help="--headline guard: smallest relative move reported, whatever the noise "
        f"(default {headline.DEFAULT_TOLERANCE})",
    )
    parser.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="--headline: copy a headline.json measured elsewhere into benchmarks/results/, "
        "each tree's commit read from its source digest (run from the checkout)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for --train")
    args = parser.parse_args(argv)
    if args.capacity:
        return _capacity(args, parser)
    if args.headline:
        return _headline(args, parser)
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
        if not (args.checkpoint or args.model or args.host or args.train or args.sass):
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
    elif args.checkpoint:
        rows = run_checkpoint_bench(args.checkpoint, args.states or "fp8")
    elif args.train:
        rows = run_variants(
            args.overrides, (args.variants or "torch,fp32,bf16,fp8,fp4").split(","), args.nproc
        )
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
    result = {"environment": {**environment(), **extra}, "rows": rows}
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    for row in rows:
        cells = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
        print(" | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _headline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--headline``: measure the table on this tree or ``--trees``, guard when comparing;
    ``--record`` files a result measured elsewhere."""
    if args.record is not None:
        try:
            print(headline.record(args.record))
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        parts = tuple(parse_names(args.parts, headline.PARTS, "part"))
        all_variants = ",".join(headline.TRAIN_VARIANTS)
        variants = tuple(
            parse_names(args.variants or all_variants, headline.TRAIN_VARIANTS, "variant")
        )
        trees = parse_trees(args.trees) if args.trees else {"this": Path(__file__).parents[2]}
    except ValueError as err:
        parser.error(str(err))
    baseline = Path(args.compare) if args.compare else None
    if baseline is not None and not baseline.is_file():
        parser.error(f"--compare {baseline}: no such file (give a recorded headline.json)")
    if args.rounds < 1 or args.repeats < 4 or args.steps < 3 * headline.LOG_INTERVAL:
        parser.error(
            f"--rounds takes >= 1, --repeats >= 4 and --steps >= {3 * headline.LOG_INTERVAL}"
        )
    if (len(trees) > 1 or baseline is not None) and args.rounds < 2:
        parser.error("the guard needs --rounds 2 or more: the spread between rounds is its noise")
    if not torch.cuda.is_available():
        print("error: --headline needs a CUDA device", file=sys.stderr)
        return 2
    settings = headline.Settings(
        parts=parts,
        variants=variants,
        rounds=args.rounds,
        repeats=args.repeats,
        steps=args.steps,
        data_dir=args.data_dir,
        tolerance=args.tolerance,
    )
    try:
        return headline.run_headline(
            args.json, trees, settings, environment(), baseline, headline.latest_capacity_files()
        )
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _capacity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--capacity``: run the searches (or summarize ``--report`` files) and print the table."""
    if args.report:
        try:
            rows = read_rows(args.report)
        except ValueError as err:
            parser.error(str(err))
        summary = summarize(rows)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {"environment": environment(), "rows": rows, "summary": summary}, indent=2
                )
            )
        print(summary_table(summary))
        return 0
    try:
        plan = build_plan(
            variants=args.variants,
            rungs=args.rungs,
            starts=args.start,
            ladder=args.ladder,
            throughput=args.throughput,
            throughput_rung=args.throughput_rung,
            micro_batches=args.micro_batches,
            timeout=args.timeout,
            budget=args.budget,
            dry=args.dry,
        )
    except ValueError as err:
        parser.error(str(err))
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("error: --capacity needs a CUDA device (--dry runs its CPU path)", file=sys.stderr)
        return 2
    env = {
        **environment(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    recorder = Recorder(args.json, env, dataclasses.asdict(plan))
    recorder.write()
    run_capacity(plan, recorder, progress=lambda line: print(line, flush=True))
    print(summary_table(summarize(recorder.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
