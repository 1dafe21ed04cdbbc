"""Extra validation sets of a run (``train.val_sets``): prepared data dirs whose validation
split is evaluated beside the run's own at every ``train.val_interval``, checked before
step 1 and logged as ``loss/val/<name>`` (TensorBoard) and ``val_loss/<name>``
(metrics.jsonl)."""

from __future__ import annotations

from srtrain.config import Config, ConfigError, named_val_sets
from srtrain.data import DataMeta, load_meta
from srtrain.data_check import verify_data
from srtrain.metrics import TAG_VAL_LOSS
from srtrain.tokenizer_match import check_tokenizer

RECORD_KEY = "val_loss"  # metrics.jsonl key of the run's own validation loss


def tag(name: str) -> str:
    """The TensorBoard tag of a val set's loss."""
    return f"{TAG_VAL_LOSS}/{name}"


def record_key(name: str) -> str:
    """The metrics.jsonl key of a val set's loss."""
    return f"{RECORD_KEY}/{name}"


def check_val_sets(cfg: Config, data: DataMeta, verify: bool) -> dict[str, DataMeta]:
    """Each val set's prepared data by name, checked (ConfigError, one line naming the set):
    it exists and is prepared, its shards are intact (``verify``: hash them, or trust a
    remembered pass; see :func:`srtrain.data_check.verify_data`), it was tokenized with the
    run's tokenizer (``data``'s), and its val split holds a window of ``model.seq_len``."""
    sets = {}
    for name, path in named_val_sets(cfg.train).items():
        where = f"train.val_sets: {name}"
        try:
            meta = load_meta(path)
            if verify:
                verify_data(meta, fallback_dir=cfg.train.run_dir)
            check_tokenizer(meta, data.tokenizer_files, f"the run's data {data.data_dir}")
        except ValueError as err:  # DataError too
            raise ConfigError(f"{where}: {err}") from None
        tokens = meta.splits["val"].num_tokens if "val" in meta.splits else 0
        if tokens <= cfg.model.seq_len:
            raise ConfigError(
                f"{where}: split 'val' of {path} has {tokens} tokens, not one window of "
                f"model.seq_len={cfg.model.seq_len} (it needs {cfg.model.seq_len + 1}); "
                "prepare it again with a larger --val-fraction"
            )
        sets[name] = meta
    return sets
