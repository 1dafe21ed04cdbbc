"""Export a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer).

    python -m srtrain.export CHECKPOINT OUT [--dtype bfloat16] [--tokenizer DATA_DIR]

CHECKPOINT is a checkpoint directory or a run dir (its latest complete checkpoint). OUT holds
the weights, ``config.json``, ``generation_config.json`` and the run's tokenizer (the
checkpoint's copy; else its data dir's, or ``--tokenizer``'s) with ``tokenizer_config.json``,
and loads with ``AutoModelForCausalLM.from_pretrained(OUT)``, ``AutoTokenizer`` and
``pipeline("text-generation", model=OUT)``; the special ids of config, generation config and
tokenizer are the data's. A SentencePiece tokenizer (srtrain's own: documents without BOS)
is written as a LLaMA tokenizer that adds no BOS, a Hugging Face one (a data dir holds it as
a transformers tokenizer directory) as itself, encoding as it did for the data. OUT appears
complete or not at all; a bad checkpoint or tokenizer is one line (exit code 2). Runs in one
process, without a process group.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from safetensors.torch import save_file
from transformers import (
    CONFIG_MAPPING,
    AutoTokenizer,
    GenerationConfig,
    LlamaTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from srtrain.checkpoint import (
    TOKENIZER,
    CheckpointError,
    read_full_model,
    resolve_checkpoint,
)
from srtrain.corpus import DataError
from srtrain.data import load_meta
from srtrain.data.tokenizer import SENTENCEPIECE, SentencePieceTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS = "model.safetensors"


class ExportError(ValueError):
    """The export cannot be written, described in one line."""


SPECIAL = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer a run's data was prepared with: its files, vocabulary size and the
    special ids its documents carry (None: the data has none)."""

    kind: str  # see srtrain.data.tokenizer.KINDS
    files: tuple[Path, ...]
    ids: dict[str, int | None]
    origin: str  # where it was found, for messages

    @property
    def sentencepiece(self) -> bool:
        """Whether it is a SentencePiece model (srtrain's own kind of tokenizer)."""
        return self.kind == SENTENCEPIECE


def _from_data_dir(data_dir: str | os.PathLike[str], origin: str) -> RunTokenizer:
    meta = load_meta(data_dir)
    return RunTokenizer(
        kind=meta.tokenizer.kind,
        files=tuple(meta.tokenizer_files),
        ids={key: getattr(meta, f"{key}_id") for key in SPECIAL},
        origin=origin,
    )


def run_tokenizer(checkpoint: Path, manifest: dict[str, Any]) -> RunTokenizer | None:
    """The run's tokenizer: the checkpoint's copy, else its data dir's (where that still
    holds prepared data); None when neither has one."""
    entry = manifest.get("tokenizer")
    if isinstance(entry, dict):
        return RunTokenizer(
            kind=entry.get("kind", SENTENCEPIECE),
            files=tuple(checkpoint / f for f in entry["files"]),
            ids={key: entry.get(f"{key}_id") for key in SPECIAL},
            origin=f"checkpoint {checkpoint}",
        )
    if entry == TOKENIZER:  # an earlier version's copy: the ids are the model's own
        sp = spm.SentencePieceProcessor(model_file=str(checkpoint / TOKENIZER))
        ids = {key: getattr(sp, f"{key}_id")() for key in SPECIAL}
        return RunTokenizer(
            kind=SENTENCEPIECE,
            files=(checkpoint / TOKENIZER,),
            ids={key: value if value >= 0 else None for key, value in ids.items()},
            origin=f"checkpoint {checkpoint}",
        )
    data_dir = manifest.get("data_dir")
    if data_dir:
        try:
            return _from_data_dir(data_dir, f"data dir {data_dir}")
        except DataError:
            return None
    return None


def _token(tokenizer: PreTrainedTokenizerBase, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.convert_ids_to_tokens(token_id)


def _load_tokenizer(run: RunTokenizer, staging: Path, seq_len: int) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of the run's files with the data's special tokens; one
    made from a SentencePiece model (srtrain's own: its documents start without BOS) adds
    no BOS or EOS to an encoded text, any other encodes as it did for the data."""
    folder = staging / ".tokenizer-files"
    folder.mkdir()
    for file in run.files:
        shutil.copyfile(file, folder / file.name)
    if run.sentencepiece:
        SentencePieceTokenizer(run.files[0])  # DataError on a file that is not a model
        shutil.copyfile(run.files[0], folder / TOKENIZER)
        tokenizer = LlamaTokenizer.from_pretrained(
            folder, add_prefix_space=False, add_bos_token=False, add_eos_token=False
        )
    else:  # a data dir holds any other kind as a transformers tokenizer directory
        tokenizer = AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False
        )
    shutil.rmtree(folder)
    tokenizer.add_special_tokens(
        {
            f"{key}_token": _token(tokenizer, token_id)
            for key, token_id in run.ids.items()
            if token_id is not None
        }
    )
    tokenizer.model_max_length = seq_len
    return tokenizer


def _write_tokenizer(
    run: RunTokenizer, out: Path, seq_len: int, vocab_size: int
) -> dict[str, int | None]:
    """The run's tokenizer as a transformers tokenizer in ``out``; returns the special ids
    (``bos_token_id``, ...). ExportError when it cannot be read or holds more tokens than
    the model."""
    try:
        tokenizer = _load_tokenizer(run, out, seq_len)
    except Exception as err:  # tokenizers and transformers raise many kinds on a bad file
        detail = " ".join(str(err).split()) or type(err).__name__
        raise ExportError(
            f"the tokenizer of {run.origin} cannot be read ({detail}); pass --tokenizer "
            "DATA_DIR (the prepared data the run trained on)"
        ) from None
    size = len(tokenizer)
    if size > vocab_size:
        raise ExportError(
            f"the tokenizer of {run.origin} has {size} tokens, more than the model's "
            f"{vocab_size}: it is not the run's; pass --tokenizer DATA_DIR (the prepared "
            "data the run trained on)"
        )
    tokenizer.save_pretrained(out)
    if run.sentencepiece:
        shutil.copyfile(run.files[0], out / TOKENIZER)
    return {f"{key}_token_id": run.ids.get(key) for key in ("bos", "eos", "pad")}


def _hf_config(
    manifest: dict[str, Any], dtype: torch.dtype, token_ids: dict[str, int | None]
) -> PretrainedConfig:
    """The transformers config the run trained with, set up for inference."""
    stored = dict(manifest["model"]["hf_config"])
    model_type = stored["model_type"]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ExportError(
            f"checkpoint model_type {model_type!r} has no transformers causal-LM class"
        )
    config = CONFIG_MAPPING[model_type].from_dict(stored)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    config.use_cache = True
    config.dtype = dtype
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, token_ids.get(key))
    return config


def _save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``path`` as safetensors with the mode of a normally created file (0666 less the
    umask); safetensors itself creates it 0600."""
    path.touch()
    mode = path.stat().st_mode & 0o777
    save_file(
        {name: t.contiguous() for name, t in tensors.items()}, path, metadata={"format": "pt"}
    )
    os.chmod(path, mode)


def export(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the Hugging Face model directory ``out_dir`` (absent or empty) of a checkpoint.

    Weights keep their stored dtype unless ``dtype`` (float32, bfloat16, float16) is given.
    The tokenizer is the run's (see :func:`run_tokenizer`), or that of the prepared data dir
    ``tokenizer``; without either, ExportError. The directory appears complete or not at all.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {out} exists and is not an empty directory")
    path = resolve_checkpoint(checkpoint)
    manifest, tensors = read_full_model(path)
    if tokenizer is not None:
        try:
            run = _from_data_dir(tokenizer, f"data dir {tokenizer}")
        except DataError as err:
            raise ExportError(f"--tokenizer: {err}") from None
    else:
        run = run_tokenizer(path, manifest)
    if run is None:
        raise ExportError(
            f"checkpoint {path} holds no tokenizer and its data dir "
            f"{manifest.get('data_dir') or '(none recorded)'} none either; pass --tokenizer "
            "DATA_DIR (the prepared data the run trained on)"
        )
    if dtype is not None:
        tensors = {name: t.to(DTYPES[dtype]) for name, t in tensors.items()}
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ExportError(
            f"checkpoint {path} mixes weight dtypes {sorted(map(str, dtypes))}; pass --dtype"
        )

    staging = out.with_name(f".{out.name}.tmp-{secrets.token_hex(6)}")
    staging.mkdir(parents=True)
    try:
        model = manifest["model"]
        token_ids = _write_tokenizer(run, staging, model["seq_len"], model["vocab_size"])
        _save_weights(tensors, staging / WEIGHTS)
        _hf_config(manifest, dtypes.pop(), token_ids).save_pretrained(staging)
        GenerationConfig(**token_ids).save_pretrained(staging)
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: export CHECKPOINT to OUT."""
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.export",
        description="Write a Hugging Face model directory from an srtrain checkpoint.",
    )
    parser.add_argument("checkpoint", help="a checkpoint dir, or a run dir (its latest one)")
    parser.add_argument("out", help="output directory (absent or empty)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast the weights (default: as stored)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DATA_DIR",
        help="write this prepared data dir's tokenizer (default: the checkpoint's)",
    )
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.dtype, args.tokenizer)
    except (CheckpointError, ExportError) as e:
        parser.exit(2, f"error: {e}\n")
    print(f"srtrain.export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
