"""Token data: prepare text into token shards with any SentencePiece or Hugging Face
tokenizer, and read them in batches.

- :mod:`srtrain.data.tokenizer`: the one tokenizer interface (``load_tokenizer``).
- :mod:`srtrain.data.prepare`: streaming, parallel, resumable preparation; ``--part``.
- :mod:`srtrain.data.merge`: joins the parts into one data dir.
- :mod:`srtrain.data.meta`: meta.json (``DataMeta``, ``load_meta``).
- :mod:`srtrain.data.loader`: ``TokenData`` and the deterministic ``BatchLoader``.
"""

from srtrain.corpus import DataError
from srtrain.data.cli import main
from srtrain.data.loader import IGNORE_INDEX, BatchLoader, TokenData
from srtrain.data.merge import merge
from srtrain.data.meta import (
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    FORMAT_VERSION,
    META_FILE,
    SHARD_TOKENS,
    SPLITS,
    TOKENIZER_FILE,
    TOKENIZER_SAMPLE_BYTES,
    DataMeta,
    ShardMeta,
    SplitMeta,
    TokenizerMeta,
    load_meta,
    load_tokenizer,
    prepare_again_command,
    token_range_error,
)
from srtrain.data.prepare import TOKEN_SETTINGS, ensure_prepared, prepare, usable_cpus
from srtrain.data.tokenizer import Tokenizer, open_tokenizer

__all__ = [
    "DEFAULT_VAL_FRACTION",
    "DEFAULT_VOCAB_SIZE",
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "META_FILE",
    "SHARD_TOKENS",
    "SPLITS",
    "TOKENIZER_FILE",
    "TOKENIZER_SAMPLE_BYTES",
    "TOKEN_SETTINGS",
    "BatchLoader",
    "DataError",
    "DataMeta",
    "ShardMeta",
    "SplitMeta",
    "TokenData",
    "Tokenizer",
    "TokenizerMeta",
    "ensure_prepared",
    "load_meta",
    "load_tokenizer",
    "main",
    "merge",
    "open_tokenizer",
    "prepare",
    "prepare_again_command",
    "token_range_error",
    "usable_cpus",
]
