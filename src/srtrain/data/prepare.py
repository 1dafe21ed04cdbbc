"""Preparing a data directory: stream a source, tokenize it across worker processes, write
token shards, publish the directory atomically; resume a killed preparation; prepare one
part of a source on each of several machines.

The source is read as a stream (never copied to disk), in chunks of about ``chunk_bytes`` of
text; at most ``2 × workers`` chunks are in memory. The output depends only on the source and
the settings, not on the number of workers. A preparation writes into ``.NAME.staging`` beside
``OUT`` and records there, after each chunk, what is on disk (``progress.json``); run again with
the same settings, it keeps what was written and continues after the last recorded chunk.
``OUT`` appears, complete, only at the end (one rename).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from srtrain.console import Ticker, megabytes
from srtrain.corpus import BUILTIN, BUILTIN_MAX_BYTES, DataError, Source, cap_bytes, open_corpus
from srtrain.data.encode import Chunk, encode_chunks
from srtrain.data.loader import non_negative, positive
from srtrain.data.meta import (
    DEFAULT_TOKENIZER_KIND,
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    FORMAT_VERSION,
    META_FILE,
    SHARD_TOKENS,
    SPLITS,
    TOKENIZER_SAMPLE_BYTES,
    DataMeta,
    TokenizerMeta,
    load_meta,
    prepare_command,
    sha256_file,
)
from srtrain.data.shards import SplitWriter
from srtrain.data.split import TokenizerSample, ValSelector
from srtrain.data.tokenizer import (
    HF_DIR,
    SENTENCEPIECE_FILE,
    TRANSFORMERS,
    Tokenizer,
    install_tokenizer,
    load_tokenizer_files,
    open_tokenizer,
    train_bpe,
    train_sentencepiece,
)

CHUNK_BYTES = 4_000_000
PROGRESS_FILE = "progress.json"
PARTS_DIR = "parts"
TOKENIZER_KINDS = ("sentencepiece", "bpe")

__all__ = ["CHUNK_BYTES", "ensure_prepared", "parse_part", "part_dir", "prepare", "publish"]


def parse_part(text: str) -> tuple[int, int]:
    """``"i/N"`` as (i, N) with 0 <= i < N; DataError otherwise."""
    index, _, count = text.partition("/")
    try:
        part = (int(index), int(count))
    except ValueError:
        part = (-1, 0)
    if not 0 <= part[0] < part[1]:
        raise DataError(f"--part {text!r} is not i/N with 0 <= i < N (e.g. 0/4 ... 3/4)")
    return part


def part_dir(out_dir: Path, part: tuple[int, int]) -> Path:
    """Where part ``i/N`` of ``out_dir`` is prepared (a data dir of its own until merged)."""
    return out_dir / PARTS_DIR / f"{part[0]:05d}-of-{part[1]:05d}"


def publish(staging: Path, out_dir: Path) -> None:
    """Move a finished staging directory to out_dir, replacing a previous one."""
    if out_dir.exists() and any(out_dir.iterdir()):
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(staging, out_dir)


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(value, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this process alone; DataError if another holds it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"another preparation is writing {directory}; wait for it or stop it"
            ) from None
        yield
    finally:
        os.close(fd)


class _Stream:
    """The documents of a source in order, with their index and split."""

    def __init__(self, source: Source, text_field: str, cap: int | None, settings: dict) -> None:
        self.source, self.text_field, self.cap = source, text_field, cap
        self.val_fraction, self.seed = settings["val_fraction"], settings["seed"]

    def documents(self) -> Iterator[tuple[int, str, bool]]:
        """(index, text, is_val) of every document."""
        corpus = open_corpus(self.source, self.text_field)
        selector = ValSelector(self.val_fraction, self.seed)
        for index, text in enumerate(cap_bytes(corpus.documents, self.cap)):
            yield index, text, selector.is_val(index)


def _train_tokenizer(
    stream: _Stream, settings: dict[str, Any], staging: Path, ticker: Ticker
) -> Tokenizer:
    """Sample the train text (a bounded number of bytes) and train a new tokenizer on it."""
    sample = TokenizerSample(settings["tokenizer_sample_bytes"], settings["seed"])
    start = time.monotonic()
    for index, text, is_val in stream.documents():
        if not is_val:
            sample.offer(index, text)
        if ticker.due():
            ticker.always(
                f"data: tokenizer sample: read {megabytes(sample.seen_bytes)}, "
                f"{sample.seen_documents:,} train documents"
            )
    if not len(sample):
        raise DataError(f"source {settings['source']} holds no train text")
    ticker.always(
        f"data: sampled {megabytes(sample.bytes)} of {megabytes(sample.seen_bytes)} of train "
        f"text ({len(sample):,} of {sample.seen_documents:,} documents) for the tokenizer in "
        f"{time.monotonic() - start:.1f} s"
    )
    kind, vocab = settings["tokenizer_kind"], settings["vocab_size"]
    ticker.always(
        f"data: training a {vocab}-token "
        f"{'BPE' if kind == 'sentencepiece' else 'byte-level BPE'} tokenizer on "
        f"{megabytes(sample.bytes)} of text"
    )
    start = time.monotonic()
    if kind == "sentencepiece":
        train_sentencepiece(
            sample.documents(),
            vocab,
            settings["seed"],
            staging / SENTENCEPIECE_FILE,
            threads=usable_cpus(),
        )
        tokenizer = open_tokenizer(staging / SENTENCEPIECE_FILE)
    else:
        train_bpe(sample.documents(), vocab, staging / HF_DIR)
        tokenizer = load_tokenizer_files(staging, TRANSFORMERS, [])
    ticker.always(f"data: tokenizer trained in {time.monotonic() - start:.1f} s")
    return tokenizer


def _chunks(
    stream: _Stream,
    chunk_bytes: int,
    skip: int,
    part: tuple[int, int],
    counts: dict[str, int],
) -> Iterator[tuple[int, Chunk]]:
    """(index, chunk) of this part's chunks after the first ``skip``; ``counts`` tracks the
    documents and bytes read."""
    texts: list[str] = []
    val: list[bool] = []
    size = 0
    index = 0

    def take() -> bool:
        return index >= skip and index % part[1] == part[0]

    for _, text, is_val in stream.documents():
        texts.append(text)
        val.append(is_val)
        size += len(text.encode("utf-8"))
        if size >= chunk_bytes:
            counts["documents"] += len(texts)
            counts["bytes"] += size
            if take():
                yield index, (texts, val)
            texts, val, size = [], [], 0
            index += 1
    if texts:
        counts["documents"] += len(texts)
        counts["bytes"] += size
        if take():
            yield index, (texts, val)


def check_splits(splits: dict[str, Any], num_documents: int, val_fraction: float) -> None:
    """DataError unless the train split, and the val split when asked for, hold documents."""
    if splits["train"].num_documents == 0:
        raise DataError(
            f"the source's {num_documents} documents all went to validation "
            f"(val_fraction={val_fraction}); lower --val-fraction or add documents"
        )
    if val_fraction > 0 and splits["val"].num_documents == 0:
        raise DataError(
            f"val_fraction={val_fraction} held out none of the source's {num_documents} "
            f"documents (one in every {1 / val_fraction:.0f}); use --val-fraction 0, a larger "
            "fraction, or more documents"
        )


def _build(
    staging: Path,
    stream: _Stream,
    description: dict[str, Any],
    settings: dict[str, Any],
    given: Tokenizer | None,
    workers: int,
    chunk_bytes: int,
    ticker: Ticker,
) -> None:
    """Write (or continue writing) tokenizer, shards and meta.json into ``staging``."""
    progress_file = staging / PROGRESS_FILE
    journal: dict[str, Any] = {"settings": settings, "chunk_bytes": chunk_bytes}
    if progress_file.is_file():
        journal = json.loads(progress_file.read_text(encoding="utf-8"))
    if "tokenizer" not in journal:
        tokenizer = (
            given if given is not None else _train_tokenizer(stream, settings, staging, ticker)
        )
        files = install_tokenizer(tokenizer, staging)
        journal["tokenizer"] = {
            "kind": tokenizer.kind,
            "files": {f: sha256_file(staging / f) for f in files},
            **tokenizer.record(),
        }
        write_json(progress_file, journal)
    record = journal["tokenizer"]
    dtype = "uint16" if record["vocab_size"] <= 1 << 16 else "uint32"
    writers = {s: SplitWriter(staging, s, dtype, settings["shard_tokens"], ticker) for s in SPLITS}
    done = int(journal.get("chunks", 0))
    counts = {"documents": 0, "bytes": 0}
    tokenized = int(journal.get("tokenized_bytes", 0))
    if done:
        for split, writer in writers.items():
            writer.resume(journal["splits"][split])
        ticker.always(
            f"data: resuming after chunk {done} ({megabytes(tokenized)} tokenized before)"
        )
    part = tuple(settings["part"]) if settings.get("part") else (0, 1)
    start = time.monotonic()
    chunks = _chunks(stream, chunk_bytes, done, part, counts)
    taken: list[tuple[int, int]] = []  # (chunk index, text bytes) in order

    def texts() -> Iterator[Chunk]:
        for index, chunk in chunks:
            taken.append((index, sum(len(t.encode("utf-8")) for t in chunk[0])))
            yield chunk

    tokenizer = load_tokenizer_files(staging, record["kind"], list(record["files"]))
    encoded = encode_chunks(texts(), tokenizer, dtype, workers)
    now = 0
    for position, result in enumerate(encoded):
        for split, (tokens, num_documents) in result.items():
            writers[split].write(tokens, num_documents)
            writers[split].sync()
        index, size = taken[position]
        now += size
        journal.update(
            chunks=index + 1,
            tokenized_bytes=tokenized + now,
            splits={s: w.state() for s, w in writers.items()},
        )
        write_json(progress_file, journal)
        if ticker.due():
            ticker.always(
                f"data: tokenized {megabytes(tokenized + now)} "
                f"({now / 1e6 / max(time.monotonic() - start, 1e-9):.1f} MB/s)"
            )
    elapsed = time.monotonic() - start
    if counts["documents"] == 0:
        raise DataError(f"source {settings['source']} holds no text")
    ticker.always(
        f"data: read {megabytes(counts['bytes'])}, {counts['documents']:,} documents in "
        f"{elapsed:.1f} s; tokenized {megabytes(now)} ({now / 1e6 / max(elapsed, 1e-9):.1f} "
        f"MB/s, {workers} worker{'s' if workers > 1 else ''})"
    )
    splits = {s: w.close() for s, w in writers.items()}
    if part[1] == 1:
        check_splits(splits, counts["documents"], settings["val_fraction"])
    meta = DataMeta(
        data_dir=staging,
        format_version=FORMAT_VERSION,
        vocab_size=record["vocab_size"],
        dtype=dtype,
        bos_id=record["bos_id"],
        eos_id=record["eos_id"],
        pad_id=record["pad_id"],
        unk_id=record["unk_id"],
        tokenizer=TokenizerMeta(
            record["kind"], record["files"], record["add_bos"], settings["tokenizer"]
        ),
        source={**description, "num_documents": counts["documents"], "text_bytes": counts["bytes"]},
        prepare=settings,
        splits=splits,
    )
    progress_file.unlink()
    write_json(staging / META_FILE, meta.to_json())


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _resolve_workers(workers: int | None) -> int:
    if workers is None:
        return usable_cpus()
    positive("workers", workers)
    return workers


def prepare(
    source: Source,
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: str | os.PathLike[str] | None = None,
    tokenizer_kind: str = DEFAULT_TOKENIZER_KIND,
    tokenizer_sample_bytes: int = TOKENIZER_SAMPLE_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    text_field: str = "text",
    max_bytes: int | None = None,
    seed: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    workers: int | None = None,
    part: tuple[int, int] | None = None,
    overwrite: bool = False,
    progress: Ticker | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Path:
    """Tokenize ``source`` into train/val token shards, tokenizer and meta.json under
    ``out_dir`` (see the module docstring); returns the prepared directory.

    ``tokenizer``: an existing tokenizer (SentencePiece .model, tokenizer.json or transformers
    directory), checked before the source is read; without it a ``tokenizer_kind``
    ("sentencepiece" or byte-level "bpe") tokenizer of ``vocab_size`` tokens is trained on a
    seeded sample of at most ``tokenizer_sample_bytes`` of train text. ``workers``: tokenizer
    processes (None: every core of this machine). ``part`` (i, N): prepare only every N-th
    chunk of the source, starting at chunk i, into ``part_dir(out_dir, part)``; :func:`merge`
    joins the N parts. ``chunk_bytes``: text per chunk (the unit of work and of resuming; the
    output does not depend on it). Progress lines go to ``progress``.
    """
    out_dir = Path(out_dir)
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} is outside [0, 1)")
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes={max_bytes} must be positive (or None for no cap)")
    positive("shard_tokens", shard_tokens)
    positive("tokenizer_sample_bytes", tokenizer_sample_bytes)
    positive("chunk_bytes", chunk_bytes)
    non_negative("seed", seed)
    workers = _resolve_workers(workers)
    if tokenizer_kind not in TOKENIZER_KINDS:
        raise DataError(f"tokenizer_kind={tokenizer_kind!r}; allowed: {', '.join(TOKENIZER_KINDS)}")
    if part is not None and tokenizer is None:
        raise DataError(
            "--part needs an existing --tokenizer (every part must tokenize alike); train one "
            "first, e.g. prepare a sample with --max-bytes and pass its tokenizer"
        )
    given = open_tokenizer(tokenizer) if tokenizer is not None else None
    target = part_dir(out_dir, part) if part is not None else out_dir
    if target.exists() and not overwrite:
        if (target / META_FILE).exists():
            raise DataError(f"{target} is already prepared; pass --overwrite to replace it")
        if not target.is_dir() or any(target.iterdir()):
            raise DataError(f"{target} exists and is not an empty directory; choose another --out")

    corpus = open_corpus(source, text_field)
    cap = (
        BUILTIN_MAX_BYTES
        if max_bytes is None and corpus.description["kind"] == BUILTIN
        else max_bytes
    )
    settings: dict[str, Any] = {
        "source": (
            os.fspath(source)
            if isinstance(source, str | os.PathLike)
            else [os.fspath(s) for s in source]
        ),
        "vocab_size": None if tokenizer is not None else vocab_size,
        "tokenizer": None if tokenizer is None else str(tokenizer),
        "val_fraction": val_fraction,
        "text_field": text_field,
        "max_bytes": max_bytes,
        "seed": seed,
        "shard_tokens": shard_tokens,
    }
    if tokenizer is None:
        settings["tokenizer_kind"] = tokenizer_kind
        settings["tokenizer_sample_bytes"] = tokenizer_sample_bytes
    if part is not None:
        settings["part"] = list(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.staging"
    ticker = progress if progress is not None else Ticker(None)
    names = settings["source"] if isinstance(settings["source"], list) else [settings["source"]]
    ticker.always(
        f"data: preparing {target} from {', '.join(names)}"
        + (f" (at most {megabytes(cap)} of text)" if cap is not None else "")
    )
    staging.mkdir(mode=0o755, exist_ok=True)
    with _exclusive(staging):
        _start_staging(staging, settings, chunk_bytes, ticker)
        try:
            stream = _Stream(source, text_field, cap, settings)
            _build(
                staging, stream, corpus.description, settings, given, workers, chunk_bytes, ticker
            )
        except DataError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        publish(staging, target)
    return target


def _start_staging(
    staging: Path, settings: dict[str, Any], chunk_bytes: int, ticker: Ticker
) -> None:
    """Keep what an interrupted preparation with these settings left in ``staging``; else
    empty it."""
    journal = staging / PROGRESS_FILE
    if journal.is_file():
        try:
            kept = json.loads(journal.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            kept = {}
        if kept.get("settings") == settings and kept.get("chunk_bytes") == chunk_bytes:
            return
        ticker.always(
            f"data: {staging} was left by a preparation with other settings; starting over"
        )
    for path in staging.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# Settings of a prepared dir that decide its tokens: one that differs from what is asked is
# refused. Any other (the source, max_bytes, val_fraction, ...) is a notice: the dir is used
# as it was prepared.
TOKEN_SETTINGS = ("vocab_size", "tokenizer")


def _setting(value: Any) -> str:
    """A recorded or asked setting as a config would spell it."""
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return " ".join(os.fspath(v) for v in value)
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


def _same_source(recorded: Any, wanted: Source) -> bool:
    """Whether a recorded ``source`` setting names the same text as ``wanted`` (the same
    names, or paths that resolve to the same files)."""
    names = [os.fspath(s) for s in ([wanted] if isinstance(wanted, str | os.PathLike) else wanted)]
    before = recorded if isinstance(recorded, list) else [recorded]
    if before == names:
        return True
    return len(before) == len(names) and all(
        a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())
        for a, b in zip(map(str, before), names, strict=True)
    )


def ensure_prepared(
    out_dir: str | os.PathLike[str],
    source: Source | None = BUILTIN,
    progress: Ticker | None = None,
    *,
    notice: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> Path:
    """Prepare out_dir with `prepare(source, out_dir, progress=progress, **kwargs)` unless its
    meta.json exists; a prepared dir is used as it was prepared.

    Its tokens must be those asked for: a recorded ``vocab_size`` or ``tokenizer`` other than
    `kwargs`' raises DataError (a dir prepared with an existing tokenizer has that
    tokenizer's vocabulary, whatever `vocab_size` asks; without `vocab_size` any vocabulary is
    taken). Other settings that differ (`source`, max_bytes, val_fraction, ...) are one line
    to ``notice``. `source` None or "": not named; a dir without meta.json raises DataError.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _directory_lock(out_dir.parent):
        if not (out_dir / META_FILE).exists():
            if not source:
                raise DataError(
                    f"no prepared data at {out_dir} and no source to prepare it from; "
                    f"create it with: {prepare_command(out_dir)}"
                )
            return prepare(source, out_dir, progress=progress, **kwargs)
    recorded = load_meta(out_dir).prepare
    differ: list[tuple[str, Any, Any]] = []
    if source and "source" in recorded and not _same_source(recorded["source"], source):
        differ.append(("source", recorded["source"], source))
    for key, wanted in kwargs.items():
        if key == "vocab_size" and recorded.get("tokenizer") is not None:
            continue
        if key not in recorded:
            continue
        wanted = str(wanted) if key == "tokenizer" and wanted is not None else wanted
        if recorded[key] == wanted:
            continue
        if key in TOKEN_SETTINGS:
            use = (
                "leave data.vocab_size unset (null) to use its vocabulary, or "
                if key == "vocab_size"
                else ""
            )
            raise DataError(
                f"{out_dir} was prepared with {key}={recorded[key]!r}, asked for "
                f"{wanted!r}; {use}remove {out_dir} or choose another data dir"
            )
        differ.append((key, recorded[key], wanted))
    if differ and notice is not None:
        notice(
            f"data: {out_dir} was prepared with "
            + ", ".join(f"{k}={_setting(before)}" for k, before, _ in differ)
            + "; the config asks "
            + ", ".join(f"data.{k}={_setting(now)}" for k, _, now in differ)
            + "; using it as prepared (delete it to prepare again)"
        )
    return out_dir
