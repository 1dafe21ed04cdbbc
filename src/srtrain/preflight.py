"""What a run does and checks before its first step: its token data prepared and verified
on every node, and the checks that would otherwise stop it only at a validation, a save or
its end."""

from __future__ import annotations

from pathlib import Path

from srtrain.checkpoint import checkpoint_step, latest, resolve_checkpoint
from srtrain.config import Config, ConfigError, data_source
from srtrain.console import Ticker, print_line
from srtrain.data import META_FILE, DataMeta, ensure_prepared, load_meta
from srtrain.data_check import check_model_vocabulary, verify_data
from srtrain.errors import agree
from srtrain.models import read_hf_config
from srtrain.parallel import DistInfo


def prepare_data(cfg: Config, info: DistInfo) -> DataMeta:
    """Token data on every node: local rank 0 prepares it if missing (printing its progress)
    and verifies its shards, the others wait (a failure on any rank raises on every rank).

    A prepared dir is used as it is: a differing max_bytes, val_fraction or source is one
    notice line from rank 0, a differing ``data.vocab_size`` is refused (without it the dir's
    vocabulary is taken). A missing dir is prepared only from the source
    :func:`~srtrain.config.data_source` names; with none, ConfigError.
    """
    source = data_source(cfg.data)
    kwargs = dict(val_fraction=cfg.data.val_fraction)
    for key in ("vocab_size", "max_bytes"):
        if getattr(cfg.data, key) is not None:
            kwargs[key] = getattr(cfg.data, key)

    def prepare_and_verify() -> None:
        if info.local_rank == 0:
            path = Path(cfg.data.dir)
            if not source and not (path / META_FILE).is_file():
                state = (
                    "does not exist"
                    if not path.exists()
                    else f"has no {META_FILE} (not a prepared data dir, or its preparation "
                    "did not finish)"
                )
                raise ConfigError(
                    f"data.dir {cfg.data.dir} {state}; set data.source to prepare it there "
                    "(builtin, packages, a Hugging Face dataset or files), or fix the path"
                )
            ensure_prepared(
                cfg.data.dir,
                source,
                progress=Ticker(print_line),
                notice=print_line if info.is_main else None,
                **kwargs,
            )
            verify_data(load_meta(cfg.data.dir), fallback_dir=cfg.train.run_dir)

    agree(prepare_and_verify, info.device)
    return agree(lambda: load_meta(cfg.data.dir), info.device)


def validating(cfg: Config) -> bool:
    """Whether the run validates (``train.val_interval`` and ``train.val_batches`` both set)."""
    return bool(cfg.train.val_interval and cfg.train.val_batches)


def check_before_training(cfg: Config, meta: DataMeta) -> None:
    """What could otherwise stop a run only at a validation, a save or its end, checked
    before it starts (ConfigError, one line): every split it reads holds a window of
    ``model.seq_len`` tokens, the data's tokenizer fits ``model.init_from`` (DataError),
    and a ``checkpoint.load`` that seeds the run (before its first checkpoint of its own)
    leaves steps to train."""
    if cfg.model.init_from:
        try:
            config = read_hf_config(cfg.model.init_from)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from None
        check_model_vocabulary(meta, config, cfg.model.init_from)
    seq_len = cfg.model.seq_len
    for split in ("train", "val") if validating(cfg) else ("train",):
        tokens = meta.splits[split].num_tokens if split in meta.splits else 0
        if tokens > seq_len:
            continue
        fix = (
            "lower model.seq_len, prepare the data again with a larger data.val_fraction "
            f"(delete {cfg.data.dir} or choose another data.dir), or set train.val_interval=0"
            if split == "val"
            else "lower model.seq_len or prepare more text (data.max_bytes)"
        )
        raise ConfigError(
            f"split {split!r} of {cfg.data.dir} has {tokens} tokens, not one window of "
            f"model.seq_len={seq_len} (it needs {seq_len + 1}); {fix}"
        )
    own = cfg.checkpoint.enabled and latest(cfg.train.run_dir) is not None
    if cfg.checkpoint.load and not own:  # it seeds the run (see srtrain.resume)
        path = resolve_checkpoint(cfg.checkpoint.load)
        step = checkpoint_step(path)
        if step >= cfg.train.steps:
            raise ConfigError(
                f"checkpoint.load: {path} is at step {step}, which leaves nothing of "
                f"train.steps={cfg.train.steps} to train; set train.steps above {step}"
            )
