"""Counter-based normal samples: a value per (seed, name, global element index), nothing else.

Element ``i`` of a named tensor takes two 32-bit uniforms, one from each of two keys of
the rounding draws (:func:`~srtrain.numerics.rounding.rng_key` at step 0, the name's
32-bit SHA-256 digest as stream, states :data:`STATE_RADIUS` and :data:`STATE_ANGLE`),
each hashed once more under its key's second word: ``mix32(draw(key, i) ^ key[1])``.
(With one round, the draws of two keys are the same function of the index up to an XOR
of the index, so the two uniforms of one element would recur, swapped, at another; the
second round, keyed per state, breaks that relation.) Box–Muller turns the top 24 bits
of each into ``z = sqrt(-2 ln u1)·cos(2π·u2)`` with ``u1`` in (0, 1] (never log 0) and
``u2`` in [0, 1), so ``|z| <= sqrt(48 ln 2) ≈ 5.77``.

Every step is an elementwise torch op (integer hashing, then float32 arithmetic), so any
slice of indices gets bitwise the values the whole tensor holds there (on one device
type), whatever the slice's start, length or chunking. :func:`fill_normal_` writes a
shard in chunks of at most :data:`CHUNK` elements, so its scratch memory does not grow
with the shard.
"""

from __future__ import annotations

import hashlib
import math

import torch

from srtrain.numerics.rounding import MASK32, global_index, mix32, rng_key, span_key

# Key states of the two uniforms; distinct from the optimizer's rounding states.
STATE_RADIUS = 4
STATE_ANGLE = 5
# Elements generated at once: bounds the scratch memory (about 40 bytes an element).
CHUNK = 1 << 22

NormalKeys = tuple[tuple[int, int], tuple[int, int]]


def normal_keys(seed: int, name: str) -> NormalKeys:
    """The keys of the radius and angle uniforms of tensor ``name`` under ``seed`` (>= 0)."""
    stream = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return rng_key(seed, 0, stream, STATE_RADIUS), rng_key(seed, 0, stream, STATE_ANGLE)


def _uniform24(key: tuple[int, int], hi: int, low: torch.Tensor) -> torch.Tensor:
    """24-bit uniform integers (int64) of the global indices ``hi·2**32 + low`` under one key:
    the top bits of ``mix32(draw(key, index) ^ key[1])``, with the draw's span word
    (:func:`~srtrain.numerics.rounding.span_key`) hashed once for the whole span."""
    return mix32(mix32(low ^ span_key(key, hi)) ^ key[1]) >> 8


def _span_normal(
    keys: NormalKeys, offset: int, numel: int, device: torch.device | str
) -> torch.Tensor:
    """N(0, 1) samples (float32, 1-D) of global indices ``offset .. offset+numel-1``, all
    sharing one high word."""
    hi = offset >> 32
    low = global_index(offset & MASK32, numel, device)
    u1 = (_uniform24(keys[0], hi, low) + 1).to(torch.float32).mul_(2.0**-24)
    angle = _uniform24(keys[1], hi, low).to(torch.float32).mul_(2.0 * math.pi * 2.0**-24)
    return u1.log_().mul_(-2.0).sqrt_().mul_(angle.cos_())


@torch.no_grad()
def fill_normal_(
    flat: torch.Tensor, keys: NormalKeys, offset: int, std: float, chunk: int = CHUNK
) -> torch.Tensor:
    """Write ``std·z(offset + j)`` into ``flat[j]`` (a 1-D tensor of any float dtype) in
    place, at most ``chunk`` elements at a time; the value is formed in float32 and then
    rounded to ``flat``'s dtype. Returns ``flat``."""
    if flat.ndim != 1:
        raise ValueError(f"fill_normal_ writes a 1-D tensor, got shape {tuple(flat.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
    start = 0
    while start < flat.numel():
        index = offset + start
        stop = start + min(chunk, flat.numel() - start, (((index >> 32) + 1) << 32) - index)
        values = _span_normal(keys, index, stop - start, flat.device)
        flat[start:stop].copy_(values.mul_(std))
        start = stop
    return flat
