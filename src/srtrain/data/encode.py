"""Tokenizing chunks of documents, in the calling process or in worker processes.

A chunk is a list of documents with their split; its result is each split's token stream
(every document as :meth:`Tokenizer.document` gives it) and document count. Results come back
in chunk order whatever the number of workers, and at most ``2 × workers`` chunks are in
flight, so memory stays bounded however long the source is.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np

from srtrain.data.tokenizer import Tokenizer, load_tokenizer_files

# (documents, is_val per document)
Chunk = tuple[list[str], list[bool]]
# split -> (tokens, number of documents)
Encoded = dict[str, tuple[np.ndarray, int]]

__all__ = ["Chunk", "Encoded", "encode_chunks"]

_worker: tuple[Tokenizer, str] | None = None


def encode_chunk(tokenizer: Tokenizer, dtype: str, chunk: Chunk) -> Encoded:
    """The train and val token streams of one chunk."""
    texts, val = chunk
    ids = tokenizer.encode_batch(texts)
    out: Encoded = {}
    for split, held_out in (("train", False), ("val", True)):
        docs = [tokenizer.document(d) for d, v in zip(ids, val, strict=True) if v == held_out]
        out[split] = (np.fromiter(chain.from_iterable(docs), dtype=dtype), len(docs))
    return out


def _init_worker(data_dir: str, kind: str, files: list[str], dtype: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _worker = (load_tokenizer_files(Path(data_dir), kind, files), dtype)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _worker is not None
    return encode_chunk(_worker[0], _worker[1], chunk)


def encode_chunks(
    chunks: Iterable[Chunk],
    data_dir: Path,
    kind: str,
    files: list[str],
    dtype: str,
    workers: int,
) -> Iterator[Encoded]:
    """Each chunk's result, in order; ``workers`` > 1 spreads chunks over that many worker
    processes that load the tokenizer from ``data_dir``, 1 encodes in this process."""
    if workers == 1:
        tokenizer = load_tokenizer_files(data_dir, kind, files)
        for chunk in chunks:
            yield encode_chunk(tokenizer, dtype, chunk)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(
        workers, initializer=_init_worker, initargs=(str(data_dir), kind, files, dtype)
    ) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
