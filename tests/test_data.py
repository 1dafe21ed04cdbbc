"""Data preparation (builtin and local sources) and the deterministic, resumable loader."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from srtrain.console import Ticker
from srtrain.corpus import cap_bytes, open_corpus
from srtrain.data import (
    IGNORE_INDEX,
    BatchLoader,
    DataError,
    TokenData,
    ensure_prepared,
    load_meta,
    load_tokenizer,
    prepare,
)

MAX_BYTES = 1_500_000
VOCAB = 1024
VAL_FRACTION = 0.05


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "builtin"
    return prepare("builtin", out, vocab_size=VOCAB, max_bytes=MAX_BYTES, val_fraction=VAL_FRACTION)


def _texts(count: int, seed: int) -> list[str]:
    """Small documents with newlines, indentation, tabs and non-ASCII text."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "café", "東京", "λx", "  ", "\t", "42"]
    docs = []
    for i in range(count):
        lines = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(5)]
        docs.append(f"doc {i}\n" + "\n".join(lines) + "\n\n    indented end\n")
    return docs


def _documents(data_dir: Path, split: str) -> list[str]:
    """The split's token stream decoded back to documents (split at EOS)."""
    meta = load_meta(data_dir)
    sp = load_tokenizer(data_dir)
    data = TokenData(data_dir, split)
    tokens = data.read(0, len(data)).tolist()
    docs, current = [], []
    for token in tokens:
        if token == meta.eos_id:
            docs.append(sp.decode(current))
            current = []
        else:
            current.append(token)
    assert current == []
    return docs


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def _collect(loader: BatchLoader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def _concat_ranks(data_dir: Path, split: str, world_size: int, steps: int, **kw: int) -> list:
    loaders = [
        BatchLoader(data_dir, split, rank=r, world_size=world_size, **kw) for r in range(world_size)
    ]
    per_rank = [_collect(loader, steps) for loader in loaders]
    return [
        (torch.cat([b[t][0] for b in per_rank]), torch.cat([b[t][1] for b in per_rank]))
        for t in range(steps)
    ]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb)
        assert torch.equal(ya, yb)


# ---------------------------------------------------------------- preparing


def test_builtin_meta_matches_shards(builtin: Path) -> None:
    meta = load_meta(builtin, verify=True)
    assert meta.format_version == 2
    assert meta.vocab_size == VOCAB == load_tokenizer(builtin).vocab_size
    assert meta.tokenizer.kind == "sentencepiece"
    assert meta.tokenizer.files == {"tokenizer.model": _sha256(builtin / "tokenizer.model")}
    assert meta.dtype == "uint16"
    assert (meta.unk_id, meta.bos_id, meta.eos_id, meta.pad_id) == (0, 1, 2, 3)
    assert meta.source["kind"] == "builtin"
    assert MAX_BYTES - 4 < meta.source["text_bytes"] <= MAX_BYTES
    num_docs = meta.source["num_documents"]
    # one held-out document in every 1 / VAL_FRACTION, drawn at a seeded place in each stretch
    assert meta.splits["val"].num_documents - int(VAL_FRACTION * num_docs) in (0, 1)
    assert meta.splits["train"].num_documents + meta.splits["val"].num_documents == num_docs
    for name, split in meta.splits.items():
        assert split.num_tokens == sum(s.num_tokens for s in split.shards)
        tokens = np.fromfile(builtin / split.shards[0].file, dtype=np.uint16)
        assert tokens.size == split.num_tokens
        assert int((tokens == meta.eos_id).sum()) == split.num_documents
        assert tokens[-1] == meta.eos_id
        assert tokens.max() < VOCAB
        assert len(TokenData(builtin, name)) == split.num_tokens
    # Python source compresses to about 3 bytes per token at this vocabulary size.
    total = sum(s.num_tokens for s in meta.splits.values())
    assert 2.0 < meta.source["text_bytes"] / total < 4.0


def test_builtin_tokens_decode_to_the_documents(builtin: Path) -> None:
    corpus = list(cap_bytes(open_corpus("builtin").documents, MAX_BYTES))
    train, val = _documents(builtin, "train"), _documents(builtin, "val")
    assert sorted(train + val) == sorted(corpus)
    held_out = set(val)
    assert train == [doc for doc in corpus if doc not in held_out]


def test_prepare_is_deterministic(builtin: Path, tmp_path: Path) -> None:
    again = prepare(
        "builtin",
        tmp_path / "again",
        vocab_size=VOCAB,
        max_bytes=MAX_BYTES,
        val_fraction=VAL_FRACTION,
    )
    first, second = load_meta(builtin), load_meta(again)
    assert first.splits == second.splits
    assert (builtin / "tokenizer.model").read_bytes() == (again / "tokenizer.model").read_bytes()
    for split in first.splits.values():
        for shard in split.shards:
            assert (builtin / shard.file).read_bytes() == (again / shard.file).read_bytes()


def test_local_txt_jsonl_parquet_sources(tmp_path: Path) -> None:
    docs = _texts(26, seed=1)
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    for i, doc in enumerate(docs[:6]):
        (txt_dir / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[6:16])),
        encoding="utf-8",
    )
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": docs[16:]}), parquet)

    out = prepare([txt_dir, jsonl, parquet], tmp_path / "out", vocab_size=400, val_fraction=0.2)
    meta = load_meta(out, verify=True)
    assert meta.source["kind"] == "files"
    assert len(meta.source["paths"]) == 8
    assert meta.source["num_documents"] == 26
    assert meta.splits["val"].num_documents == 5
    assert 261 < meta.vocab_size <= 400
    train, val = _documents(out, "train"), _documents(out, "val")
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d not in set(val)]


def test_compressed_local_sources_read_as_their_plain_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """.jsonl.gz, .txt.xz and .json.bz2 files (one folder, read in path order) and .jsonl.zst
    give the documents their plain forms give (.zst without zstandard: one line saying so); a
    bare .gz, a compressed parquet and an unknown suffix are refused in one line naming what
    is allowed."""
    import bz2
    import gzip
    import lzma

    import zstandard

    from srtrain.corpus import ALLOWED_FILES

    docs = _texts(12, seed=3)
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    rows = "".join(json.dumps({"text": d}) + "\n" for d in docs[:6])
    (plain / "a.jsonl").write_text(rows, encoding="utf-8")
    (packed / "a.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    for i, doc in enumerate(docs[6:9]):
        (plain / f"b{i}.txt").write_text(doc, encoding="utf-8")
        (packed / f"b{i}.txt.xz").write_bytes(lzma.compress(doc.encode()))
    array = json.dumps([{"text": d} for d in docs[9:]])
    (plain / "c.json").write_text(array, encoding="utf-8")
    (packed / "c.json.bz2").write_bytes(bz2.compress(array.encode()))
    assert list(open_corpus(packed).documents) == list(open_corpus(plain).documents) == docs
    zst = tmp_path / "z" / "a.jsonl.zst"
    zst.parent.mkdir()
    zst.write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    assert list(open_corpus(zst).documents) == docs[:6]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "zstandard" else real_find_spec(name, *a),
    )
    with pytest.raises(DataError, match="needs the zstandard package: pip install zstandard"):
        open_corpus(zst)
    monkeypatch.undo()
    for name in ("rows.gz", "rows.parquet.gz", "rows.csv"):
        (tmp_path / name).write_bytes(b"x")
        with pytest.raises(DataError) as error:
            open_corpus(tmp_path / name)
        assert str(error.value).endswith(f"; allowed: {ALLOWED_FILES}")
        assert "\n" not in str(error.value)


def test_packages_source_reads_each_distinct_file_once(tmp_path: Path) -> None:
    from srtrain.corpus import _package_documents

    body = "def f():\n    return 1\n" * 20
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mod.py").write_text(body)
    (tmp_path / "a.md").write_text("# Title\n" + "text " * 60)
    (tmp_path / "copy.pyi").write_text(body)  # same text: skipped
    (tmp_path / "short.txt").write_text("too short")  # under 200 characters: skipped
    (tmp_path / "data.bin").write_bytes(b"\x00" * 500)  # not a source or docs file
    assert list(_package_documents(tmp_path)) == ["# Title\n" + "text " * 60, body]
    corpus = open_corpus("packages")
    assert corpus.description["kind"] == "packages" and next(corpus.documents)


def test_json_text_field_and_missing_field(tmp_path: Path) -> None:
    docs = _texts(8, seed=2)
    source = tmp_path / "rows.json"
    source.write_text(json.dumps([{"content": d} for d in docs]), encoding="utf-8")
    out = prepare(source, tmp_path / "out", vocab_size=300, text_field="content")
    assert sorted(_documents(out, "train") + _documents(out, "val")) == sorted(docs)

    with pytest.raises(DataError) as error:
        prepare(source, tmp_path / "bad", vocab_size=300)
    message = _one_line(error)
    assert "'text'" in message and "content" in message
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_existing_tokenizer_is_reused(builtin: Path, tmp_path: Path) -> None:
    docs = _texts(5, seed=3)
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer = builtin / "tokenizer.model"
    out = prepare(source, tmp_path / "out", tokenizer=tokenizer, val_fraction=0)
    assert (out / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    meta = load_meta(out)
    assert meta.vocab_size == VOCAB
    assert meta.prepare["tokenizer"] == str(tokenizer)
    sp = load_tokenizer(builtin)
    expected = [t for ids in sp.encode_batch(docs) for t in [*ids, meta.eos_id]]
    data = TokenData(out, "train")
    assert data.read(0, len(data)).tolist() == expected
    assert meta.splits["val"].num_tokens == 0
    with pytest.raises(DataError) as error:
        BatchLoader(out, "val", 2, 8)
    assert "needs at least 9" in _one_line(error)
    # The trainer's data.vocab_size does not apply to the tokenizer's vocabulary.
    assert ensure_prepared(out, source, vocab_size=VOCAB + 1, val_fraction=0) == out


def test_small_shards_form_one_stream(builtin: Path, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in _texts(12, seed=4)), encoding="utf-8"
    )
    out = prepare(
        source,
        tmp_path / "out",
        tokenizer=builtin / "tokenizer.model",
        val_fraction=0,
        shard_tokens=50,
    )
    shards = load_meta(out, verify=True).splits["train"].shards
    assert len(shards) > 5
    assert all(s.num_tokens == 50 for s in shards[:-1]) and 0 < shards[-1].num_tokens <= 50
    stream = np.concatenate([np.fromfile(out / s.file, dtype=np.uint16) for s in shards])
    data = TokenData(out, "train")
    assert len(data) == stream.size
    for start, length in [(0, 50), (45, 10), (49, 120), (stream.size - 7, 7)]:
        assert np.array_equal(data.read(start, length), stream[start : start + length])
    x, y = next(BatchLoader(out, "train", 4, 37))
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
        assert any(
            np.array_equal(row, stream[w * 37 : w * 37 + 38]) for w in range(len(stream) // 37)
        )


# ---------------------------------------------------------------- loading


def test_loader_epoch_visits_every_window_once(builtin: Path) -> None:
    loader = BatchLoader(builtin, "train", 1, 512, seed=3)
    data = TokenData(builtin, "train")
    n = loader.num_windows
    assert n == (len(data) - 1) // 512
    rows = []
    for _ in range(n):
        x, y = next(loader)
        assert x.shape == y.shape == (1, 512) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[0, 1:], y[0, :-1])
        rows.append(torch.cat([x[0], y[0, -1:]]).numpy().tobytes())
    windows = [data.read(w * 512, 513).tobytes() for w in range(n)]
    assert sorted(rows) == sorted(windows)
    assert loader.epoch == 1
    second_epoch = [torch.cat([x[0], y[0, -1:]]).numpy().tobytes() for x, y in _collect(loader, 20)]
    assert second_epoch != rows[:20]


def test_loader_is_deterministic_and_seeded(builtin: Path) -> None:
    a = _collect(BatchLoader(builtin, "train", 8, 64, seed=5), 6)
    b = _collect(BatchLoader(builtin, "train", 8, 64, seed=5), 6)
    _assert_same(a, b)
    c = next(BatchLoader(builtin, "train", 8, 64, seed=6))
    assert not torch.equal(a[0][0], c[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_batch_is_independent_of_world_size(builtin: Path, world_size: int) -> None:
    # The val split holds a few hundred windows, so 100 steps cross two epoch boundaries.
    kw = {"global_batch_size": 8, "seq_len": 128, "seed": 11}
    reference = _collect(BatchLoader(builtin, "val", **kw), 100)
    assert reference[-1][0].shape == (8, 128)
    assert 2 * BatchLoader(builtin, "val", **kw).num_windows < 100 * 8
    _assert_same(_concat_ranks(builtin, "val", world_size, 100, **kw), reference)


def test_resume_continues_exactly_at_any_world_size(builtin: Path) -> None:
    kw = {"global_batch_size": 8, "seq_len": 128, "seed": 2}
    reference = _collect(BatchLoader(builtin, "val", **kw), 70)
    ranks = [BatchLoader(builtin, "val", rank=r, world_size=2, **kw) for r in range(2)]
    for loader in ranks:
        _collect(loader, 37)
    state = json.loads(json.dumps(ranks[0].state_dict()))
    assert state == ranks[1].state_dict()
    assert all(isinstance(v, int | str) for v in state.values())
    for world_size in (1, 2, 4):
        resumed = [
            BatchLoader(builtin, "val", rank=r, world_size=world_size, **kw)
            for r in range(world_size)
        ]
        for loader in resumed:
            loader.load_state_dict(state)
        per_rank = [_collect(loader, 33) for loader in resumed]
        batches = [
            (torch.cat([b[t][0] for b in per_rank]), torch.cat([b[t][1] for b in per_rank]))
            for t in range(33)
        ]
        _assert_same(batches, reference[37:])

    other = BatchLoader(builtin, "val", 8, 64, seed=2)
    with pytest.raises(DataError) as error:
        other.load_state_dict(state)
    assert "seq_len=128" in _one_line(error)


def test_val_batches_are_fixed(builtin: Path) -> None:
    loader = BatchLoader(builtin, "val", 8, 64, seed=0)
    first = list(loader.val_batches(5))
    _assert_same(first, list(loader.val_batches(5)))
    _assert_same(first, list(BatchLoader(builtin, "val", 8, 64, seed=9).val_batches(5)))
    assert loader.state_dict()["position"] == 0
    halves = [BatchLoader(builtin, "val", 8, 64, rank=r, world_size=2) for r in range(2)]
    per_rank = [list(h.val_batches(5)) for h in halves]
    concat = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*per_rank, strict=True)
    ]
    _assert_same(concat, first)
    everything = list(loader.val_batches())
    assert len(everything) == loader.num_windows // 8
    assert len(list(loader.val_batches(10**6))) == len(everything)
    _assert_same(everything[:5], first)
    rows = {row.numpy().tobytes() for x, _ in everything for row in x}
    assert len(rows) == 8 * len(everything)


def _windows(loader: BatchLoader) -> list[bytes]:
    """Every window of a loader's split as bytes (seq_len + 1 tokens)."""
    length = loader.seq_len + 1
    return [
        loader.data.read(w * loader.seq_len, length).tobytes() for w in range(loader.num_windows)
    ]


def _rows(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    """The windows a validation batch holds, padding rows left out."""
    kept = (y != IGNORE_INDEX).all(dim=1)
    assert torch.equal(kept, (y != IGNORE_INDEX).any(dim=1))  # a row is padding or a window
    assert torch.equal(x[~kept], torch.zeros_like(x[~kept]))
    return [torch.cat([a, b[-1:]]).numpy().tobytes() for a, b in zip(x[kept], y[kept], strict=True)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_short_val_split_validates_every_window_once(builtin: Path, world_size: int) -> None:
    """Fewer windows than a batch: one batch of all of them, each rank an equal number of
    rows (the last padded), in one fixed order whatever the seed, rank count or position."""
    windows = BatchLoader(builtin, "val", 6, 64).num_windows
    batch = 6 * (windows // 6 + 1)  # the smallest multiple of 6 above the window count
    loaders = [
        BatchLoader(builtin, "val", batch, 64, rank=r, world_size=world_size, seed=r)
        for r in range(world_size)
    ]
    assert loaders[0].short and loaders[0].val_notice() == (
        f"validation: split 'val' has {windows} windows of seq_len 64, fewer than a batch of "
        f"{batch}; validating on those {windows} windows"
    )
    per_rank = [list(loader.val_batches(4)) for loader in loaders]
    assert [len(batches) for batches in per_rank] == [1] * world_size
    share = -(-windows // world_size)
    assert all(b[0][0].shape == b[0][1].shape == (share, 64) for b in per_rank)
    rows = [row for b in per_rank for row in _rows(*b[0])]
    assert sorted(rows) == sorted(_windows(loaders[0]))
    single = BatchLoader(builtin, "val", batch, 64, seed=7)
    next(single)  # the training position does not move validation
    assert rows == _rows(*next(single.val_batches()))
    assert [len(list(loader.val_batches(0))) for loader in loaders] == [0] * world_size
    _assert_same(per_rank[-1], list(loaders[-1].val_batches(1)))


def test_short_val_split_with_fewer_windows_than_ranks(builtin: Path) -> None:
    length = len(TokenData(builtin, "val"))
    seq_len = (length - 1) // 3  # three windows over four ranks
    loaders = [BatchLoader(builtin, "val", 4, seq_len, rank=r, world_size=4) for r in range(4)]
    assert loaders[0].num_windows == 3
    batches = [next(loader.val_batches()) for loader in loaders]
    assert all(x.shape == (1, seq_len) for x, _ in batches)
    assert [len(_rows(x, y)) for x, y in batches] == [1, 1, 1, 0]
    rows = [row for x, y in batches for row in _rows(x, y)]
    assert sorted(rows) == sorted(_windows(loaders[0]))
    assert BatchLoader(builtin, "val", 2, seq_len).val_notice() is None  # a full batch


# ---------------------------------------------------------------- errors and entry points


def test_missing_data_dir_names_path_and_command(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for make in (lambda: TokenData(missing, "train"), lambda: BatchLoader(missing, "train", 4, 8)):
        with pytest.raises(DataError) as error:
            make()
        message = _one_line(error)
        assert str(missing) in message
        assert f"python -m srtrain.data prepare --source builtin --out {missing}" in message


def test_bad_loader_arguments(builtin: Path) -> None:
    with pytest.raises(DataError) as error:
        BatchLoader(builtin, "train", 10, 16, rank=0, world_size=4)
    assert "global_batch_size=10 is not divisible by world_size=4" in _one_line(error)
    with pytest.raises(DataError) as error:
        BatchLoader(builtin, "test", 4, 16)
    assert "split 'test'" in _one_line(error)
    with pytest.raises(DataError) as error:
        BatchLoader(builtin, "train", 4, 16, rank=4, world_size=4)
    assert "rank=4" in _one_line(error)
    with pytest.raises(DataError) as error:
        BatchLoader(builtin, "train", 4, 0)
    assert "seq_len=0 must be a positive integer" in _one_line(error)


def test_missing_source_and_existing_output(builtin: Path, tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(DataError) as error:
        prepare(missing, tmp_path / "out", vocab_size=300)
    assert f"source file {missing} not found" in _one_line(error)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError) as error:
        prepare("builtin", builtin)
    assert "already prepared" in _one_line(error)

    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"text": "x = 1\n"}) + "\n", encoding="utf-8")
    out = tmp_path / "replaced"
    tokenizer = builtin / "tokenizer.model"
    prepare(source, out, tokenizer=tokenizer, val_fraction=0, max_bytes=3)
    prepare(source, out, tokenizer=tokenizer, val_fraction=0, overwrite=True)
    assert load_meta(out).source["text_bytes"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replaced", "rows.jsonl"]


def test_damaged_shard_is_detected(builtin: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(builtin, tmp_path / "copy"))
    shard = copy / load_meta(copy).splits["val"].shards[0].file
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    load_meta(copy)
    with pytest.raises(DataError) as error:
        load_meta(copy, verify=True)
    assert "sha256" in _one_line(error)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError) as error:
        TokenData(copy, "train")
    assert str(shard) in _one_line(error)


def test_ensure_prepared_prepares_once(builtin: Path, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in _texts(6, seed=5)), encoding="utf-8"
    )
    out = tmp_path / "deep" / "out"
    kw = {"tokenizer": builtin / "tokenizer.model", "val_fraction": 0.2}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: ensure_prepared(out, source, **kw), range(2)))
    assert results == [out, out]
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert ensure_prepared(out, source, **kw) == out
    assert (out / "meta.json").stat().st_mtime_ns == stamp
    assert sorted(os.listdir(out.parent)) == ["out"]


def test_prepared_dir_is_used_as_prepared(builtin: Path, tmp_path: Path) -> None:
    """Another max_bytes, val_fraction or source is one notice line, the dir unchanged; the
    same settings say nothing; without a source a missing dir is an error."""
    files = {p.name: p.stat().st_mtime_ns for p in builtin.iterdir()}
    lines: list[str] = []
    kw = {"vocab_size": VOCAB, "max_bytes": MAX_BYTES, "val_fraction": VAL_FRACTION}
    assert ensure_prepared(builtin, "builtin", notice=lines.append, **kw) == builtin
    assert ensure_prepared(builtin, None, notice=lines.append, **kw) == builtin
    assert lines == []
    other = {**kw, "max_bytes": 130_000_000_000}
    assert ensure_prepared(builtin, "builtin", notice=lines.append, **other) == builtin
    assert lines == [
        f"data: {builtin} was prepared with max_bytes={MAX_BYTES}; the config asks "
        "data.max_bytes=130000000000; using it as prepared (delete it to prepare again)"
    ]
    lines.clear()
    ensure_prepared(builtin, "allenai/c4:en", notice=lines.append, max_bytes=None, val_fraction=0.2)
    assert lines == [
        f"data: {builtin} was prepared with source=builtin, max_bytes={MAX_BYTES}, "
        f"val_fraction={VAL_FRACTION}; the config asks data.source=allenai/c4:en, "
        "data.max_bytes=null, data.val_fraction=0.2; using it as prepared (delete it to "
        "prepare again)"
    ]
    assert {p.name: p.stat().st_mtime_ns for p in builtin.iterdir()} == files
    with pytest.raises(DataError) as error:
        ensure_prepared(tmp_path / "missing", None)
    assert _one_line(error).startswith(f"no prepared data at {tmp_path / 'missing'} and no source")
    assert not (tmp_path / "missing").exists()


def test_vocab_size_is_checked_only_when_given(builtin: Path) -> None:
    kw = {"max_bytes": MAX_BYTES, "val_fraction": VAL_FRACTION}
    assert ensure_prepared(builtin, "builtin", **kw) == builtin  # the dir's vocabulary
    with pytest.raises(DataError) as error:
        ensure_prepared(builtin, "builtin", vocab_size=2 * VOCAB, **kw)
    assert _one_line(error) == (
        f"{builtin} was prepared with vocab_size={VOCAB}, asked for {2 * VOCAB}; leave "
        f"data.vocab_size unset (null) to use its vocabulary, or remove {builtin} or choose "
        "another data dir"
    )


def _phase_lines(lines: list[str]) -> list[str]:
    """The progress lines that start or end a phase: without the periodic ones, whose number
    depends on how fast the machine is."""
    periodic = ("data: tokenizer sample: ", "data: tokenized ")
    return [
        line
        for line in lines
        if not line.startswith(periodic)
        and not (line.startswith("data: read ") and " documents in " not in line)
    ]


def test_prepare_reports_progress(tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    docs = _texts(30, seed=7)
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    lines: list[str] = []
    prepare(
        source,
        tmp_path / "every",
        vocab_size=300,
        val_fraction=0.1,
        workers=1,
        progress=Ticker(lines.append, every_s=0),
    )
    train_docs = load_meta(tmp_path / "every").splits["train"].num_documents
    assert train_docs in (26, 27)  # 3 or 4 of 30 held out
    sampling = [line for line in lines if line.startswith("data: tokenizer sample: read ")]
    # a line per train document while sampling text for the tokenizer
    counts = [int(line.split(", ")[1].split()[0]) for line in sampling]
    assert len(counts) == 30 and all(0 <= b - a <= 1 for a, b in itertools.pairwise(counts))
    assert counts[-1] == train_docs
    assert sum(line.startswith("data: tokenized ") for line in lines) == 1  # a line per chunk
    reads = [line for line in lines if line.startswith("data: read ")]
    assert len(reads) == 1
    assert reads[0].startswith(f"data: read {text_mb:.1f} MB, 30 documents in ")
    assert ", 1 worker)" in reads[0]

    quiet: list[str] = []
    meta = load_meta(
        prepare(
            source,
            tmp_path / "quiet",
            vocab_size=300,
            val_fraction=0.1,
            progress=Ticker(quiet.append, every_s=3600),  # no periodic line however slow
        )
    )
    phases = [" ".join(line.split()[:3]) for line in quiet]
    assert phases == [
        "data: preparing " + str(tmp_path / "quiet"),
        "data: sampled 0.0",
        "data: training a",
        "data: tokenizer trained",
        "data: read 0.0",
        "data: wrote train_00000.bin",
        "data: wrote val_00000.bin",
    ]
    assert quiet[0] == f"data: preparing {tmp_path / 'quiet'} from {source}"
    assert quiet[1].startswith(
        f"data: sampled {text_mb:.1f} MB of {text_mb:.1f} MB of train text ({train_docs} of "
        f"{train_docs} documents) for the tokenizer in "
    )
    assert quiet[2] == "data: training a 300-token BPE tokenizer on 0.0 MB of text"
    assert quiet[-2:] == [
        f"data: wrote {s}_00000.bin ({meta.splits[s].num_tokens:,} tokens)"
        for s in ("train", "val")
    ]


def test_command_line(builtin: Path, tmp_path: Path) -> None:
    source = tmp_path / "doc.txt"
    source.write_text("".join(_texts(4, seed=6)), encoding="utf-8")
    command = [sys.executable, "-m", "srtrain.data", "prepare", "--out", str(tmp_path / "out")]
    ok = subprocess.run(
        [
            *command,
            "--source",
            str(source),
            str(source),
            "--tokenizer",
            str(builtin / "tokenizer.model"),
            "--val-fraction",
            "0.5",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    *progress, done = ok.stdout.splitlines()
    assert all(line.startswith("data: ") for line in progress)
    assert [" ".join(line.split()[:2]) for line in _phase_lines(progress)] == [
        "data: preparing",
        "data: read",
        "data: wrote",
        "data: wrote",
    ]
    assert done.startswith(f"prepared {tmp_path / 'out'}: vocab {VOCAB}, uint16")
    assert load_meta(tmp_path / "out").splits["val"].num_documents == 1

    bad = subprocess.run(
        [*command[:-1], str(tmp_path / "other"), "--source", str(tmp_path / "gone.txt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert bad.stderr.startswith(f"error: source file {tmp_path / 'gone.txt'} not found")


def test_format_1_data_dir_still_loads(builtin: Path, tmp_path: Path) -> None:
    """A SentencePiece data dir prepared before tokenizer records (meta.json format 1)."""
    old = tmp_path / "old"
    shutil.copytree(builtin, old)
    raw = json.loads((old / "meta.json").read_text())
    raw.update(format_version=1, tokenizer="tokenizer.model")
    raw["prepare"] = {k: raw["prepare"][k] for k in raw["prepare"] if "tokenizer_" not in k}
    (old / "meta.json").write_text(json.dumps(raw))
    meta = load_meta(old, verify=True)
    assert (meta.format_version, meta.tokenizer.kind, meta.tokenizer.add_bos) == (
        1,
        "sentencepiece",
        False,
    )
    assert meta.tokenizer_files == [old / "tokenizer.model"]
    assert load_tokenizer(old).vocab_size == VOCAB
    assert _documents(old, "val") == _documents(builtin, "val")
    x, _ = next(BatchLoader(old, "train", 2, 16))
    assert x.shape == (2, 16)
