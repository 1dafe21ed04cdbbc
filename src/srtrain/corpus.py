"""Text sources for data preparation: the embedded stdlib corpus, the installed packages'
sources and documentation, local files, Hub datasets."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

BUILTIN = "builtin"
PACKAGES = "packages"
# The packages corpus: source and documentation files of the installed Python packages.
PACKAGE_SUFFIXES = {".py", ".pyi", ".rst", ".md", ".txt"}
PACKAGE_DOC_CHARS = (200, 2_000_000)  # shorter or longer files are skipped
# Cap on the embedded corpus; the whole CPython 3.11 stdlib (without tests) is about 12 MB.
BUILTIN_MAX_BYTES = 16_000_000
# File suffix -> `datasets` builder that reads it.
LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Compressions a .txt, .json or .jsonl source may carry (file.jsonl.gz), read as a stream.
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
ALLOWED_FILES = (
    f"{', '.join(LOCAL_BUILDERS)} (.txt, .json and .jsonl also compressed: "
    f"{', '.join(COMPRESSIONS)})"
)
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


class DataError(ValueError):
    """A data source, prepared data directory or loader argument that cannot be used."""


@dataclass(frozen=True)
class Corpus:
    """A description of where the text comes from, and its documents in a fixed order."""

    description: dict[str, Any]
    documents: Iterator[str]


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted by relative path, without tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_documents() -> Iterator[str]:
    for path in stdlib_files():
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _package_documents(root: Path) -> Iterator[str]:
    """Each distinct source or documentation file under ``root`` once, in sorted path order."""
    seen: set[bytes] = set()
    shortest, longest = PACKAGE_DOC_CHARS
    for path in sorted(p for p in root.rglob("*") if p.suffix in PACKAGE_SUFFIXES):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if not shortest <= len(text) <= longest or digest in seen:
            continue
        seen.add(digest)
        yield text


def local_builder(path: Path) -> str | None:
    """The ``datasets`` builder that reads a local source file, by its suffix (a compressed
    file by the suffix before its compression's), or None for a file no builder reads."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        base = suffixes[-2] if len(suffixes) > 1 else ""
        return None if base == ".parquet" else LOCAL_BUILDERS.get(base)
    return LOCAL_BUILDERS.get(path.suffix)


def _local_files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(
                (p for p in path.rglob("*") if p.is_file() and local_builder(p)),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            if not found:
                raise DataError(f"source directory {path} holds no {ALLOWED_FILES} files")
            files += found
        elif not local_builder(path):
            suffix = "".join(path.suffixes[-2:]) or "no suffix"
            raise DataError(f"source file {path} has {suffix!r}; allowed: {ALLOWED_FILES}")
        else:
            files.append(path)
    if any(p.suffix == ".zst" for p in files) and importlib.util.find_spec("zstandard") is None:
        raise DataError(
            "reading .zst source files needs the zstandard package: pip install zstandard"
        )
    return files


def _rows_text(rows: Iterable[dict[str, Any]], text_field: str, where: str) -> Iterator[str]:
    for row in rows:
        if text_field not in row:
            raise DataError(
                f"text field {text_field!r} not in {where}; columns: {sorted(row)} "
                "(choose one with --text-field)"
            )
        text = row[text_field]
        if isinstance(text, str) and text:
            yield text


def _local_documents(files: list[Path], text_field: str) -> Iterator[str]:
    import datasets

    for builder, group in groupby(files, key=local_builder):
        data_files = [str(p) for p in group]
        # One document per .txt file, so its newlines survive.
        extra = {"sample_by": "document"} if builder == "text" else {}
        rows = datasets.load_dataset(
            builder, data_files=data_files, split="train", streaming=True, **extra
        )
        yield from _rows_text(rows, text_field, ", ".join(data_files))


def _hub_documents(name: str, config: str | None, text_field: str) -> Iterator[str]:
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split="train", streaming=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot load Hugging Face dataset {name!r}: {first_line}") from e
    yield from _rows_text(rows, text_field, f"dataset {name!r}")


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", ".", "~")) or local_builder(Path(text)) is not None


def open_corpus(source: Source, text_field: str = "text") -> Corpus:
    """Resolve `source` ('builtin', 'packages', local files/dirs, or a Hub name[:config])."""
    items = [source] if isinstance(source, str | os.PathLike) else list(source)
    if not items:
        raise DataError("no source given; use 'builtin', local files/dirs or a Hub dataset name")
    names = [os.fspath(s) for s in items]
    if names == [BUILTIN]:
        root = sysconfig.get_paths()["stdlib"]
        description = {
            "kind": BUILTIN,
            "name": "python-stdlib",
            "python": platform.python_version(),
            "root": root,
        }
        return Corpus(description, _stdlib_documents())
    if names == [PACKAGES]:
        root = Path(sysconfig.get_paths()["purelib"])
        description = {"kind": PACKAGES, "name": "python-packages", "root": str(root)}
        return Corpus(description, _package_documents(root))
    paths = [Path(n).expanduser() for n in names]
    if all(p.exists() for p in paths):
        files = _local_files(paths)
        description = {"kind": "files", "paths": [str(p.resolve()) for p in files]}
        return Corpus(description, _local_documents(files, text_field))
    for name, path in zip(names, paths, strict=True):
        if not path.exists() and (len(names) > 1 or _looks_like_path(name)):
            raise DataError(
                f"source file {path} not found; a source is 'builtin', 'packages', existing "
                f"{ALLOWED_FILES} files or dirs, or a Hugging Face dataset name"
            )
    name, _, config = names[0].partition(":")
    description = {"kind": "hub", "name": name, "config": config or None}
    return Corpus(description, _hub_documents(name, config or None, text_field))


def cap_bytes(documents: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """The documents until their UTF-8 size reaches max_bytes; the last one is cut to fit."""
    if max_bytes is None:
        yield from documents
        return
    left = max_bytes
    for doc in documents:
        if left <= 0:
            return
        raw = doc.encode("utf-8")
        if len(raw) > left:
            doc = raw[:left].decode("utf-8", errors="ignore")
        left -= len(raw)
        if doc:
            yield doc
