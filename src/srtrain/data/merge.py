"""Joining the parts of a source prepared on several machines (``prepare --part i/N``) into
one data directory.

The parts' shards become the merged directory's shards (hard links where the filesystem allows,
else copies), part 0's first; its meta.json is written last, so the directory loads only once
it is whole; the parts are removed after.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from srtrain.console import Ticker
from srtrain.corpus import DataError
from srtrain.data.meta import (
    FORMAT_VERSION,
    META_FILE,
    SPLITS,
    DataMeta,
    ShardMeta,
    SplitMeta,
    load_meta,
)
from srtrain.data.prepare import PARTS_DIR, check_splits, part_dir, write_json

__all__ = ["merge"]

_PART_NAME = re.compile(r"(\d+)-of-(\d+)")


def _part_metas(out_dir: Path) -> list[DataMeta]:
    root = out_dir / PARTS_DIR
    found = (
        sorted(p for p in root.glob("*-of-*") if _PART_NAME.fullmatch(p.name))
        if root.is_dir()
        else []
    )
    if not found:
        raise DataError(
            f"no parts to merge in {root}; prepare them with python -m srtrain.data prepare "
            f"... --out {out_dir} --part i/N"
        )
    counts = {int(_PART_NAME.fullmatch(p.name).group(2)) for p in found}  # type: ignore[union-attr]
    if len(counts) != 1:
        raise DataError(f"{root} holds parts of different splits ({sorted(counts)} parts)")
    total = counts.pop()
    missing = [i for i in range(total) if not (part_dir(out_dir, (i, total)) / META_FILE).is_file()]
    if missing:
        raise DataError(
            f"{root} lacks finished parts {', '.join(f'{i}/{total}' for i in missing)} of "
            f"{total}; prepare them with the same command and --part i/{total}"
        )
    return [load_meta(part_dir(out_dir, (i, total))) for i in range(total)]


def _link(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def merge(out_dir: str | os.PathLike[str], progress: Ticker | None = None) -> Path:
    """Join ``out_dir``'s finished parts into the data directory ``out_dir``; DataError when
    a part is missing, the parts differ in tokenizer or settings, or ``out_dir`` is already
    prepared."""
    out_dir = Path(out_dir)
    ticker = progress if progress is not None else Ticker(None)
    if (out_dir / META_FILE).exists():
        raise DataError(f"{out_dir} is already prepared (it has {META_FILE}); nothing to merge")
    metas = _part_metas(out_dir)
    first = metas[0]
    base = {k: v for k, v in first.prepare.items() if k != "part"}
    for meta in metas[1:]:
        if meta.tokenizer.files != first.tokenizer.files or meta.dtype != first.dtype:
            raise DataError(f"{meta.data_dir} has another tokenizer than {first.data_dir}")
        if {k: v for k, v in meta.prepare.items() if k != "part"} != base:
            raise DataError(
                f"{meta.data_dir} was prepared with other settings than {first.data_dir}"
            )
    splits: dict[str, SplitMeta] = {}
    for split in SPLITS:
        shards: list[ShardMeta] = []
        for meta in metas:
            for shard in meta.splits[split].shards:
                name = f"{split}_{len(shards):05d}.bin"
                _link(meta.data_dir / shard.file, out_dir / name)
                shards.append(ShardMeta(name, shard.num_tokens, shard.sha256))
        splits[split] = SplitMeta(
            sum(s.num_tokens for s in shards),
            sum(m.splits[split].num_documents for m in metas),
            tuple(shards),
        )
    check_splits(splits, int(first.source["num_documents"]), float(base["val_fraction"]))
    for file in first.tokenizer.files:
        (out_dir / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(first.data_dir / file, out_dir / file)
    merged = DataMeta(
        data_dir=out_dir,
        format_version=FORMAT_VERSION,
        vocab_size=first.vocab_size,
        dtype=first.dtype,
        bos_id=first.bos_id,
        eos_id=first.eos_id,
        pad_id=first.pad_id,
        unk_id=first.unk_id,
        tokenizer=first.tokenizer,
        source=first.source,
        prepare={**base, "parts": len(metas)},
        splits=splits,
    )
    write_json(out_dir / META_FILE, merged.to_json())
    shutil.rmtree(out_dir / PARTS_DIR)
    ticker.always(f"data: merged {len(metas)} parts into {out_dir}")
    return out_dir
