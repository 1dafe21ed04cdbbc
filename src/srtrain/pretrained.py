"""Start from pretrained weights: a transformers LLaMA, Mistral, Qwen2/3 or GPT-NeoX
directory (``config.json`` and safetensors weights, one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``) read into a model whose parameters may be FSDP2
DTensors.

Each rank reads only the rows of its own shard of every parameter (its local shape and global
offset under the parameter's placements: Shard(0) on a 1-D mesh, (Replicate(), Shard(0)) on a
2-D HSDP mesh); plain tensors are read whole. Values are cast to the parameter's dtype (an FP32
file into FP32 parameters is copied bit for bit).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from srtrain.config import ConfigError
from srtrain.models import init_buffers

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Names a tensor has in checkpoints written by other transformers versions.
_LEGACY_NAMES = {"lm_head.weight": "embed_out.weight"}
# Buffers that older checkpoints stored; the model recomputes them.
_STALE_BUFFERS = re.compile(r"(^|\.)(inv_freq|masked_bias|attention\.bias)$")
_LISTED = 4  # tensor names quoted in an error, before "and N more"
_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors dtypes a weight is read from


class PretrainedError(ConfigError):
    """Pretrained weights that cannot be loaded into the model, described in one line."""


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _checked_dir(hf_dir: str | os.PathLike[str]) -> Path:
    path = Path(hf_dir)
    if not path.is_dir():
        raise PretrainedError(f"pretrained model directory {path} does not exist")
    if not (path / CONFIG_FILE).is_file():
        raise PretrainedError(
            f"{path / CONFIG_FILE} not found: a transformers model directory "
            "holds config.json and safetensors weights"
        )
    return path


def _open(file: Path, stack: ExitStack) -> Any:
    """``file`` opened with safetensors; PretrainedError naming it if its header is not one
    (truncated, not JSON, offsets outside the file)."""
    try:
        return stack.enter_context(safe_open(file, framework="pt"))
    except (SafetensorError, OSError) as err:
        raise PretrainedError(f"{file} is not a readable safetensors file ({err})") from None


def _weight_map(path: Path) -> dict[str, Path]:
    """Each stored tensor's file: the single weights file, else the index's shards, which
    must be files of the directory itself."""
    if (path / WEIGHTS_FILE).is_file():
        with ExitStack() as stack:
            return dict.fromkeys(_open(path / WEIGHTS_FILE, stack).keys(), path / WEIGHTS_FILE)
    index = path / INDEX_FILE
    if not index.is_file():
        raise PretrainedError(
            f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path} (only safetensors weights are read)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise PretrainedError(f"{index} is not a safetensors index (no weight_map)") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise PretrainedError(f"{index} is not a safetensors index (weight_map malformed)")
    for file in sorted(set(weight_map.values())):
        if file in ("", ".", "..") or any(c in file for c in "/\\\0"):
            raise PretrainedError(
                f"{index} lists weights file {file!r}, outside {path}; an index names files "
                "of its own directory"
            )
    files = {name: path / file for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise PretrainedError(f"weights file {file} listed in {index} is missing")
    return files


def _sources(
    model: nn.Module, stored: set[str], tied_file: bool
) -> tuple[dict[str, str], list[str], set[str]]:
    """For each model parameter the stored tensor to read, the parameters found nowhere, and the
    stored tensors the model takes (an output head tied to the input embedding takes its key)."""
    modules = {id(module): name for name, module in model.named_modules()}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    head_name, embedding_name = (f"{modules[id(head)]}.weight", f"{modules[id(embedding)]}.weight")
    sources, missing, used = {}, [], set()
    for name, _ in model.named_parameters():
        legacy = _LEGACY_NAMES.get(name)
        if name in stored:
            sources[name] = name
        elif legacy in stored:
            sources[name] = legacy
        elif name == head_name and tied_file and embedding_name in stored:
            sources[name] = embedding_name
        else:
            missing.append(name)
    used.update(sources.values())
    if head.weight is embedding.weight:  # a tied model: a file may store the head all the same
        used.update(key for key in (head_name, _LEGACY_NAMES.get(head_name)) if key)
    return sources, missing, used


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset of a parameter."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.ndim


@torch.no_grad()
def load_pretrained(model: nn.Module, hf_dir: str | os.PathLike[str]) -> None:
    """Copy the weights of the transformers directory ``hf_dir`` into ``model``, in place.

    ``model`` is a LLaMA or GPT-NeoX causal LM of the directory's shape, materialised
    (``to_empty``), its parameters plain tensors or FSDP2 DTensors; each rank reads only its own
    shard's slice of every tensor and casts it to the parameter's dtype. An output head absent
    from the files takes the input embedding when ``config.json`` ties them. Rotary buffers are
    recomputed. A missing tensor, an unexpected tensor or a shape mismatch raises
    :class:`PretrainedError` naming the tensors and the directory, before any weight is written.
    """
    path = _checked_dir(hf_dir)
    tied_file = bool(json.loads((path / CONFIG_FILE).read_text()).get("tie_word_embeddings"))
    files = _weight_map(path)
    sources, missing, used = _sources(model, set(files), tied_file)
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    unexpected = sorted(
        key
        for key in set(files) - used
        if not _STALE_BUFFERS.search(key)
        and not any(re.search(pattern, key) for pattern in ignored)
    )
    if missing:
        raise PretrainedError(f"{path} lacks model tensor(s) {_listing(missing)}")
    if unexpected:
        raise PretrainedError(
            f"{path} holds tensor(s) the model does not have: {_listing(unexpected)}"
        )
    with ExitStack() as stack:
        opened = {
            file: _open(file, stack) for file in sorted({files[key] for key in sources.values()})
        }
        params = dict(model.named_parameters())
        slices = {name: opened[files[key]].get_slice(key) for name, key in sources.items()}
        for name, stored in slices.items():
            if stored.get_dtype() not in _WEIGHT_DTYPES:
                raise PretrainedError(
                    f"{files[sources[name]]}: tensor {sources[name]} has dtype "
                    f"{stored.get_dtype()}; weights are read from {', '.join(_WEIGHT_DTYPES)}"
                )
        wrong = [
            f"{sources[name]} {list(s.get_shape())} (model {list(params[name].shape)})"
            for name, s in slices.items()
            if list(s.get_shape()) != list(params[name].shape)
        ]
        if wrong:
            raise PretrainedError(
                f"{path}: shape mismatch of {_listing(wrong)}; the model "
                "must have the shape of its config.json"
            )
        for name, stored in slices.items():
            param = params[name]
            shape, offset = _local_box(param)
            box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(stored[box].to(local.dtype))
    init_buffers(model)
