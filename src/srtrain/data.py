"""Token data: prepare text into SentencePiece token shards, and read them in batches."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import sentencepiece as spm
import torch

from srtrain.console import Ticker, megabytes, print_line
from srtrain.corpus import BUILTIN, BUILTIN_MAX_BYTES, DataError, Source, cap_bytes, open_corpus

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"
SPLITS = ("train", "val")
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_VAL_FRACTION = 0.02
SHARD_TOKENS = 1 << 28
# At most this much train text (a seeded sample of documents) trains the tokenizer.
TOKENIZER_TRAIN_BYTES = 200_000_000
# Validation windows come in one fixed order for every run, whatever its seed.
VAL_ORDER_SEED = 20240917
# Label of a padding row's tokens: cross_entropy's default ignore_index, left out of the loss.
IGNORE_INDEX = -100
_TRAIN_LINE_CHARS = 4096
_ENCODE_BATCH_BYTES = 8_000_000
_DOCUMENTS_FILE = "documents.jsonl"

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "DataError",
    "DataMeta",
    "ShardMeta",
    "SplitMeta",
    "TokenData",
    "ensure_prepared",
    "load_meta",
    "load_tokenizer",
    "main",
    "prepare",
    "prepare_again_command",
    "token_range_error",
]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise DataError(f"{name}={value!r} must be a positive integer")


def _non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise DataError(f"{name}={value!r} must be a non-negative integer")


def _prepare_command(out_dir: str | os.PathLike[str]) -> str:
    return f"python -m srtrain.data prepare --source builtin --out {out_dir}"


@dataclass(frozen=True)
class ShardMeta:
    """One flat token file of a split."""

    file: str
    num_tokens: int
    sha256: str


@dataclass(frozen=True)
class SplitMeta:
    """The shards of one split, in stream order."""

    num_tokens: int
    num_documents: int
    shards: tuple[ShardMeta, ...]


@dataclass(frozen=True)
class DataMeta:
    """The contents of a prepared data directory's meta.json."""

    data_dir: Path
    format_version: int
    vocab_size: int
    dtype: str
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    unk_id: int | None
    tokenizer: str
    source: dict[str, Any]
    prepare: dict[str, Any]
    splits: dict[str, SplitMeta]

    @property
    def tokenizer_path(self) -> Path:
        """Path of the SentencePiece model that produced the tokens."""
        return self.data_dir / self.tokenizer

    def to_json(self) -> dict[str, Any]:
        """The meta.json form of this record."""
        return {
            "format_version": self.format_version,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
            "tokenizer": self.tokenizer,
            "source": self.source,
            "prepare": self.prepare,
            "splits": {
                name: {
                    "num_tokens": s.num_tokens,
                    "num_documents": s.num_documents,
                    "shards": [vars(shard) for shard in s.shards],
                }
                for name, s in self.splits.items()
            },
        }


def prepare_again_command(meta: DataMeta) -> str:
    """The command that prepares meta's directory again with the settings recorded in its
    meta.json, replacing it (options at their defaults are left out)."""
    s = meta.prepare
    source = s.get("source", BUILTIN)
    args = [
        "python",
        "-m",
        "srtrain.data",
        "prepare",
        "--source",
        *(source if isinstance(source, list) else [source]),
        "--out",
        str(meta.data_dir),
    ]
    options: list[tuple[str, Any]] = [
        ("val_fraction", DEFAULT_VAL_FRACTION),
        ("text_field", "text"),
        ("max_bytes", None),
        ("seed", 0),
        ("shard_tokens", SHARD_TOKENS),
    ]
    if s.get("tokenizer") is not None:
        args += ["--tokenizer", str(s["tokenizer"])]
    else:
        options.insert(0, ("vocab_size", DEFAULT_VOCAB_SIZE))
    for key, default in options:
        if s.get(key, default) != default:
            args += [f"--{key.replace('_', '-')}", str(s[key])]
    return shlex.join([*args, "--overwrite"])


def token_range_error(meta: DataMeta, shard: str, token_id: int) -> DataError:
    """The error for a token id of ``shard`` at or above the data's vocabulary size."""
    return DataError(
        f"data shard {meta.data_dir / shard} holds token id {token_id}, outside the "
        f"vocabulary of {meta.vocab_size} tokens in {meta.data_dir / META_FILE}; prepare the "
        f"data again: {prepare_again_command(meta)}"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def load_meta(data_dir: str | os.PathLike[str], verify: bool = False) -> DataMeta:
    """Read and check DIR/meta.json and its files (sha256 of every shard when verify)."""
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if not path.is_file():
        raise DataError(
            f"no prepared data at {data_dir} ({path} missing); "
            f"create it with: {_prepare_command(data_dir)}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from e
    if raw.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version={raw.get('format_version')!r}, this code reads "
            f"{FORMAT_VERSION}; re-create it with: {_prepare_command(data_dir)} --overwrite"
        )
    try:
        splits = {
            name: SplitMeta(
                num_tokens=int(s["num_tokens"]),
                num_documents=int(s["num_documents"]),
                shards=tuple(ShardMeta(**shard) for shard in s["shards"]),
            )
            for name, s in raw["splits"].items()
        }
        meta = DataMeta(
            data_dir=data_dir,
            **{k: raw[k] for k in DataMeta.__dataclass_fields__ if k not in ("data_dir", "splits")},
            splits=splits,
        )
    except (KeyError, TypeError) as e:
        raise DataError(f"{path} is missing or has a malformed field ({e})") from e
    if meta.dtype not in ("uint16", "uint32"):
        raise DataError(f"{path} has dtype={meta.dtype!r}; allowed: 'uint16', 'uint32'")
    if not meta.tokenizer_path.is_file():
        raise DataError(f"tokenizer {meta.tokenizer_path} listed in {path} is missing")
    itemsize = np.dtype(meta.dtype).itemsize
    for split in splits.values():
        for shard in split.shards:
            shard_path = data_dir / shard.file
            if not shard_path.is_file():
                raise DataError(f"shard {shard_path} listed in {path} is missing")
            size = shard_path.stat().st_size
            if size != shard.num_tokens * itemsize:
                raise DataError(
                    f"shard {shard_path} has {size} bytes, meta.json says "
                    f"{shard.num_tokens * itemsize} ({shard.num_tokens} {meta.dtype} tokens)"
                )
            if verify and _sha256(shard_path) != shard.sha256:
                raise DataError(f"shard {shard_path} does not match its sha256 in {path}")
    return meta


def load_tokenizer(data_dir: str | os.PathLike[str]) -> spm.SentencePieceProcessor:
    """The SentencePiece processor of a prepared data directory."""
    return spm.SentencePieceProcessor(model_file=str(load_meta(data_dir).tokenizer_path))


# ---------------------------------------------------------------- preparing


class _SplitWriter:
    """Appends one split's tokens to shard files of at most shard_tokens tokens each."""

    def __init__(
        self, directory: Path, split: str, dtype: str, shard_tokens: int, ticker: Ticker
    ) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.ticker = ticker
        self.num_documents = 0
        self.shards: list[ShardMeta] = []
        self._file: BinaryIO | None = None
        self._digest = hashlib.sha256()
        self._count = 0

    def write(self, documents: list[list[int]], eos_id: int) -> None:
        """Append documents, each followed by EOS."""
        self.num_documents += len(documents)
        tokens = np.fromiter(
            chain.from_iterable(chain(doc, (eos_id,)) for doc in documents), dtype=self.dtype
        )
        while tokens.size:
            if self._file is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self._file = (self.directory / name).open("wb")
            chunk = tokens[: self.shard_tokens - self._count]
            data = chunk.tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._count += chunk.size
            tokens = tokens[chunk.size :]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._file is not None
        self._file.close()
        name = Path(self._file.name).name
        self.shards.append(ShardMeta(name, self._count, self._digest.hexdigest()))
        self.ticker.always(f"data: wrote {name} ({self._count:,} tokens)")
        self._file, self._digest, self._count = None, hashlib.sha256(), 0

    def close(self) -> SplitMeta:
        """Finish the last shard and describe the split."""
        if self._file is not None:
            self._close_shard()
        total = sum(s.num_tokens for s in self.shards)
        return SplitMeta(total, self.num_documents, tuple(self.shards))


def _read_documents(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _val_mask(num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    mask = np.zeros(num_documents, dtype=bool)
    if val_fraction == 0:
        return mask
    if num_documents < 2:
        raise DataError(
            f"val_fraction={val_fraction} needs at least 2 documents; the source has "
            f"{num_documents} (use --val-fraction 0 or add documents)"
        )
    count = min(max(1, round(val_fraction * num_documents)), num_documents - 1)
    mask[np.random.default_rng(seed).permutation(num_documents)[:count]] = True
    return mask


def _tokenizer_sample(sizes: np.ndarray, val: np.ndarray, seed: int) -> np.ndarray:
    """Mask of the train documents whose text trains the tokenizer."""
    train = np.flatnonzero(~val)
    if sizes[train].sum() <= TOKENIZER_TRAIN_BYTES:
        chosen = train
    else:
        order = np.random.default_rng([seed, 1]).permutation(train)
        count = int(np.searchsorted(np.cumsum(sizes[order]), TOKENIZER_TRAIN_BYTES))
        chosen = order[: max(1, count)]
    mask = np.zeros(len(sizes), dtype=bool)
    mask[chosen] = True
    return mask


def _train_tokenizer(
    documents: Path,
    chosen: np.ndarray,
    vocab_size: int,
    seed: int,
    model_file: Path,
    ticker: Ticker,
) -> None:
    loaded = 0

    def sentences() -> Iterator[str]:
        nonlocal loaded
        for doc, keep in zip(_read_documents(documents), chosen, strict=True):
            if keep:
                loaded += len(doc.encode("utf-8"))
                if ticker.due():
                    ticker.always(f"data: tokenizer loaded {megabytes(loaded)} of text")
                for line in doc.split("\n"):
                    for i in range(0, len(line), _TRAIN_LINE_CHARS):
                        yield line[i : i + _TRAIN_LINE_CHARS]

    spm.set_random_generator_seed(seed)
    try:
        with model_file.open("wb") as writer:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=writer,
                model_type="bpe",
                vocab_size=vocab_size,
                hard_vocab_limit=False,
                byte_fallback=True,
                character_coverage=0.9999,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                user_defined_symbols=["\n"],
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=3,
                input_sentence_size=0,
                max_sentence_length=4 * _TRAIN_LINE_CHARS,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
    except RuntimeError as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else "unknown error"
        raise DataError(f"tokenizer training failed for vocab_size={vocab_size}: {message}") from e


def _optional_id(value: int) -> int | None:
    return value if value >= 0 else None


def _build(
    staging: Path,
    documents: Iterator[str],
    source: dict[str, Any],
    settings: dict[str, Any],
    ticker: Ticker,
) -> None:
    """Write shards, tokenizer and meta.json of a prepared directory into `staging`."""
    doc_file = staging / _DOCUMENTS_FILE
    sizes = []
    total = 0
    start = time.monotonic()
    with doc_file.open("w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps(doc) + "\n")
            sizes.append(len(doc.encode("utf-8")))
            total += sizes[-1]
            if ticker.due():
                ticker.always(f"data: read {megabytes(total)}, {len(sizes):,} documents")
    if not sizes:
        raise DataError(f"source {settings['source']} holds no text")
    ticker.always(
        f"data: read {megabytes(total)}, {len(sizes):,} documents in "
        f"{time.monotonic() - start:.1f} s"
    )
    sizes_array = np.asarray(sizes, dtype=np.int64)
    val = _val_mask(len(sizes), settings["val_fraction"], settings["seed"])

    model_file = staging / TOKENIZER_FILE
    if settings["tokenizer"] is None:
        chosen = _tokenizer_sample(sizes_array, val, settings["seed"])
        ticker.always(
            f"data: training a {settings['vocab_size']}-token BPE tokenizer on "
            f"{megabytes(int(sizes_array[chosen].sum()))} of text"
        )
        start = time.monotonic()
        _train_tokenizer(
            doc_file, chosen, settings["vocab_size"], settings["seed"], model_file, ticker
        )
        ticker.always(f"data: tokenizer trained in {time.monotonic() - start:.1f} s")
    else:
        shutil.copyfile(settings["tokenizer"], model_file)
    try:
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
    except (RuntimeError, OSError) as e:
        raise DataError(f"{settings['tokenizer']} is not a SentencePiece model ({e})") from e
    if sp.eos_id() < 0:
        raise DataError(f"tokenizer {settings['tokenizer']} defines no EOS piece; one is required")
    vocab_size = sp.get_piece_size()
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"

    writers = {s: _SplitWriter(staging, s, dtype, settings["shard_tokens"], ticker) for s in SPLITS}
    batch: list[str] = []
    batch_val: list[bool] = []
    batch_bytes = 0
    done = 0

    def flush() -> None:
        encoded = sp.encode(batch, num_threads=os.cpu_count() or 1)
        for split, in_val in (("train", False), ("val", True)):
            picked = [ids for ids, v in zip(encoded, batch_val, strict=True) if v == in_val]
            writers[split].write(picked, sp.eos_id())
        batch.clear()
        batch_val.clear()

    for doc, in_val, size in zip(_read_documents(doc_file), val, sizes, strict=True):
        batch.append(doc)
        batch_val.append(bool(in_val))
        batch_bytes += size
        if batch_bytes >= _ENCODE_BATCH_BYTES:
            flush()
            done += batch_bytes
            batch_bytes = 0
            if ticker.due():
                ticker.always(
                    f"data: tokenized {megabytes(done)} of {megabytes(total)} "
                    f"({100 * done / total:.0f}%)"
                )
    if batch:
        flush()
    doc_file.unlink()

    meta = DataMeta(
        data_dir=staging,
        format_version=FORMAT_VERSION,
        vocab_size=vocab_size,
        dtype=dtype,
        bos_id=_optional_id(sp.bos_id()),
        eos_id=sp.eos_id(),
        pad_id=_optional_id(sp.pad_id()),
        unk_id=_optional_id(sp.unk_id()),
        tokenizer=TOKENIZER_FILE,
        source={**source, "num_documents": len(sizes), "text_bytes": int(sizes_array.sum())},
        prepare=settings,
        splits={s: w.close() for s, w in writers.items()},
    )
    (staging / META_FILE).write_text(json.dumps(meta.to_json(), indent=2) + "\n")


def _publish(staging: Path, out_dir: Path) -> None:
    """Move a finished staging directory to out_dir, replacing a previous one."""
    if out_dir.exists() and any(out_dir.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(staging, out_dir)


def prepare(
    source: Source,
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer: str | os.PathLike[str] | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    text_field: str = "text",
    max_bytes: int | None = None,
    seed: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    overwrite: bool = False,
    progress: Ticker | None = None,
) -> Path:
    """Tokenize `source` into train/val token shards, tokenizer and meta.json under out_dir;
    progress lines (bytes and documents read, tokenizer training, shards written) go to
    ``progress``."""
    out_dir = Path(out_dir)
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction={val_fraction} is outside [0, 1)")
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes={max_bytes} must be positive (or None for no cap)")
    _positive("shard_tokens", shard_tokens)
    _non_negative("seed", seed)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise DataError(f"tokenizer file {tokenizer} not found (expected a SentencePiece .model)")
    if out_dir.exists() and not overwrite:
        if (out_dir / META_FILE).exists():
            raise DataError(f"{out_dir} is already prepared; pass --overwrite to replace it")
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise DataError(f"{out_dir} exists and is not an empty directory; choose another --out")

    corpus = open_corpus(source, text_field)
    cap = (
        BUILTIN_MAX_BYTES
        if max_bytes is None and corpus.description["kind"] == BUILTIN
        else max_bytes
    )
    settings = {
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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    os.chmod(staging, 0o755)
    ticker = progress if progress is not None else Ticker(None)
    names = settings["source"] if isinstance(settings["source"], list) else [settings["source"]]
    ticker.always(
        f"data: preparing {out_dir} from {', '.join(names)}"
        + (f" (at most {megabytes(cap)} of text)" if cap is not None else "")
    )
    try:
        _build(staging, cap_bytes(corpus.documents, cap), corpus.description, settings, ticker)
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


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
                    f"create it with: {_prepare_command(out_dir)}"
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


# ---------------------------------------------------------------- reading


class TokenData:
    """The token stream of one split, memory-mapped from its shards."""

    def __init__(self, data_dir: str | os.PathLike[str], split: str) -> None:
        self.meta = load_meta(data_dir)
        if split not in self.meta.splits:
            raise DataError(
                f"split {split!r} not in {data_dir}; splits: {', '.join(self.meta.splits)}"
            )
        self.split = split
        shards = [s for s in self.meta.splits[split].shards if s.num_tokens > 0]
        self._files = [s.file for s in shards]
        self._maps = [
            np.memmap(self.meta.data_dir / s.file, dtype=self.meta.dtype, mode="r") for s in shards
        ]
        self._starts = np.cumsum([0] + [s.num_tokens for s in shards])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream as int64; a token id outside
        the vocabulary raises DataError."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {len(self)})")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self._starts[shard])
            piece = self._maps[shard][offset : offset + length - done]
            top = int(piece.max())
            if top >= self.meta.vocab_size:
                raise token_range_error(self.meta, self._files[shard], top)
            out[done : done + len(piece)] = piece
            done += len(piece)
            shard += 1
        return out


class BatchLoader:
    """Deterministic (input_ids, labels) batches; rank r gets slice r of each global batch.

    Samples are windows of seq_len + 1 tokens starting at multiples of seq_len, drawn from a
    permutation seeded by (seed, epoch); labels are the inputs shifted left by one token.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        split: str,
        global_batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        _positive("global_batch_size", global_batch_size)
        _positive("seq_len", seq_len)
        _positive("world_size", world_size)
        _non_negative("seed", seed)
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} is outside [0, world_size={world_size})")
        if global_batch_size % world_size:
            raise DataError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"world_size={world_size}; use a multiple of {world_size}"
            )
        self.data = TokenData(data_dir, split)
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self.local_batch_size = global_batch_size // world_size
        self.num_windows = (len(self.data) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"split {split!r} of {data_dir} has {len(self.data)} tokens; "
                f"seq_len={seq_len} needs at least {seq_len + 1}"
            )
        self._position = 0
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """Passes over the split completed before the next sample."""
        return self._position // self.num_windows

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.num_windows)
        if epoch not in self._permutations:
            self._permutations = {e: p for e, p in self._permutations.items() if e == epoch - 1}
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_windows)
        return int(self._permutations[epoch][index])

    def _batch(self, windows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.seq_len + 1
        rows = np.stack([self.data.read(w * self.seq_len, length) for w in windows])
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _rank_samples(self, first: int) -> range:
        start = first + self.rank * self.local_batch_size
        return range(start, start + self.local_batch_size)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        samples = self._rank_samples(self._position)
        self._position += self.global_batch_size
        return self._batch([self._window(s) for s in samples])

    def state_dict(self) -> dict[str, int | str]:
        """The global position and what it depends on; independent of rank and world size."""
        return {
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
            "position": self._position,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state_dict() taken at any world size."""
        for key in ("split", "seed", "seq_len", "num_windows"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"loader state has {key}={state.get(key)!r}, this loader has "
                    f"{key}={getattr(self, key)!r}"
                )
        self._position = int(state["position"])

    @property
    def short(self) -> bool:
        """Whether the split has fewer windows than one global batch."""
        return self.num_windows < self.global_batch_size

    def val_notice(self) -> str | None:
        """The line that says a short split is validated on the windows it has; None when
        it holds a global batch."""
        if not self.short:
            return None
        return (
            f"validation: split {self.split!r} has {self.num_windows} windows of seq_len "
            f"{self.seq_len}, fewer than a batch of {self.global_batch_size}; validating on "
            f"those {self.num_windows} windows"
        )

    def val_batches(
        self, num_batches: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slices of a fixed sequence of global batches (all full ones if None).

        A :attr:`short` split is one batch of all its windows: each rank takes
        ceil(windows / world_size) of them, and rows past the last window are padding
        (inputs 0, labels ``IGNORE_INDEX``, which the loss leaves out), so every rank runs
        the same forward passes.
        """
        order = np.random.default_rng(VAL_ORDER_SEED).permutation(self.num_windows)
        if self.short:
            if num_batches == 0:
                return iter(())
            share = -(-self.num_windows // self.world_size)
            mine = [int(w) for w in order[self.rank * share : (self.rank + 1) * share]]
            return iter((self._padded_batch(mine, share),))
        available = self.num_windows // self.global_batch_size
        count = available if num_batches is None else min(num_batches, available)
        return (
            self._batch([int(order[s]) for s in self._rank_samples(b * self.global_batch_size)])
            for b in range(count)
        )

    def _padded_batch(self, windows: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``windows`` padded to ``rows`` rows that the loss ignores."""
        inputs = torch.zeros(rows, self.seq_len, dtype=torch.int64)
        labels = torch.full((rows, self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        if windows:
            x, y = self._batch(windows)
            inputs[: len(windows)], labels[: len(windows)] = x, y
        return inputs, labels


# ---------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `prepare` a data directory."""
    parser = argparse.ArgumentParser(prog="python -m srtrain.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenize a text source into token shards")
    p.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="'builtin' (the Python stdlib), 'packages' (sources and docs of the installed "
        "Python packages), .txt/.json/.jsonl/.parquet files or dirs, "
        "or a Hugging Face dataset name[:config]",
    )
    p.add_argument("--out", required=True, help="directory to create")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="existing SentencePiece .model to use")
    tok.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION)
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-bytes", type=int, help=f"text cap (builtin: {BUILTIN_MAX_BYTES})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    p.add_argument("--overwrite", action="store_true", help="replace a prepared --out")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        out = prepare(
            args.source[0] if len(args.source) == 1 else args.source,
            args.out,
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            max_bytes=args.max_bytes,
            seed=args.seed,
            shard_tokens=args.shard_tokens,
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


if __name__ == "__main__":
    sys.exit(main())
