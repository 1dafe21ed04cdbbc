"""Reading prepared token data: the memory-mapped token stream of a split and the
deterministic, resumable batch loader."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from srtrain.corpus import DataError
from srtrain.data.meta import load_meta, token_range_error

if TYPE_CHECKING:  # torch is imported where batches are made: preparing data never needs it
    import torch

# Validation windows come in one fixed order for every run, whatever its seed.
VAL_ORDER_SEED = 20240917
# Label of a padding row's tokens: cross_entropy's default ignore_index, left out of the loss.
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "BatchLoader", "TokenData"]


def positive(name: str, value: int) -> None:
    """DataError unless ``value`` is a positive integer."""
    if not isinstance(value, int) or value <= 0:
        raise DataError(f"{name}={value!r} must be a positive integer")


def non_negative(name: str, value: int) -> None:
    """DataError unless ``value`` is a non-negative integer."""
    if not isinstance(value, int) or value < 0:
        raise DataError(f"{name}={value!r} must be a non-negative integer")


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
        positive("global_batch_size", global_batch_size)
        positive("seq_len", seq_len)
        positive("world_size", world_size)
        non_negative("seed", seed)
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
        import torch

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
        import torch

        inputs = torch.zeros(rows, self.seq_len, dtype=torch.int64)
        labels = torch.full((rows, self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        if windows:
            x, y = self._batch(windows)
            inputs[: len(windows)], labels[: len(windows)] = x, y
        return inputs, labels
