"""Verification of a prepared data directory before training reads it: its shards, and its
tokenizer against the model it trains.

Every shard's bytes must hash to the sha256 in meta.json and its token ids must lie below the
data's vocabulary size. Reading a shard costs one streamed pass (sha256 and the largest token
id together), so a successful pass is remembered in a small JSON cache: a shard whose size,
mtime, ctime and inode still match a remembered pass is trusted without being read again.
The cache lives in the data directory (``.verified.json``); where that cannot be written, in a
fallback directory (the run directory), and without either the shards are read every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from srtrain.data import (
    META_FILE,
    DataError,
    DataMeta,
    prepare_again_command,
    token_range_error,
    usable_cpus,
)

CACHE_FILE = ".verified.json"
CACHE_VERSION = 1
_BLOCK_BYTES = 1 << 22

__all__ = ["CACHE_FILE", "Verification", "cache_files", "check_model_vocabulary", "verify_data"]


@dataclass(frozen=True)
class Verification:
    """Which shards (file names, in meta.json order) one verification read and which it trusted
    from a remembered pass."""

    hashed: tuple[str, ...]
    trusted: tuple[str, ...]


def cache_files(data_dir: Path, fallback_dir: str | os.PathLike[str] | None) -> list[Path]:
    """Where the cache of ``data_dir`` may live, most preferred first."""
    files = [data_dir / CACHE_FILE]
    if fallback_dir is not None:
        key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
        files.append(Path(fallback_dir) / f"data-verified-{key}.json")
    return files


def _stat_key(path: Path) -> dict[str, int]:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def _read_cache(files: list[Path]) -> dict[str, dict[str, Any]]:
    """The remembered passes by shard file name; an unreadable cache counts as empty."""
    entries: dict[str, dict[str, Any]] = {}
    for path in reversed(files):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and raw.get("version") == CACHE_VERSION:
            entries.update({k: v for k, v in raw.get("shards", {}).items() if isinstance(v, dict)})
    return entries


def _write_cache(files: list[Path], entries: dict[str, dict[str, Any]]) -> None:
    """Atomically write the cache to the first of ``files`` that accepts it, if any does."""
    text = json.dumps({"version": CACHE_VERSION, "shards": entries}, indent=1) + "\n"
    for path in files:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
            return
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _scan(path: Path, dtype: str) -> tuple[str, int]:
    """sha256 of the file and its largest token id (-1 when empty), in one streamed pass."""
    digest = hashlib.sha256()
    top = -1
    itemsize = np.dtype(dtype).itemsize
    buffer = bytearray(_BLOCK_BYTES)
    view = memoryview(buffer)
    try:
        with path.open("rb") as f:
            while count := f.readinto(buffer):
                digest.update(view[:count])
                tokens = np.frombuffer(buffer, dtype=dtype, count=count // itemsize)
                if tokens.size:
                    top = max(top, int(tokens.max()))
    except OSError as e:
        raise DataError(f"cannot read data shard {path}: {e.strerror or e}") from e
    return digest.hexdigest(), top


def verify_data(
    meta: DataMeta,
    fallback_dir: str | os.PathLike[str] | None = None,
    threads: int | None = None,
) -> Verification:
    """Check every shard of ``meta`` (as returned by ``load_meta``, which checked the sizes)
    against its sha256 and its token ids against ``meta.vocab_size``.

    The shards not trusted from a remembered pass are read on ``threads`` threads at once
    (default: every CPU the process may use; hashing and the id scan release the GIL), each
    shard by one thread. Raises DataError, one line naming the first bad shard in meta.json's
    order and the command that prepares the data again. Passes are remembered (see the
    module docstring) in the data directory or else in ``fallback_dir``, those of the shards
    before a bad one too.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"verify_data needs at least one thread, got {threads}")
    files = cache_files(meta.data_dir, fallback_dir)
    remembered = _read_cache(files)
    shards = [shard for split in meta.splits.values() for shard in split.shards]
    keys = {shard.file: _stat_key(meta.data_dir / shard.file) for shard in shards}

    def trusted(shard) -> bool:
        entry = remembered.get(shard.file)
        return (
            entry is not None
            and entry.get("sha256") == shard.sha256
            and all(entry.get(k) == v for k, v in keys[shard.file].items())
        )

    to_scan = [shard for shard in shards if not trusted(shard)]
    entries: dict[str, dict[str, Any]] = {}
    hashed: list[str] = []
    pool = ThreadPoolExecutor(max(1, min(len(to_scan), threads or usable_cpus())))
    try:
        scans = {s.file: pool.submit(_scan, meta.data_dir / s.file, meta.dtype) for s in to_scan}
        for shard in shards:
            scan = scans.get(shard.file)
            if scan is None:
                entry = remembered[shard.file]
            else:
                sha256, top = scan.result()
                if sha256 != shard.sha256:
                    raise DataError(
                        f"data shard {meta.data_dir / shard.file} does not match its checksum "
                        f"in {meta.data_dir / META_FILE} (corrupted or changed after "
                        f"preparation); prepare the data again: {prepare_again_command(meta)}"
                    )
                hashed.append(shard.file)
                entry = {**keys[shard.file], "sha256": sha256, "max_id": top}
            entries[shard.file] = entry
            if entry["max_id"] >= meta.vocab_size:
                raise token_range_error(meta, shard.file, entry["max_id"])
    finally:
        pool.shutdown(cancel_futures=True)
        if hashed:
            _write_cache(files, {**remembered, **entries})
    return Verification(tuple(hashed), tuple(s.file for s in shards if s.file not in scans))


def _ids(value: Any) -> set[int]:
    """A config's special token id (an int, a list of ints, or None) as a set."""
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple):
        return {v for v in value if isinstance(v, int)}
    return set()


def check_model_vocabulary(meta: DataMeta, config: Any, model: str) -> None:
    """The data's special tokens must be those of the transformers ``config`` of ``model``:
    its end-of-document id the model's EOS and its BOS (when documents carry one) the model's
    BOS, where the config names them. DataError, one line. (That the data's vocabulary fits
    the model's embedding, which may be padded past the tokenizer's, as Pythia's 50,304 rows
    for 50,277 tokens, is :func:`srtrain.models.resolve_model_config`'s check.)"""
    again = (
        f"prepare the data with the model's tokenizer: python -m srtrain.data prepare "
        f"--tokenizer {model} --source ... --out ..."
    )
    eos = _ids(getattr(config, "eos_token_id", None))
    if eos and meta.eos_id not in eos:
        raise DataError(
            f"{meta.data_dir} ends documents with token {meta.eos_id}, model.init_from {model} "
            f"has eos_token_id {sorted(eos)[0] if len(eos) == 1 else sorted(eos)}: another "
            f"tokenizer; {again}"
        )
    bos = _ids(getattr(config, "bos_token_id", None))
    if meta.tokenizer.add_bos and bos and meta.bos_id not in bos:
        raise DataError(
            f"{meta.data_dir} starts documents with token {meta.bos_id}, model.init_from "
            f"{model} has bos_token_id {sorted(bos)[0]}: another tokenizer; {again}"
        )
