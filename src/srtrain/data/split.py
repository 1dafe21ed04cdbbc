"""Which documents are held out for validation, and which train the tokenizer, decided one
document at a time from the document's index in the source and the seed alone.

Validation: the documents at positions ``p_k = floor((k + u_k) / f)`` for k = 0, 1, ...
(``f`` the validation fraction, ``u_k`` seeded uniform draws; ``p_0`` lies in the first
``min(2, 1/f)`` documents, so two documents always give one to each side at f = 0.5): one
document drawn from every stretch of ``1/f``. After n documents, ``floor(n·f)`` or one more are
held out, spread evenly over the source, without knowing its length in advance.

Tokenizer sample: the train documents with the smallest seeded keys whose text fits a byte
budget (all of them when they fit), in source order.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

__all__ = ["TokenizerSample", "ValSelector"]


class ValSelector:
    """``is_val(index)`` for indices 0, 1, 2, ... asked in increasing order."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction = fraction
        self._rng = np.random.default_rng([seed, 2])
        self._k = 0
        self._next = self._position(-1) if fraction > 0 else math.inf

    def _position(self, previous: float) -> float:
        u = float(self._rng.random())
        f = self.fraction
        position = math.floor(u * min(2.0, 1 / f)) if self._k == 0 else (self._k + u) / f
        self._k += 1
        return max(previous + 1, math.floor(position))

    def is_val(self, index: int) -> bool:
        """Whether document ``index`` is held out (indices asked in increasing order)."""
        if index < self._next:
            return False
        while self._next < index:
            self._next = self._position(self._next)
        if index == self._next:
            self._next = self._position(self._next)
            return True
        return False


class TokenizerSample:
    """The train documents that train a tokenizer: a seeded sample of at most ``budget``
    bytes of text (all documents when they fit), kept in memory in source order."""

    def __init__(self, budget: int, seed: int) -> None:
        self.budget = budget
        self._rng = np.random.default_rng([seed, 1])
        self._heap: list[tuple[float, int, str, int]] = []  # (-key, index, text, bytes)
        self.bytes = 0
        self.seen_bytes = 0
        self.seen_documents = 0

    def offer(self, index: int, text: str) -> None:
        """Consider train document ``index``."""
        size = len(text.encode("utf-8"))
        key = float(self._rng.random())
        self.seen_bytes += size
        self.seen_documents += 1
        heapq.heappush(self._heap, (-key, index, text, size))
        self.bytes += size
        while self.bytes > self.budget and len(self._heap) > 1:
            self.bytes -= heapq.heappop(self._heap)[3]

    def documents(self) -> list[str]:
        """The sampled documents, in source order."""
        return [text for _, _, text, _ in sorted(self._heap, key=lambda item: item[1])]

    def __len__(self) -> int:
        return len(self._heap)
