"""Command line: ``python -m srtrain.data prepare`` a data directory, ``merge`` its parts."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from srtrain.console import Ticker, print_line
from srtrain.corpus import BUILTIN_MAX_BYTES, DataError
from srtrain.data.merge import merge
from srtrain.data.meta import (
    DEFAULT_TOKENIZER_KIND,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    SHARD_TOKENS,
    TOKENIZER_SAMPLE_BYTES,
    load_meta,
)
from srtrain.data.prepare import TOKENIZER_KINDS, parse_part, prepare

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.data", description="Prepare token data for srtrain."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize a text source into token shards")
    p.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="'builtin' (the Python stdlib), 'packages' (sources and docs of the installed "
        "Python packages), .txt/.json/.jsonl/.parquet files or dirs (.txt/.json/.jsonl also "
        ".gz/.bz2/.xz/.zst), "
        "or a Hugging Face dataset name[:config]",
    )
    p.add_argument("--out", required=True, help="directory to create")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer",
        help="existing tokenizer: a SentencePiece .model, a tokenizer.json, or a transformers "
        "tokenizer/model directory (local files only)",
    )
    tok.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument(
        "--tokenizer-kind",
        choices=TOKENIZER_KINDS,
        default=DEFAULT_TOKENIZER_KIND,
        help="the tokenizer trained without --tokenizer: SentencePiece BPE or byte-level BPE",
    )
    p.add_argument(
        "--tokenizer-sample-bytes",
        type=int,
        default=TOKENIZER_SAMPLE_BYTES,
        help="at most this much train text (a seeded sample of documents) trains the tokenizer",
    )
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-bytes", type=int, help=f"text cap (builtin: {BUILTIN_MAX_BYTES})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    p.add_argument("--workers", type=int, help="tokenizer processes (default: all cores)")
    p.add_argument(
        "--part",
        help="i/N: prepare the i-th of N disjoint parts (one per machine) under OUT/parts; "
        "then run merge --out OUT",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a prepared --out")
    m = commands.add_parser("merge", help="join the parts prepared with --part into --out")
    m.add_argument("--out", required=True, help="the --out the parts were prepared for")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `prepare` a data directory or `merge` its parts."""
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        if args.command == "merge":
            out = merge(args.out, progress=Ticker(print_line))
        else:
            out = prepare(
                args.source[0] if len(args.source) == 1 else args.source,
                args.out,
                vocab_size=args.vocab_size,
                tokenizer=args.tokenizer,
                tokenizer_kind=args.tokenizer_kind,
                tokenizer_sample_bytes=args.tokenizer_sample_bytes,
                val_fraction=args.val_fraction,
                text_field=args.text_field,
                max_bytes=args.max_bytes,
                seed=args.seed,
                shard_tokens=args.shard_tokens,
                workers=args.workers,
                part=parse_part(args.part) if args.part else None,
                overwrite=args.overwrite,
                progress=Ticker(print_line),
            )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = load_meta(out)
    counts = ", ".join(f"{name} {s.num_tokens:,} tokens" for name, s in meta.splits.items())
    print(
        f"prepared {out}: vocab {meta.vocab_size}, {meta.dtype}, {counts} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0
