"""Writing one split's token stream into shard files, with a state that a resumed
preparation continues from."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from srtrain.console import Ticker
from srtrain.data.meta import ShardMeta, SplitMeta

__all__ = ["SplitWriter"]


class SplitWriter:
    """Appends one split's tokens to shard files ``{split}_{n:05d}.bin`` of at most
    ``shard_tokens`` tokens each; ``state()`` after ``sync()`` is what ``resume`` needs."""

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

    def _name(self) -> str:
        return f"{self.split}_{len(self.shards):05d}.bin"

    def resume(self, state: dict[str, Any]) -> None:
        """Continue from ``state()``: closed shards kept, the open one cut back to the tokens
        the state counts, any later file removed."""
        self.num_documents = int(state["num_documents"])
        self.shards = [ShardMeta(**s) for s in state["shards"]]
        self._count = int(state["open_tokens"])
        itemsize = np.dtype(self.dtype).itemsize
        path = self.directory / self._name()
        if self._count:
            with path.open("r+b") as f:
                f.truncate(self._count * itemsize)
            self._digest = hashlib.sha256(path.read_bytes())
            self._file = path.open("ab")
        for stale in self.directory.glob(f"{self.split}_*.bin"):
            if stale.name > path.name or (stale.name == path.name and not self._count):
                stale.unlink()

    def write(self, tokens: np.ndarray, num_documents: int) -> None:
        """Append ``num_documents`` documents' tokens (EOS included)."""
        self.num_documents += num_documents
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._file = (self.directory / self._name()).open("wb")
            chunk = tokens[: self.shard_tokens - self._count]
            data = chunk.tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._count += chunk.size
            tokens = tokens[chunk.size :]
            if self._count == self.shard_tokens:
                self._close_shard()

    def sync(self) -> None:
        """Put the open shard's bytes on disk."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def state(self) -> dict[str, Any]:
        """What :meth:`resume` continues from (after :meth:`sync`)."""
        return {
            "num_documents": self.num_documents,
            "shards": [vars(s) for s in self.shards],
            "open_tokens": self._count,
        }

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
