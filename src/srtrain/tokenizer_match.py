"""Whether prepared token data fits a model: its vocabulary and its tokenizer's files.

Every check raises ValueError with one line that names the data dir, what differs and how to
prepare the data so it fits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from transformers import PretrainedConfig

from srtrain.data import DataMeta

_CHUNK = 1 << 22


def tokenizer_digest(files: Sequence[Path]) -> str:
    """sha256 over the contents of a tokenizer's files, in the order of their names."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda f: f.name):
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(_CHUNK), b""):
                digest.update(block)
    return digest.hexdigest()


def check_vocabulary(meta: DataMeta, config: PretrainedConfig, model: str) -> None:
    """The data's token ids must be rows of the model's embedding (a model's vocabulary may
    be padded beyond the tokenizer's). ``model``: how the model is named in the message."""
    if meta.vocab_size > config.vocab_size:
        raise ValueError(
            f"{meta.data_dir} has a vocabulary of {meta.vocab_size} tokens, more than the "
            f"{config.vocab_size} of {model}; prepare it with the model's tokenizer "
            f"(python -m srtrain.data prepare --tokenizer ...)"
        )


def check_tokenizer(meta: DataMeta, files: Sequence[Path], owner: str) -> None:
    """The data must have been tokenized by the tokenizer of ``files`` (``owner``'s)."""
    if tokenizer_digest(meta.tokenizer_files) != tokenizer_digest(files):
        path = files[0] if len(files) == 1 else Path(files[0]).parent  # a file, or a directory
        raise ValueError(
            f"{meta.data_dir} was tokenized with another tokenizer than {owner}; prepare it "
            f"with that tokenizer (python -m srtrain.data prepare --tokenizer {path} ...)"
        )
