#!/usr/bin/env python3
"""Training a new tokenizer: time and memory against the text it samples, filed for
docs/data.md.

Usage: python tools/tokenizer_bench.py --record docs/results/data/prepare/DATE-cpu-tokenizer.json

For each tokenizer kind (SentencePiece BPE, byte-level BPE) and each ``--sample-mb``, runs
the command a user runs to prepare a corpus with a new tokenizer, ``python -m srtrain.data
prepare --source packages --vocab-size 32000 --tokenizer-kind KIND
--tokenizer-sample-bytes S --max-bytes M --workers 1`` (``M`` just over ``S`` of text, so the
sample holds the train text there is), sampling the summed resident memory of the command
and its workers (``tools/peak_rss.py``). It files per run the sample's bytes, the seconds the
console reports for sampling and for training, and the peak memory up to the line that ends
the training (sampling and training) and over the whole command; with the host's load
average before and after. ``tools/figures.py`` renders docs/data.md's table from the newest
record (figure ``tokenizer-training``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
from cpu_record import loaded_environment, write  # noqa: E402
from peak_rss import sampled_run  # noqa: E402

KINDS = {"SentencePiece BPE": "sentencepiece", "byte-level BPE (`tokenizers`)": "bpe"}
TRAINED = "data: tokenizer trained in"
SAMPLED = re.compile(r"data: sampled ([\d.]+) MB of .* for the tokenizer in ([\d.]+) s")
TRAINED_IN = re.compile(r"data: tokenizer trained in ([\d.]+) s")
MB = 1_000_000


def one_run(scratch: Path, name: str, sample_mb: int, vocab_size: int) -> dict:
    """Prepare with a new ``name`` tokenizer trained on ``sample_mb`` MB; what it measured."""
    kind = KINDS[name]
    out = scratch / f"{kind}-{sample_mb}mb"
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "srtrain.data", "prepare", "--source", "packages",
        "--out", str(out), "--vocab-size", str(vocab_size), "--tokenizer-kind", kind,
        "--tokenizer-sample-bytes", str(sample_mb * MB),
        "--max-bytes", str(int(sample_mb * MB / 0.97)), "--workers", "1",
    ]  # fmt: skip
    run = sampled_run(command, marker=TRAINED)
    sampled = SAMPLED.search(run["output"])
    trained = TRAINED_IN.search(run["output"])
    if not (sampled and trained):
        raise RuntimeError(f"no sampling or training line in:\n{run['output']}")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "tokenizer": name,
        "sample_mb": sample_mb,
        "sampled_mb": float(sampled.group(1)),
        "sample_s": float(sampled.group(2)),
        "train_s": float(trained.group(1)),
        "training_peak_rss_gib": run["peak_rss_before_marker_gib"],
        "command_peak_rss_gib": run["peak_rss_gib"],
        "wall_s": run["wall_s"],
    }


def record(out: Path, scratch: Path, sizes: list[int], kinds: list[str], vocab: int) -> dict:
    """Every run, filed to ``out`` with the environment."""
    scratch.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    rows = []
    for name in kinds:
        for size in sizes:
            rows.append(one_run(scratch, name, size, vocab))
            print(rows[-1], flush=True)
    argv = " ".join(sys.argv[1:]) if __name__ == "__main__" else f"--record {out}"
    data = {
        "environment": loaded_environment(f"python tools/tokenizer_bench.py {argv}", load_before),
        "vocab_size": vocab,
        "rows": rows,
    }
    return write(out, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/srtrain-tokenizer-bench"))
    parser.add_argument("--sample-mb", default="25,50,100,200", help="sample sizes, MB")
    parser.add_argument("--kinds", default=",".join(KINDS.values()), help="sentencepiece,bpe")
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args(argv)
    by_kind = {kind: name for name, kind in KINDS.items()}
    kinds = [by_kind[k] for k in args.kinds.split(",")]
    sizes = [int(s) for s in args.sample_mb.split(",")]
    record(args.record, args.scratch, sizes, kinds, args.vocab_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
