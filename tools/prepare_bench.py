#!/usr/bin/env python3
"""Preparation throughput and memory on this host, timed and filed for docs/data.md.

Usage: python tools/prepare_bench.py --record docs/results/data/prepare/DATE-cpu.json

Tokenizes ``--max-bytes`` of the ``packages`` source (the sources and docs of the running
Python's installed packages) with a 32,000-token tokenizer given (``--tokenizer``), once per
tokenizer kind (SentencePiece BPE, byte-level BPE) and worker count, so the figures are the
streaming and tokenizing alone. The two tokenizers are trained first on ``--tokenizer-bytes``
of the same source (not timed; kept in ``--scratch`` and reused when present). Each run is
sampled for the peak of the summed resident memory of the preparing process and its workers
(``tools/peak_rss.py``). It files per run the text bytes, documents, tokens, the prepare time
the command reports, the wall time and the peak memory, whether the shards are the same bytes
for every worker count, and the host's load average before and after (a loaded host lowers
the rates). ``tools/figures.py`` renders docs/data.md's table from the newest record
(figure ``prepare-cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))
from cpu_record import loaded_environment, write  # noqa: E402
from peak_rss import sampled_run  # noqa: E402

KINDS = {  # name → (prepare's --tokenizer-kind, the trained tokenizer's file in its dir)
    "SentencePiece BPE": ("sentencepiece", "tokenizer.model"),
    "byte-level BPE (`tokenizers`)": ("bpe", "tokenizer"),
}
KINDS_FILE = {kind: file for kind, file in KINDS.values()}
PREPARED = re.compile(r"in ([\d.]+) s\s*$")


def _prepare(*args: str) -> list[str]:
    return [sys.executable, "-m", "srtrain.data", "prepare", "--source", "packages", *args]


def tokenizer(scratch: Path, kind: str, sample_bytes: int) -> Path:
    """The 32,000-token tokenizer of ``kind`` trained on ``sample_bytes`` of the source (trained
    into ``scratch`` unless it is there)."""
    out = scratch / f"{kind}-tok"
    if not (out / "meta.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(
            _prepare(
                "--out",
                str(out),
                "--tokenizer-kind",
                kind,
                "--vocab-size",
                "32000",
                "--max-bytes",
                str(sample_bytes),
            ),
            check=True,
            capture_output=True,
        )
    return out / KINDS_FILE[kind]


def one_run(scratch: Path, name: str, tok: Path, workers: int, max_bytes: int) -> dict:
    """Prepare ``max_bytes`` with tokenizer ``tok`` and ``workers``; what it measured."""
    out = scratch / f"{KINDS[name][0]}-w{workers}"
    shutil.rmtree(out, ignore_errors=True)
    command = _prepare(
        "--max-bytes",
        str(max_bytes),
        "--tokenizer",
        str(tok),
        "--workers",
        str(workers),
        "--out",
        str(out),
    )
    run = sampled_run(command)
    meta = json.loads((out / "meta.json").read_text())
    splits = meta["splits"]
    prepared = [m for line in run["output"].splitlines() if (m := PREPARED.search(line))]
    prepare_s = float(prepared[-1].group(1)) if prepared else run["wall_s"]
    return {
        "tokenizer": name,
        "workers": workers,
        "text_bytes": meta["source"]["text_bytes"],
        "documents": meta["source"]["num_documents"],
        "tokens": sum(s["num_tokens"] for s in splits.values()),
        "prepare_s": prepare_s,
        "wall_s": run["wall_s"],
        "peak_rss_gib": run["peak_rss_gib"],
        "shards": [shard["sha256"] for s in splits.values() for shard in s["shards"]],
    }


def record(out: Path, scratch: Path, max_bytes: int, workers: list[int], sample: int) -> dict:
    """Every run, filed to ``out`` with the environment."""
    scratch.mkdir(parents=True, exist_ok=True)
    toks = {name: tokenizer(scratch, kind, sample) for name, (kind, _) in KINDS.items()}
    load_before = os.getloadavg()
    rows = [one_run(scratch, name, toks[name], w, max_bytes) for name in KINDS for w in workers]
    same = {
        name: len({tuple(r["shards"]) for r in rows if r["tokenizer"] == name}) == 1
        for name in KINDS
    }
    argv = " ".join(sys.argv[1:]) if __name__ == "__main__" else f"--record {out}"
    data = {
        "environment": loaded_environment(f"python tools/prepare_bench.py {argv}", load_before),
        "max_bytes": max_bytes,
        "tokenizer_bytes": sample,
        "same_shards_across_workers": same,
        "rows": rows,
    }
    return write(out, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/srtrain-prepare-bench"))
    parser.add_argument("--max-bytes", type=int, default=100_000_000)
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--tokenizer-bytes", type=int, default=20_000_000)
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    data = record(args.record, args.scratch, args.max_bytes, workers, args.tokenizer_bytes)
    for row in data["rows"]:
        print({k: v for k, v in row.items() if k != "shards"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
