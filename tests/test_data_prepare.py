"""Streaming preparation: output independent of the number of workers, resume after a kill,
parts prepared apart and merged, the per-document validation split."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from srtrain.console import Ticker
from srtrain.data import DataError, TokenData, load_meta, load_tokenizer, merge, prepare
from srtrain.data.split import TokenizerSample, ValSelector


def _texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "naïve", "café", "東京", "λx", "  ", "\t", "42", "def"]
    return [
        f"doc {i}\n"
        + "\n".join(" ".join(rng.choice(words, size=rng.integers(4, 30))) for _ in range(6))
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "rows.jsonl"
    docs = _texts(1500, seed=11)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece model trained on the corpus."""
    out = prepare(corpus, tmp_path_factory.mktemp("tok") / "d", vocab_size=600, max_bytes=100_000)
    return out / "tokenizer.model"


def _shard_bytes(data_dir: Path) -> dict[str, bytes]:
    meta = load_meta(data_dir, verify=True)
    return {
        split: b"".join((data_dir / s.file).read_bytes() for s in m.shards)
        for split, m in meta.splits.items()
    }


def _docs(data_dir: Path, split: str) -> list[str]:
    meta, tok = load_meta(data_dir), load_tokenizer(data_dir)
    data = TokenData(data_dir, split)
    tokens = data.read(0, len(data)).tolist()
    ends = [i for i, t in enumerate(tokens) if t == meta.eos_id]
    return [tok.decode(tokens[a + 1 : b]) for a, b in zip([-1, *ends], ends, strict=False)]


def test_output_is_independent_of_workers_and_chunks(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    kw = dict(tokenizer=tokenizer, val_fraction=0.1, shard_tokens=50_000)
    one = prepare(corpus, tmp_path / "one", workers=1, **kw)
    four = prepare(corpus, tmp_path / "four", workers=4, chunk_bytes=20_000, **kw)
    meta = load_meta(one)
    assert len(meta.splits["train"].shards) > 1  # several shards, several chunks
    assert _shard_bytes(one) == _shard_bytes(four)
    assert load_meta(one).splits == load_meta(four).splits


def test_bpe_output_is_independent_of_workers(corpus: Path, tmp_path: Path) -> None:
    kw = dict(tokenizer_kind="bpe", vocab_size=700, max_bytes=200_000, val_fraction=0.05)
    one = prepare(corpus, tmp_path / "one", workers=1, **kw)
    two = prepare(corpus, tmp_path / "two", workers=2, chunk_bytes=30_000, **kw)
    assert _shard_bytes(one) == _shard_bytes(two)


def test_killed_preparation_resumes_where_it_stopped(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    kw = dict(tokenizer=str(tokenizer), val_fraction=0.1, shard_tokens=20_000, workers=1)
    code = (
        "from srtrain.data import prepare; "
        f"prepare({str(corpus)!r}, {str(out)!r}, chunk_bytes=5_000, **{kw!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    progress = tmp_path / ".out.staging" / "progress.json"
    chunks = 0
    deadline = time.monotonic() + 120
    while chunks < 20 and proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            chunks = json.loads(progress.read_text()).get("chunks", 0)
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    assert not out.exists()  # nothing half-written is published
    kept = json.loads(progress.read_text())
    closed = {s: kept["splits"][s]["shards"] for s in ("train", "val")}
    assert kept["chunks"] >= 20 and closed["train"]

    lines: list[str] = []
    prepare(corpus, out, chunk_bytes=5_000, progress=Ticker(lines.append), **kw)
    assert any(line.startswith(f"data: resuming after chunk {kept['chunks']} ") for line in lines)
    meta = load_meta(out)
    for split, shards in closed.items():  # the shards finished before the kill are kept
        assert [vars(s) for s in meta.splits[split].shards[: len(shards)]] == shards
    whole = prepare(corpus, tmp_path / "whole", chunk_bytes=5_000, **kw)
    assert _shard_bytes(out) == _shard_bytes(whole)
    assert not (tmp_path / ".out.staging").exists()


def test_parts_prepared_apart_merge_into_one_dir(
    corpus: Path, tokenizer: Path, tmp_path: Path
) -> None:
    kw = dict(tokenizer=tokenizer, val_fraction=0.1, chunk_bytes=30_000, workers=1)
    whole = prepare(corpus, tmp_path / "whole", **kw)
    out = tmp_path / "merged"
    for i in (2, 0):
        prepare(corpus, out, part=(i, 3), **kw)
    with pytest.raises(DataError) as error:
        merge(out)
    assert "lacks finished parts 1/3 of 3" in str(error.value)
    assert not (out / "meta.json").exists()
    prepare(corpus, out, part=(1, 3), **kw)
    merge(out)
    meta, single = load_meta(out, verify=True), load_meta(whole)
    assert not (out / "parts").exists()
    for split in ("train", "val"):
        assert meta.splits[split].num_documents == single.splits[split].num_documents
        assert meta.splits[split].num_tokens == single.splits[split].num_tokens
        # the same documents on each side of the split, the parts' in part order
        assert sorted(_docs(out, split)) == sorted(_docs(whole, split))
    assert meta.prepare["parts"] == 3 and "part" not in meta.prepare
    with pytest.raises(DataError, match="already prepared"):
        merge(out)
    with pytest.raises(DataError, match="needs an existing --tokenizer"):
        prepare(corpus, tmp_path / "p", part=(0, 2))


def test_val_selection_is_one_per_stretch() -> None:
    for fraction in (0.5, 0.1, 0.02, 0.013):
        for seed in range(5):
            selector = ValSelector(fraction, seed)
            held = [i for i in range(5000) if selector.is_val(i)]
            for n in (2, 10, 100, 999, 5000):
                count = sum(i < n for i in held)
                assert count - int(n * fraction) in (0, 1) or (count == 1 and n * fraction < 1)
            assert held[0] < 2  # two documents always give one to validation

    def held(seed: int) -> list[int]:
        selector = ValSelector(0.1, seed)
        return [i for i in range(500) if selector.is_val(i)]

    assert held(3) == held(3) != held(4)


def test_tokenizer_sample_keeps_all_text_that_fits() -> None:
    docs = _texts(50, seed=5)
    sizes = [len(d.encode()) for d in docs]
    every = TokenizerSample(sum(sizes), seed=0)
    for i, d in enumerate(docs):
        every.offer(i, d)
    assert every.documents() == docs
    part = TokenizerSample(sum(sizes) // 3, seed=0)
    for i, d in enumerate(docs):
        part.offer(i, d)
    kept = part.documents()
    assert 0 < part.bytes <= sum(sizes) // 3 and len(kept) < len(docs)
    assert kept == [d for d in docs if d in kept]  # source order
