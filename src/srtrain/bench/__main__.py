"""``srtrain bench`` (``python -m srtrain.bench``): what a user measures on their GPUs.

``--headline`` (the headline table; with ``--trees`` and/or ``--compare`` the regression
guard), ``--capacity`` (the largest model one GPU trains), ``--checkpoint`` (save and load
times under torchrun) and ``--train`` (end-to-end training of state variants). The
kernel-level benchmarks of the project's own work run from a checkout:
``python -m experiments.kernel_bench``."""

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
    LADDER,
    Recorder,
    build_plan,
    parse_names,
    read_rows,
    run_capacity,
    summarize,
    summary_table,
)
from srtrain.bench.capacity_trial import VARIANTS as CAPACITY_VARIANTS
from srtrain.bench.checkpoint_bench import run_checkpoint_bench
from srtrain.bench.end_to_end import run_variants
from srtrain.bench.trees import parse_trees, tree_digest


def cpu_name() -> str:
    """``a 2-core AMD EPYC ...`` from /proc/cpuinfo (the machine type where it is missing)."""
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"a {os.cpu_count()}-core {name}"


def environment(program: str = "python -m srtrain.bench") -> dict:
    """Date, device, software versions, commit (``SRTRAIN_COMMIT`` or git), the digest of the
    srtrain sources that run (which names their commit where git is stale) and command (this
    process's arguments after ``program``) of a result."""
    commit = os.environ.get("SRTRAIN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            commit = ""
    commit = commit or "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "source_digest": tree_digest(Path(__file__).resolve().parents[2]),
        "command": " ".join([program, *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="srtrain bench", description=__doc__)
    modes = parser.add_mutually_exclusive_group(required=True)
    modes.add_argument(
        "--headline",
        action="store_true",
        help="the headline table: the optimizer step at default arguments, the LLaMA-1B "
        "recipes end to end, the recorded capacity (--out DIR: headline.json and .md); with "
        "--trees and/or --compare BASELINE.json, the regression guard",
    )
    modes.add_argument(
        "--capacity",
        action="store_true",
        help="largest LLaMA shape each variant trains on one GPU, and the best "
        "tokens/s at 7B (one process per trial)",
    )
    modes.add_argument(
        "--checkpoint",
        metavar="PRESET",
        help="time checkpoint save/load of this preset (run under torchrun)",
    )
    modes.add_argument(
        "--train",
        action="store_true",
        help="end-to-end training of each --variants entry",
    )
    parser.add_argument(
        "--json",
        "--out",
        type=Path,
        help="write results here (--headline: a directory; --capacity: rewritten after "
        "every trial)",
    )
    parser.add_argument(
        "--variants",
        help="--train: of torch,fp32,bf16,fp8,fp4 (default all); "
        f"--capacity: of {','.join(CAPACITY_VARIANTS)} (default all); "
        f"--headline: of {','.join(headline.TRAIN_VARIANTS)} (default all)",
    )
    parser.add_argument("--repeats", type=int, default=50, help="--headline: timed steps")
    parser.add_argument(
        "--dry", action="store_true", help="--capacity: the CPU path on small shapes"
    )
    parser.add_argument(
        "--rungs", help=f"--capacity: ladder rungs to search (default {','.join(LADDER)})"
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
    parser.add_argument("--states", help="state format for --checkpoint (default fp8)")
    parser.add_argument(
        "--compare",
        metavar="BASELINE.json",
        help="--headline: a recorded headline.json to compare against (the guard)",
    )
    parser.add_argument(
        "--trees",
        metavar="NAME=PATH,NAME=PATH",
        help="--headline: measure each source tree (a directory holding srtrain/, one "
        "process each), interleaved: the guard",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="--headline: interleaved rounds (default 2)"
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
    if args.checkpoint:
        rows = run_checkpoint_bench(args.checkpoint, args.states or "fp8")
    else:
        rows = run_variants(
            args.overrides, (args.variants or "torch,fp32,bf16,fp8,fp4").split(","), args.nproc
        )
    result = {"environment": environment(), "rows": rows}
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
