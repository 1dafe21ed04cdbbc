"""Loss and perplexity of a model on the validation split of prepared data directories.

    python -m srtrain.eval --checkpoint DIR | --hf DIR --data DIR [--data DIR ...]
        [--seq-len N] [--batch-size N] [--batches N]

The model is an srtrain checkpoint (a checkpoint dir, or a run dir: its latest complete
checkpoint) or a transformers directory (safetensors) of a supported model type. It is built
and sharded with FSDP2 exactly as the trainer does (one process: a world of one; under
torchrun every rank holds its shard and reads its slice of every batch), and each data dir's
loss is the trainer's own validation (:func:`srtrain.trainer.validate`): the same fixed
windows, so a checkpoint evaluated with its run's settings (the defaults) gives the
``val_loss`` its run logged at that step. A data dir whose vocabulary the model does not
hold, or whose tokenizer is not the checkpoint's, is refused in one line (exit code 2)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, PretrainedConfig

from srtrain.checkpoint import load, read_manifest, resolve_checkpoint
from srtrain.config import AUTO, ConfigError
from srtrain.data import BatchLoader, DataMeta, load_meta
from srtrain.data_check import check_model_vocabulary
from srtrain.errors import agree, exit_code
from srtrain.export import run_tokenizer
from srtrain.models import build_model_from_config, init_buffers, read_hf_config
from srtrain.parallel import DistInfo, apply_fsdp, compute_dtype, device_mesh, init_distributed
from srtrain.pretrained import load_pretrained
from srtrain.tokenizer_match import check_tokenizer, check_vocabulary

# An HF model's defaults: windows of its context length, at most this many tokens.
HF_SEQ_LEN = 2048
HF_BATCH_SIZE = 8


class EvalError(ConfigError):
    """An evaluation that cannot run as asked, described in one line."""


@dataclass(frozen=True)
class Settings:
    """How the validation windows are cut and how many are read: windows of ``seq_len``
    tokens in global batches of ``batch_size``, the first ``batches`` of them (None: all)."""

    seq_len: int
    batch_size: int
    batches: int | None


@dataclass(frozen=True)
class ModelSource:
    """The model to evaluate: its transformers config, how to fill its weights and the run's
    validation settings (a checkpoint's) or an HF model's defaults."""

    name: str
    config: PretrainedConfig
    checkpoint: Path | None  # else an HF directory
    hf_dir: Path | None
    settings: Settings
    bf16_params: bool
    compute_dtype: str
    tokenizer: list[Path] | None  # the files of the run's tokenizer (a checkpoint's copy)


@dataclass(frozen=True)
class Result:
    """One data dir's validation loss (mean cross-entropy per token) and what it covers."""

    data_dir: str
    loss: float
    batches: int
    settings: Settings

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(self.loss)


def _training_config(values: dict[str, Any]) -> PretrainedConfig:
    """A transformers config of a checkpoint manifest, set up as srtrain builds models."""
    config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def checkpoint_source(path: str | Path, overrides: dict[str, int | None]) -> ModelSource:
    """The model of a checkpoint (or a run dir's latest); its run's validation settings
    unless ``overrides`` (seq_len, batch_size, batches) gives them."""
    resolved = resolve_checkpoint(path)
    manifest = read_manifest(resolved)
    run = manifest["extra"].get("config") or {}
    train, model = run.get("train", {}), run.get("model", {})
    val_batches = train.get("val_batches") or None
    settings = Settings(
        seq_len=model.get("seq_len") or manifest["model"]["seq_len"],
        batch_size=train.get("global_batch_size") or HF_BATCH_SIZE,
        batches=val_batches,
    )
    dtypes = {entry["dtype"] for entry in manifest["params"].values()}
    tokenizer = run_tokenizer(resolved, manifest)
    return ModelSource(
        name=str(resolved),
        config=_training_config(manifest["model"]["hf_config"]),
        checkpoint=resolved,
        hf_dir=None,
        settings=_override(settings, overrides),
        bf16_params=dtypes == {"bfloat16"},
        compute_dtype=run.get("parallel", {}).get("compute_dtype", AUTO),
        tokenizer=list(tokenizer.files) if tokenizer is not None else None,
    )


def hf_source(path: str | Path, overrides: dict[str, int | None]) -> ModelSource:
    """The model of a transformers directory: windows of its context length (at most
    :data:`HF_SEQ_LEN`), batches of :data:`HF_BATCH_SIZE`, the whole split, unless
    ``overrides`` says otherwise."""
    try:
        config = read_hf_config(path)
    except ValueError as err:
        raise EvalError(f"--hf: {err}") from None
    settings = Settings(
        seq_len=min(config.max_position_embeddings, HF_SEQ_LEN),
        batch_size=HF_BATCH_SIZE,
        batches=None,
    )
    return ModelSource(
        name=str(path),
        config=config,
        checkpoint=None,
        hf_dir=Path(path),
        settings=_override(settings, overrides),
        bf16_params=False,
        compute_dtype=AUTO,
        tokenizer=None,
    )


def _override(settings: Settings, overrides: dict[str, int | None]) -> Settings:
    values = {k: v for k, v in overrides.items() if v is not None}
    for key, value in values.items():
        if value <= 0:
            raise EvalError(f"--{key.replace('_', '-')}: must be > 0, got {value}")
    return dataclasses.replace(settings, **values)


def check_data(source: ModelSource, meta: DataMeta, world_size: int) -> None:
    """Refuse (EvalError, one line) a data dir the model cannot be evaluated on: a vocabulary
    the model does not hold, special ids other than an HF model's config names (see
    :func:`srtrain.data_check.check_model_vocabulary`), a tokenizer other than that of a
    checkpoint's run, no validation window of ``seq_len`` tokens, a batch that does not
    divide over the ranks."""
    where = f"the model of {source.name}"
    try:
        check_vocabulary(meta, source.config, where)
        if source.hf_dir is not None:  # a checkpoint's config keeps its preset's ids
            check_model_vocabulary(meta, source.config, str(source.hf_dir))
        if source.tokenizer is not None:
            check_tokenizer(meta, source.tokenizer, f"the run of {source.name}")
    except ValueError as err:
        raise EvalError(str(err)) from None
    s = source.settings
    if s.seq_len > source.config.max_position_embeddings:
        raise EvalError(
            f"--seq-len {s.seq_len} is longer than {where} takes "
            f"({source.config.max_position_embeddings} positions); lower --seq-len"
        )
    tokens = meta.splits["val"].num_tokens if "val" in meta.splits else 0
    if tokens <= s.seq_len:
        raise EvalError(
            f"split 'val' of {meta.data_dir} has {tokens} tokens, not one window of "
            f"{s.seq_len + 1}; lower --seq-len or prepare it with a larger --val-fraction"
        )
    if s.batch_size % world_size:
        raise EvalError(
            f"--batch-size {s.batch_size} does not divide over the {world_size} ranks; "
            f"use a multiple of {world_size}"
        )


def load_model(source: ModelSource, info: DistInfo) -> torch.nn.Module:
    """The model sharded with FSDP2 over every rank (the trainer's setup) with its weights."""
    model = build_model_from_config(source.config)
    apply_fsdp(
        model,
        device_mesh(info),
        param_dtype=compute_dtype(source.compute_dtype, info.device),
        reduce_dtype=torch.float32,
        bf16_params=source.bf16_params,
    )
    model.to_empty(device=info.device)
    if source.checkpoint is not None:
        load(source.checkpoint, model, None)
        init_buffers(model)
    else:
        load_pretrained(model, source.hf_dir)
    return model


def evaluate(source: ModelSource, data_dirs: Sequence[str | Path], info: DistInfo) -> list[Result]:
    """Each data dir's validation loss under ``source``'s settings (every rank calls it;
    every rank gets the global results). Every data dir is checked before the model loads."""
    from srtrain.trainer import validate

    s = source.settings
    metas = agree(lambda: [load_meta(d) for d in data_dirs], info.device)
    for meta in metas:
        agree(lambda meta=meta: check_data(source, meta, info.world_size), info.device)
    model = agree(lambda: load_model(source, info), info.device)
    results = []
    for meta in metas:
        loader = BatchLoader(
            meta.data_dir, "val", s.batch_size, s.seq_len, info.rank, info.world_size
        )
        full = loader.num_windows // s.batch_size
        batches = 1 if loader.short else full if s.batches is None else min(s.batches, full)
        loss = validate(model, loader, batches, info.device)
        results.append(Result(str(meta.data_dir), loss, batches, s))
    return results


def describe(result: Result) -> str:
    """A result's console line."""
    s = result.settings
    return (
        f"{result.data_dir}: loss {result.loss:.4f}, perplexity {result.perplexity:.3f} "
        f"(val split, {result.batches} batches of {s.batch_size} × {s.seq_len} tokens)"
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: evaluate a checkpoint or an HF model on data dirs; rank 0 prints a line
    per data dir. A user's error is one ``error:`` line and exit code 2."""
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.eval",
        description="Validation loss and perplexity of a model on prepared data dirs.",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="a checkpoint dir, or a run dir (its latest one)")
    model.add_argument(
        "--hf", help="a transformers directory (safetensors): LLaMA, Mistral, Qwen2/3 or GPT-NeoX"
    )
    parser.add_argument(
        "--data", action="append", required=True, help="a prepared data dir (repeatable)"
    )
    parser.add_argument("--seq-len", type=int, help="window length (default: the run's)")
    parser.add_argument("--batch-size", type=int, help="windows per global batch")
    parser.add_argument("--batches", type=int, help="batches per data dir (default: the run's)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    args = parser.parse_args(argv)
    overrides = {"seq_len": args.seq_len, "batch_size": args.batch_size, "batches": args.batches}
    try:
        info = init_distributed(None if args.device == "auto" else args.device)
        source = agree(
            lambda: (
                checkpoint_source(args.checkpoint, overrides)
                if args.checkpoint
                else hf_source(args.hf, overrides)
            ),
            info.device,
        )
        results = evaluate(source, args.data, info)
    except Exception as err:  # exit_code re-raises bugs
        return exit_code(err)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if info.rank == 0:
        print(f"srtrain.eval: {source.name}")
        for result in results:
            print(describe(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
