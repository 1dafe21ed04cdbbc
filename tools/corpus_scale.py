#!/usr/bin/env python3
"""Preparation and the time before step 1 as a corpus grows, timed and filed for docs/data.md.

Usage: python tools/corpus_scale.py --record docs/results/data/prepare/DATE-cpu-scale.json

Writes a JSONL corpus of the largest ``--sizes`` (MB of text) into ``--scratch`` from the
``packages`` source (the installed packages' sources and docs, repeated from the start until
the size is reached: the rates and memory are the streaming and tokenizing, not the text's
novelty), then prepares the first ``size`` MB of it for each size with a 32,000-token
SentencePiece tokenizer given and ``--workers`` workers, sampled for the peak of the summed
resident memory of the preparing process and its workers (``tools/peak_rss.py``). On the
largest data dir it times the shards' verification (``verify_data``: every shard hashed and
its ids checked) on one thread and on every CPU, then, after one warm-up run on the smallest,
runs the default job for ``--steps`` steps twice from a fresh run dir (``./train
data.dir=... train.steps=N``): the first run verifies every shard before step 1, the second
trusts the pass the first remembered; each run files its wall time and the seconds from its
start to the console's line for the first step.
``tools/figures.py`` renders the table from the newest record (figure ``prepare-scale``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))
from cpu_record import loaded_environment, write  # noqa: E402
from peak_rss import sampled_run  # noqa: E402
from prepare_bench import PREPARED, tokenizer  # noqa: E402

FIRST_STEP = "first step done in"


def write_corpus(path: Path, size_bytes: int) -> int:
    """A JSONL file of ``{"text": ...}`` lines holding at least ``size_bytes`` of UTF-8 text,
    the ``packages`` source's documents repeated from the start; its text bytes."""
    from srtrain.corpus import open_corpus

    written = 0
    with path.open("w", encoding="utf-8") as out:
        while written < size_bytes:
            before = written
            for text in open_corpus("packages").documents:
                out.write(json.dumps({"text": text}) + "\n")
                written += len(text.encode("utf-8"))
                if written >= size_bytes:
                    break
            if written == before:
                raise RuntimeError("the packages source holds no documents")
    return written


def prepare_row(corpus: Path, out: Path, tok: Path, size: int, workers: int) -> dict:
    """Prepare the first ``size`` bytes of ``corpus`` into ``out``; what it measured."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "srtrain.data", "prepare", "--source", str(corpus)]
    command += ["--max-bytes", str(size), "--tokenizer", str(tok), "--workers", str(workers)]
    run = sampled_run([*command, "--out", str(out)], cwd=ROOT)
    meta = json.loads((out / "meta.json").read_text())
    prepared = [m for line in run["output"].splitlines() if (m := PREPARED.search(line))]
    shards = [shard for split in meta["splits"].values() for shard in split["shards"]]
    return {
        "text_bytes": meta["source"]["text_bytes"],
        "documents": meta["source"]["num_documents"],
        "tokens": sum(split["num_tokens"] for split in meta["splits"].values()),
        "shards": len(shards),
        "shard_bytes": sum((out / shard["file"]).stat().st_size for shard in shards),
        "workers": workers,
        "prepare_s": float(prepared[-1].group(1)) if prepared else run["wall_s"],
        "wall_s": run["wall_s"],
        "peak_rss_gib": run["peak_rss_gib"],
    }


def verify_rows(data_dir: Path) -> list[dict]:
    """``verify_data`` on ``data_dir`` with one thread and with every CPU, each timed in a
    fresh process with nothing remembered."""
    from srtrain.data import usable_cpus

    rows = []
    for threads in sorted({1, usable_cpus()}):
        for cache in data_dir.glob(".verified*"):
            cache.unlink()
        code = (
            "import time; from srtrain.data import load_meta; "
            f"from srtrain.data_check import verify_data; meta = load_meta({str(data_dir)!r}); "
            f"t = time.perf_counter(); v = verify_data(meta, threads={threads}); "
            "print(time.perf_counter() - t, len(v.hashed))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        )
        seconds, hashed = done.stdout.split()
        rows.append(
            {"threads": threads, "seconds": round(float(seconds), 2), "shards": int(hashed)}
        )
    for cache in data_dir.glob(".verified*"):
        cache.unlink()
    return rows


def train_rows(data_dir: Path, scratch: Path, steps: int, warm_up_dir: Path) -> list[dict]:
    """The default job on ``data_dir`` for ``steps`` steps, twice, each from a fresh run dir
    (the data dir's remembered verification removed before the first), after one unrecorded
    run on ``warm_up_dir`` that brings the imports and the kernels' caches in."""
    subprocess.run(
        [
            str(ROOT / "train"),
            f"data.dir={warm_up_dir}",
            "train.steps=2",
            f"train.run_dir={scratch / 'warm-up'}",
            "train.val_interval=0",
            "train.val_batches=0",
        ],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for cache in data_dir.glob(".verified*"):
        cache.unlink()
    rows = []
    for attempt in ("first run: every shard hashed", "second run: verification remembered"):
        run_dir = scratch / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        command = [str(ROOT / "train"), f"data.dir={data_dir}", f"train.steps={steps}"]
        command += [f"train.run_dir={run_dir}", "train.val_interval=0", "train.val_batches=0"]
        run = sampled_run(command, cwd=ROOT, marker=FIRST_STEP)
        if run["marker_s"] is None:
            raise RuntimeError(f"no {FIRST_STEP!r} line in:\n{run['output']}")
        rows.append(
            {
                "run": attempt,
                "steps": steps,
                "first_step_line_s": run["marker_s"],
                "wall_s": run["wall_s"],
                "peak_rss_gib": run["peak_rss_gib"],
            }
        )
    return rows


def record(out: Path, scratch: Path, sizes_mb: list[int], workers: int, steps: int) -> dict:
    """Every run, filed to ``out`` with the environment."""
    scratch.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(scratch, "sentencepiece", 20_000_000)
    corpus = scratch / "corpus.jsonl"
    largest = max(sizes_mb) * 10**6
    if not corpus.is_file() or corpus.stat().st_size < largest:
        write_corpus(corpus, largest)
    load_before = os.getloadavg()
    rows = [
        prepare_row(corpus, scratch / f"prep-{mb}mb", tok, mb * 10**6, workers) for mb in sizes_mb
    ]
    largest_dir = scratch / f"prep-{max(sizes_mb)}mb"
    verifies = verify_rows(largest_dir)
    trains = train_rows(largest_dir, scratch, steps, scratch / f"prep-{min(sizes_mb)}mb")
    argv = " ".join(sys.argv[1:]) if __name__ == "__main__" else f"--record {out}"
    data = {
        "environment": loaded_environment(f"python tools/corpus_scale.py {argv}", load_before),
        "tokenizer": "SentencePiece BPE, 32,000 tokens, trained on 20 MB of the packages source",
        "corpus": "the packages source as JSONL, repeated from the start",
        "prepare": rows,
        "verify": verifies,
        "train": trains,
    }
    return write(out, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/srtrain-corpus-scale"))
    parser.add_argument("--sizes", default="100,1000,3000", help="MB of text, comma-separated")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    data = record(args.record, args.scratch, sizes, args.workers, args.steps)
    for row in data["prepare"] + data["verify"] + data["train"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
