"""Tokenizing chunks of documents, in the calling process or in worker processes.

A chunk is a list of documents with their split; its result is each split's token stream
(every document as BOS where the tokenizer adds one, its ids, EOS) and document count. Worker
processes rebuild the tokenizer from :meth:`Tokenizer.encoder_spec` (a fast tokenizer's
``tokenizers`` backend, without transformers) and use one core each. Results come back
in chunk order whatever the number of workers, and at most ``2 × workers`` chunks are in
flight, so memory stays bounded however long the source is.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain

import numpy as np

from srtrain.data.tokenizer import Tokenizer, encoder

# (documents, is_val per document)
Chunk = tuple[list[str], list[bool]]
# split -> (tokens, number of documents)
Encoded = dict[str, tuple[np.ndarray, int]]

__all__ = ["Chunk", "Encoded", "encode_chunks"]

# Text per encode call: bounds the memory of a fast tokenizer's Encoding objects.
BATCH_BYTES = 1_000_000
Encode = Callable[[Sequence[str]], list[list[int]]]
# (encode, BOS or None, EOS, dtype) of a worker process
_worker: tuple[Encode, int | None, int, str] | None = None


def _batches(texts: list[str]) -> Iterator[slice]:
    """Consecutive slices of ``texts`` of about BATCH_BYTES characters each."""
    start, size = 0, 0
    for end, text in enumerate(texts, 1):
        size += len(text)
        if size >= BATCH_BYTES:
            yield slice(start, end)
            start, size = end, 0
    if start < len(texts):
        yield slice(start, len(texts))


def encode_chunk(encode: Encode, bos: int | None, eos: int, dtype: str, chunk: Chunk) -> Encoded:
    """The train and val token streams of one chunk: each document as BOS (unless None),
    its ids, EOS. Ids become arrays batch by batch, so Python lists of ids never hold more
    than a batch."""
    texts, val = chunk
    head = [bos] if bos is not None else []
    pieces: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    counts = {"train": 0, "val": 0}
    for part in _batches(texts):
        ids = encode(texts[part])
        for split, held_out in (("train", False), ("val", True)):
            docs = [d for d, v in zip(ids, val[part], strict=True) if v == held_out]
            stream = chain.from_iterable(chain(head, d, (eos,)) for d in docs)
            pieces[split].append(np.fromiter(stream, dtype=dtype))
            counts[split] += len(docs)
    return {
        split: (np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype), counts[split])
        for split, arrays in pieces.items()
    }


def _init_worker(spec: tuple[str, str], bos: int | None, eos: int, dtype: str) -> None:
    global _worker
    _worker = (encoder(spec), bos, eos, dtype)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    assert _worker is not None
    return encode_chunk(*_worker, chunk)


def encode_chunks(
    chunks: Iterable[Chunk], tokenizer: Tokenizer, dtype: str, workers: int
) -> Iterator[Encoded]:
    """Each chunk's result, in order; ``workers`` > 1 spreads chunks over that many worker
    processes (one core each), 1 encodes in this process."""
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    if workers == 1:
        for chunk in chunks:
            yield encode_chunk(tokenizer.encode_batch, bos, tokenizer.eos_id, dtype, chunk)
        return
    context = multiprocessing.get_context("spawn")
    initargs = (tokenizer.encoder_spec(), bos, tokenizer.eos_id, dtype)
    with context.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
