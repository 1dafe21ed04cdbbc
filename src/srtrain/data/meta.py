"""A prepared data directory's meta.json: its shards, its tokenizer and how it was prepared.

Format 2 records the tokenizer as ``{"kind", "files": {path: sha256}, "add_bos", "source"}``;
format 1 (SentencePiece only, ``"tokenizer": "tokenizer.model"``) still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from srtrain.corpus import BUILTIN, DataError
from srtrain.data.tokenizer import KINDS, SENTENCEPIECE, Tokenizer, load_tokenizer_files

FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"
SPLITS = ("train", "val")
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_VAL_FRACTION = 0.02
SHARD_TOKENS = 1 << 28
# A bounded sample of the train text (at most this many bytes) trains a new tokenizer.
TOKENIZER_SAMPLE_BYTES = 200_000_000
DEFAULT_TOKENIZER_KIND = "sentencepiece"

__all__ = [
    "DataMeta",
    "ShardMeta",
    "SplitMeta",
    "TokenizerMeta",
    "load_meta",
    "load_tokenizer",
    "prepare_again_command",
    "sha256_file",
    "token_range_error",
]


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_command(out_dir: str | os.PathLike[str]) -> str:
    """The simplest command that prepares ``out_dir``."""
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
class TokenizerMeta:
    """The tokenizer that produced the tokens: its kind, its files inside the data dir (path
    relative to it -> sha256; None in format 1), whether documents start with BOS, and the
    path it was copied from (None when trained during preparation)."""

    kind: str
    files: dict[str, str | None]
    add_bos: bool
    source: str | None

    def to_json(self) -> dict[str, Any]:
        """The meta.json form of this record."""
        return {
            "kind": self.kind,
            "files": self.files,
            "add_bos": self.add_bos,
            "source": self.source,
        }


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
    tokenizer: TokenizerMeta
    source: dict[str, Any]
    prepare: dict[str, Any]
    splits: dict[str, SplitMeta]

    @property
    def tokenizer_files(self) -> list[Path]:
        """The tokenizer's files inside the data dir."""
        return [self.data_dir / f for f in self.tokenizer.files]

    @property
    def tokenizer_path(self) -> Path:
        """The SentencePiece model file, or the directory of a Hugging Face tokenizer (which
        ``AutoTokenizer.from_pretrained`` loads)."""
        first = self.tokenizer_files[0]
        return first if self.tokenizer.kind == SENTENCEPIECE else first.parent

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
            "tokenizer": self.tokenizer.to_json(),
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
        options[:0] = [
            ("vocab_size", DEFAULT_VOCAB_SIZE),
            ("tokenizer_kind", DEFAULT_TOKENIZER_KIND),
            ("tokenizer_sample_bytes", TOKENIZER_SAMPLE_BYTES),
        ]
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


def _tokenizer_meta(raw: Any, path: Path) -> TokenizerMeta:
    if isinstance(raw, str):  # format 1: the SentencePiece model's file name
        return TokenizerMeta(SENTENCEPIECE, {raw: None}, False, None)
    if not isinstance(raw, dict) or raw.get("kind") not in KINDS or not raw.get("files"):
        raise DataError(
            f"{path} has a malformed tokenizer record {raw!r}; kinds: {', '.join(KINDS)}"
        )
    return TokenizerMeta(raw["kind"], dict(raw["files"]), bool(raw["add_bos"]), raw.get("source"))


def load_meta(data_dir: str | os.PathLike[str], verify: bool = False) -> DataMeta:
    """Read and check DIR/meta.json and its files (sha256 of every shard when verify)."""
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if not path.is_file():
        raise DataError(
            f"no prepared data at {data_dir} ({path} missing); "
            f"create it with: {prepare_command(data_dir)}"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from e
    if raw.get("format_version") not in READ_VERSIONS:
        raise DataError(
            f"{path} has format_version={raw.get('format_version')!r}, this code reads "
            f"{', '.join(map(str, READ_VERSIONS))}; re-create it with: "
            f"{prepare_command(data_dir)} --overwrite"
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
        skip = ("data_dir", "splits", "tokenizer")
        meta = DataMeta(
            data_dir=data_dir,
            **{k: raw[k] for k in DataMeta.__dataclass_fields__ if k not in skip},
            tokenizer=_tokenizer_meta(raw["tokenizer"], path),
            splits=splits,
        )
    except (KeyError, TypeError) as e:
        raise DataError(f"{path} is missing or has a malformed field ({e})") from e
    if meta.dtype not in ("uint16", "uint32"):
        raise DataError(f"{path} has dtype={meta.dtype!r}; allowed: 'uint16', 'uint32'")
    for file in meta.tokenizer_files:
        if not file.is_file():
            raise DataError(f"tokenizer file {file} listed in {path} is missing")
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
            if verify and sha256_file(shard_path) != shard.sha256:
                raise DataError(f"shard {shard_path} does not match its sha256 in {path}")
    return meta


def load_tokenizer(data_dir: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer that produced a prepared data directory's tokens, loaded from its copy
    inside the directory (see :mod:`srtrain.data.tokenizer`)."""
    meta = load_meta(data_dir)
    return load_tokenizer_files(meta.data_dir, meta.tokenizer.kind, meta.tokenizer.files)
