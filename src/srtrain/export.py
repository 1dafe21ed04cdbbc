"""Export a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer).

    python -m srtrain.export CHECKPOINT OUT [--dtype bfloat16]

CHECKPOINT is a checkpoint directory or a run dir (its latest complete checkpoint). OUT
then loads with ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``. Runs in one process, without a process group.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING, LlamaTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from srtrain.checkpoint import TOKENIZER, CheckpointError, read_full_model, resolve_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS = "model.safetensors"


class ExportError(ValueError):
    """The export cannot be written, described in one line."""


def _tokenizer_file(checkpoint: Path, manifest: dict[str, Any]) -> Path | None:
    """The run's SentencePiece model: the checkpoint's copy, else the data dir's."""
    if manifest.get("tokenizer"):
        return checkpoint / manifest["tokenizer"]
    if manifest.get("data_dir") and (Path(manifest["data_dir"]) / TOKENIZER).is_file():
        return Path(manifest["data_dir"]) / TOKENIZER
    return None


def _write_tokenizer(model_file: Path, out: Path, seq_len: int) -> dict[str, int | None]:
    """A transformers tokenizer (no BOS added, like the training data) and the SentencePiece
    model in ``out``; returns its special token ids."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    ids = {
        "bos_token_id": sp.bos_id(),
        "eos_token_id": sp.eos_id(),
        "pad_token_id": sp.pad_id(),
        "unk_token_id": sp.unk_id(),
    }
    ids = {key: (value if value >= 0 else None) for key, value in ids.items()}
    pieces = {
        key.removesuffix("_id"): sp.id_to_piece(value)
        for key, value in ids.items()
        if value is not None
    }
    shutil.copyfile(model_file, out / TOKENIZER)
    tokenizer = LlamaTokenizer.from_pretrained(
        out,
        add_prefix_space=False,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=seq_len,
        **pieces,
    )
    tokenizer.save_pretrained(out)
    return ids


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
    checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str | None = None
) -> Path:
    """Write the Hugging Face model directory ``out_dir`` (absent or empty) of a checkpoint.

    Weights keep their stored dtype unless ``dtype`` (float32, bfloat16, float16) is given.
    The directory appears complete or not at all.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"output {out} exists and is not an empty directory")
    path = resolve_checkpoint(checkpoint)
    manifest, tensors = read_full_model(path)
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
        tokenizer = _tokenizer_file(path, manifest)
        token_ids = (
            _write_tokenizer(tokenizer, staging, manifest["model"]["seq_len"])
            if tokenizer is not None
            else {}
        )
        _save_weights(tensors, staging / WEIGHTS)
        _hf_config(manifest, dtypes.pop(), token_ids).save_pretrained(staging)
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
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.dtype)
    except (CheckpointError, ExportError) as e:
        parser.exit(2, f"srtrain.export: error: {e}\n")
    print(f"srtrain.export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
