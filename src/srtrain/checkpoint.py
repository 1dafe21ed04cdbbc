"""Checkpoints with torch.distributed.checkpoint: atomic save, verified load, resume, fallback.

A checkpoint is ``<run dir>/checkpoints/step-N/`` holding

- the DCP files (``.metadata``, ``__<rank>_<i>.distcp``): the model's parameters and the
  optimizer state exactly as stored (SRAdamW's integer codes and scales, step and ages),
  keyed by parameter name, so it loads at any world size;
- ``checkpoint.json`` (rank 0): step, world size, the model and state-format fingerprint,
  the model config for export, the optimizer hyperparameters and the trainer's ``extra``;
- ``rank-<r>.json``: each rank's torch CPU and CUDA generator states;
- ``tokenizer/``: the files of the run's tokenizer, when the data dir was given (the manifest's
  ``tokenizer`` lists them with their kind, the data's vocabulary size and special ids: see
  :mod:`srtrain.data.tokenizer`; a checkpoint of
  an earlier version holds ``tokenizer.model`` instead);
- ``COMPLETE`` (written last): size and sha256 of every other file.

A save is written under ``step-N.tmp-<id>`` and renamed to ``step-N`` by rank 0 once
every rank's files and the marker are on disk, so a crash mid-save leaves the previous
checkpoint the latest. Loading checks every file against the marker first; DCP's pickled
``.metadata`` is read with an unpickler that admits only DCP's own metadata classes, and
no pickled object is ever read back otherwise (tensors, or JSON).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pickle
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from srtrain.config import Config
from srtrain.faultpoints import fault_point
from srtrain.models import PRESETS
from srtrain.nospace import free_bytes, no_space, out_of_space
from srtrain.rundir import CHECKPOINTS_DIR

MARKER = "COMPLETE"
MANIFEST = "checkpoint.json"
TOKENIZER = "tokenizer.model"  # an earlier version's copy of a SentencePiece tokenizer
TOKENIZER_DIR = "tokenizer"
FORMAT = "srtrain-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"step-\d+\.(tmp|trash)-[0-9a-f]+")
_HASH_CHUNK = 1 << 22
# Hyperparameters that may differ on resume (the run's value is used, with a warning).
_HYPERPARAMETERS = (
    "betas",
    "eps",
    "weight_decay",
    "m_rounding",
    "v_rounding",
    "param_rounding",
    "seed",
    "backend",
)
# The model types of the configs srtrain's presets build (models.shape_config), by family.
_PRESET_TYPES = {"llama": "llama", "gpt_neox": "gpt-neox"}
# Set (True) on an exception every rank raised after agreeing on it (see _settle).
AGREED = "srtrain_agreed"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used, described in one line."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, truncated or garbled (an older one may work)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint belongs to a different model or optimizer state format."""


# ------------------------------------------------------------------ safe DCP reading

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata`` pickle, refusing every class but DCP's metadata records."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise CorruptCheckpointError(
                f"{self.path} refers to {module}.{name}; a checkpoint's metadata may only hold "
                "DCP metadata records"
            )
        return super().find_class(module, name)


class _SafeReader(FileSystemReader):
    """A DCP file reader whose metadata is unpickled with :class:`_MetadataUnpickler` and
    checked for form: every tensor's bytes must lie in a file of the checkpoint directory
    itself (``files``: the names its COMPLETE marker covers, when known), so no metadata
    points a load at a file elsewhere or at one the marker's hashes do not cover."""

    def __init__(self, path: str | os.PathLike[str], files: Iterable[str] | None = None) -> None:
        super().__init__(path)
        self.files = None if files is None else set(files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's DCP metadata."""
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint metadata {path} is missing") from None
        except Exception as e:  # a garbled pickle raises nearly anything
            raise CorruptCheckpointError(
                f"{path} is not DCP metadata ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(
                f"{path} holds {type(metadata).__name__}, not DCP Metadata"
            )
        self._check_form(path, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_form(self, path: Path, metadata: Metadata) -> None:
        """Raise CorruptCheckpointError unless the entries and their storage are well formed
        and every storage file is one of this directory's own files."""
        entries = getattr(metadata, "state_dict_metadata", None)
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(entries, dict) or not isinstance(storage, dict):
            raise CorruptCheckpointError(f"{path} lacks DCP's tensor entries or storage records")
        for info in storage.values():
            name = getattr(info, "relative_path", None)
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not isinstance(name, str) or not _is_plain_name(name):
                raise CorruptCheckpointError(
                    f"{path} points tensor data at {name!r}, outside the checkpoint directory"
                )
            if self.files is not None and name not in self.files:
                raise CorruptCheckpointError(
                    f"{path} points tensor data at {name!r}, which {MARKER} does not cover"
                )
            if not (isinstance(offset, int) and isinstance(length, int)) or min(offset, length) < 0:
                raise CorruptCheckpointError(
                    f"{path} gives {name!r} the byte range offset {offset!r}, length {length!r}"
                )


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a non-negative JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly in a directory (no separator, not . or ..)."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _is_checkpoint_file(name: str) -> bool:
    """Whether a marker's ``name`` is a file a checkpoint holds: one directly in it, or one of
    the tokenizer files in its ``tokenizer/`` directory."""
    folder, sep, file = name.partition("/")
    if sep:
        return folder == TOKENIZER_DIR and _is_plain_name(file)
    return _is_plain_name(name)


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing pickled (non-tensor) entries."""

    def load_bytes(self, read_item, value) -> None:
        """Refuse: srtrain checkpoints hold tensors only."""
        raise CorruptCheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; srtrain "
            "checkpoints hold tensors only"
        )


# ------------------------------------------------------------------ files and layout


def _write_json(path: Path, value: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{what} {path} is not valid JSON ({e})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _read_marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of checkpoint ``path``, checked for form."""
    marker = _read_json(path / MARKER, "checkpoint marker")
    match = _STEP_DIR.fullmatch(path.name)
    if (
        not isinstance(marker, dict)
        or marker.get("format") != FORMAT
        or not isinstance(marker.get("files"), dict)
    ):
        raise CorruptCheckpointError(f"checkpoint marker {path / MARKER} is not an srtrain marker")
    if marker.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {marker.get('version')!r}; "
            f"this code reads version {VERSION}"
        )
    for name, entry in marker["files"].items():
        if not (
            _is_checkpoint_file(name)
            and isinstance(entry, dict)
            and _is_count(entry.get("bytes"))
            and isinstance(entry.get("sha256"), str)
        ):
            raise CorruptCheckpointError(
                f"checkpoint marker {path / MARKER} lists {name!r} malformed (a file of the "
                "checkpoint directory with its bytes and sha256)"
            )
    if match and marker.get("step") != int(match.group(1)):
        raise CorruptCheckpointError(
            f"checkpoint marker {path / MARKER} names step {marker.get('step')!r}, the "
            f"directory step {match.group(1)}"
        )
    return marker


def step_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-N`` directory, with a COMPLETE marker file or without
    (damaged: a save only becomes ``step-N`` with its marker), oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_dirs(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-N`` checkpoint with a COMPLETE marker file, oldest first."""
    return [(step, path) for step, path in step_dirs(run_dir) if (path / MARKER).is_file()]


def latest(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run dir (valid marker), or None."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        try:
            _read_marker(path)
        except CheckpointError:
            continue
        return path
    return None


def finished_step(cfg: Config) -> int | None:
    """The step of the run dir's newest complete checkpoint if it has reached
    ``train.steps`` (nothing is left to train), else None. The run dir's own checkpoints
    win over ``checkpoint.load``, which only seeds a run without any; runs that do not
    checkpoint are never finished."""
    if not cfg.checkpoint.enabled:
        return None
    path = latest(cfg.train.run_dir)
    if path is None:
        return None
    step = checkpoint_step(path)
    return step if step >= cfg.train.steps else None


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step a complete checkpoint was saved at."""
    return int(_read_marker(Path(path))["step"])


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory as given, or a run dir's latest complete checkpoint."""
    given = Path(path)
    if not given.is_dir():
        state = "is not a directory" if given.exists() else "does not exist"
        raise CheckpointError(f"checkpoint path {str(path)!r} {state}")
    if (given / MARKER).is_file():
        _read_marker(given)
        return given
    found = latest(given)
    if found is None:
        raise CheckpointError(
            f"{str(path)!r} is neither a complete checkpoint (no {MARKER} "
            "marker) nor a run dir with one"
        )
    return found


def resolve_resume(
    run_dir: str | os.PathLike[str], explicit_path: str | os.PathLike[str] | None
) -> Path | None:
    """The checkpoint to start from: ``explicit_path`` (see :func:`resolve_checkpoint`) if
    given, else the run dir's latest complete one; None for a fresh run."""
    return resolve_checkpoint(explicit_path) if explicit_path else latest(run_dir)


def verify(path: str | os.PathLike[str], rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Check a checkpoint's files against its marker; return the marker.

    Every file's presence and size is checked; the sha256 of file i only where
    ``i % world_size == rank`` (ranks share the hashing). Raises CorruptCheckpointError.
    """
    path = Path(path)
    if not path.is_dir():
        raise CorruptCheckpointError(f"checkpoint {path} does not exist")
    marker = _read_marker(path)
    for i, (name, entry) in enumerate(sorted(marker["files"].items())):
        file = path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CorruptCheckpointError(
                f"checkpoint file {file} has {size} bytes, the marker lists {entry['bytes']} "
                "(truncated or overwritten)"
            )
        if i % world_size == rank and _sha256(file) != entry["sha256"]:
            raise CorruptCheckpointError(
                f"checkpoint file {file} does not match its sha256 in {path / MARKER} (garbled)"
            )
    return marker


# What a manifest must hold for loading and export: key → the types its value may have.
_MANIFEST_KEYS: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "model": (dict,),
    "params": (dict,),
    "optimizer_state": (bool,),
    "optimizer_groups": (list,),
    "extra": (dict,),
}
_MODEL_KEYS: dict[str, tuple[type, ...]] = {
    "preset": (str, type(None)),
    "model_type": (str,),
    "vocab_size": (int,),
    "seq_len": (int,),
    "hf_config": (dict,),
}


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, checked for form (CorruptCheckpointError names
    the first key missing or of the wrong type)."""
    file = path / MANIFEST
    manifest = _read_json(file, "checkpoint manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"checkpoint manifest {file} is not an srtrain manifest")

    def check(section: dict[str, Any], keys: dict[str, tuple[type, ...]], prefix: str) -> None:
        for key, types in keys.items():
            if key not in section:
                raise CorruptCheckpointError(f"checkpoint manifest {file} has no {prefix}{key}")
            if not isinstance(section[key], types):
                raise CorruptCheckpointError(
                    f"checkpoint manifest {file} has {prefix}{key} of type "
                    f"{type(section[key]).__name__}"
                )

    check(manifest, _MANIFEST_KEYS, "")
    check(manifest["model"], _MODEL_KEYS, "model.")
    for name, entry in manifest["params"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("shape"), list)
            and all(_is_count(n) for n in entry["shape"])
            and isinstance(entry.get("dtype"), str)
        ):
            raise CorruptCheckpointError(f"checkpoint manifest {file} has params.{name} malformed")
    if not all(isinstance(group, dict) for group in manifest["optimizer_groups"]):
        raise CorruptCheckpointError(f"checkpoint manifest {file} has optimizer_groups malformed")
    tokenizer = manifest.get("tokenizer")
    if tokenizer not in (None, TOKENIZER) and not (
        isinstance(tokenizer, dict)
        and isinstance(tokenizer.get("files"), list)
        and tokenizer["files"]
        and all(
            isinstance(f, str)
            and f.startswith(f"{TOKENIZER_DIR}/")
            and _is_plain_name(f.removeprefix(f"{TOKENIZER_DIR}/"))
            for f in tokenizer["files"]
        )
    ):
        raise CorruptCheckpointError(
            f"checkpoint manifest {file} names tokenizer {tokenizer!r}, not files of "
            f"{TOKENIZER_DIR}/"
        )
    return manifest


# ------------------------------------------------------------------ fingerprints


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _preset_of(config) -> str | None:
    """The srtrain preset whose shape a transformers config has, if any."""
    family = _PRESET_TYPES.get(config.model_type)
    shape = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_hidden_layers,
    )
    for name, preset in PRESETS.items():
        if (preset.family, preset.hidden, preset.intermediate, preset.heads, preset.layers) == (
            family,
            *shape,
        ):
            return name
    return None


def _describe_model(model: nn.Module) -> dict[str, Any]:
    """The model section of a manifest: preset, shape summary and its transformers config."""
    config = model.config
    return {
        "preset": _preset_of(config),
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "seq_len": config.max_position_embeddings,
        "hf_config": json.loads(config.to_json_string(use_diff=False)),
    }


def _describe_params(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, dict[str, Any]]:
    """Each parameter's full shape and dtype, and its state formats when an optimizer is given."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = {
        name: {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
        for name, p in model.named_parameters()
    }
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                params[names[id(p)]].update(
                    m_format=group["m_format"],
                    v_format=group["v_format"],
                    block_size=group["block_size"],
                )
    return params


def _check_fingerprint(
    path: Path, manifest: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Raise CheckpointMismatchError naming the first difference between checkpoint and run."""
    saved_model, run_model = manifest["model"], _describe_model(model)
    for key in ("preset", "model_type", "vocab_size"):
        if saved_model[key] != run_model[key]:
            raise CheckpointMismatchError(
                f"checkpoint {path} has {key} {saved_model[key]} but the run uses {run_model[key]}"
            )
    compare_formats = optimizer is not None and manifest["optimizer_state"]
    saved, run = manifest["params"], _describe_params(model, optimizer)
    missing, unexpected = sorted(run.keys() - saved.keys()), sorted(saved.keys() - run.keys())
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path} has no parameter {missing[0]}, which the run has "
            f"({len(missing)} missing)"
        )
    if unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {path} has parameter {unexpected[0]}, which the run lacks "
            f"({len(unexpected)} extra)"
        )
    keys = ("shape", "dtype") + (("m_format", "v_format", "block_size") if compare_formats else ())
    for key in keys:
        for name, entry in run.items():
            if saved[name].get(key) != entry[key]:
                raise CheckpointMismatchError(
                    f"checkpoint {path} has {key} {saved[name].get(key)} but the run uses "
                    f"{entry[key]} (parameter {name})"
                )


def _warn_hyperparameters(
    path: Path, manifest: dict[str, Any], optimizer: torch.optim.Optimizer
) -> None:
    """Warn about optimizer hyperparameters that differ from the checkpoint's (run's win)."""
    for i, (saved, group) in enumerate(
        zip(manifest["optimizer_groups"], optimizer.param_groups, strict=False)
    ):
        for key in _HYPERPARAMETERS:
            value = json.loads(json.dumps(group.get(key), default=str))
            if key in saved and saved[key] != value:
                warnings.warn(
                    f"checkpoint {path} has optimizer group {i} {key}={saved[key]}, "
                    f"the run uses {value} (kept)",
                    stacklevel=3,
                )


# ------------------------------------------------------------------ process groups


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _settle(
    action: Callable[[], Any],
    group: dist.ProcessGroup | None,
    error_type: type[CheckpointError] = CheckpointError,
) -> Any:
    """Run this rank's part of ``action``; if it failed on any rank, raise on every rank
    (``error_type`` with the first failing rank's message where another rank failed)."""
    rank, world = _rank_world(group)
    error: Exception | None = None
    result = None
    try:
        result = action()
    except Exception as e:
        error = e
    if group is None:
        if error is not None:
            raise error
        return result
    flag = torch.tensor([rank if error is not None else world], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    first = int(flag)
    if first == world:
        return result
    message = [str(error) if rank == first else None]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, first), group=group)
    if error is None:
        error = error_type(f"{message[0]} (on rank {first})")
    setattr(error, AGREED, True)
    raise error


@contextlib.contextmanager
def _cpu_group(group: dist.ProcessGroup | None) -> Iterator[dist.ProcessGroup | None]:
    """``group`` if given; else a temporary gloo group over all ranks (None without a
    process group)."""
    if group is not None or not dist.is_initialized():
        yield group
        return
    made = dist.new_group(backend="gloo")
    try:
        yield made
    finally:
        dist.destroy_process_group(made)


# ------------------------------------------------------------------ state


def _rng_state() -> dict[str, str | None]:
    """This process's torch CPU and current-CUDA-device generator states (base64)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(), "cuda": cuda}


_RngState = tuple[torch.Tensor, torch.Tensor | None]


def _read_rng(path: Path, rank: int) -> _RngState | None:
    """This rank's generator states (CPU, CUDA or None) from ``rank-<rank>.json``, None if
    the checkpoint has no such rank; CorruptCheckpointError if the file is malformed."""
    file = path / f"rank-{rank}.json"
    if not file.is_file():
        return None
    state = _read_json(file, "checkpoint rank state")

    def as_tensor(text: Any, like: torch.Tensor) -> torch.Tensor:
        try:
            raw = base64.b64decode(text, validate=True)
        except (TypeError, ValueError):
            raw = b""
        if len(raw) != like.numel():
            raise CorruptCheckpointError(f"checkpoint rank state {file} holds no generator state")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    rng = state.get("rng") if isinstance(state, dict) else None
    if not isinstance(rng, dict) or "cpu" not in rng:
        raise CorruptCheckpointError(f"checkpoint rank state {file} has no rng")
    cuda = None
    if rng.get("cuda") is not None and torch.cuda.is_available():
        cuda = as_tensor(rng["cuda"], torch.cuda.get_rng_state())
    return as_tensor(rng["cpu"], torch.get_rng_state()), cuda


def _restore_rng(rng: _RngState) -> None:
    """Set this process's generators to ``rng`` (see :func:`_read_rng`)."""
    cpu, cuda = rng
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _json_values(extra: Mapping[str, Any]) -> dict[str, str]:
    """Each key of ``extra`` as canonical JSON text; one clear error for a non-JSON value."""
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    texts = {}
    for key, value in extra.items():
        if not isinstance(key, str):
            raise TypeError(f"extra keys must be strings, got {key!r}")
        try:
            texts[key] = json.dumps(value, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"extra[{key!r}] is not a JSON value (int, float, str, bool, None, list, dict): {e}"
            ) from None
    return texts


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _differs(values: list[int], group: dist.ProcessGroup | None) -> list[bool]:
    """For each position, whether any two ranks hold different values."""
    if group is None:
        return [False] * len(values)
    both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    return [int(both[i]) != -int(both[n + i]) for i in range(n)]


def _check_global(extra: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Raise unless ``extra`` is JSON and the same on every rank."""
    texts = _json_values(extra)
    keys = sorted(texts)
    if _differs([_digest64(json.dumps(keys))], group)[0]:
        raise ValueError(
            f"extra has different keys on different ranks (here: {keys}); it "
            "must hold the same global state on every rank"
        )
    differing = [
        k
        for k, d in zip(keys, _differs([_digest64(texts[k]) for k in keys], group), strict=True)
        if d
    ]
    if differing:
        raise ValueError(
            f"extra differs between ranks at {differing}; it must hold the same "
            "global state on every rank"
        )


def _local_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of this rank's tensors in a checkpoint state (what its DCP files hold)."""
    total = 0
    for value in state.values():
        if isinstance(value, Mapping):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The tensors of a checkpoint: the model's parameters and the optimizer's live state
    tensors (as stored, by parameter name; absent before the first step)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None and optimizer.state:
        names = {id(p): name for name, p in model.named_parameters()}
        state["optim"] = {
            names[id(p)]: optimizer.state[p]
            for g in optimizer.param_groups
            for p in g["params"]
            if optimizer.state.get(p)
        }
    return state


# ------------------------------------------------------------------ saving


class CheckpointManager:
    """Saves atomic checkpoints of a run and keeps the newest ``keep`` of them.

    Construct on every rank (after the process group exists, if any); call :meth:`save` on
    every rank at the same step, and :meth:`close` (or use ``with``) at the end. With
    ``async_save`` the DCP write runs in the background (staged to CPU memory first) and
    rank 0 publishes the checkpoint as soon as it is written; the next :meth:`save`,
    :meth:`wait` or :meth:`close` reports its outcome. ``data_dir``: the run's prepared data
    directory, whose tokenizer is copied into each checkpoint for export.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        keep: int,
        async_save: bool = False,
        *,
        data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be a positive integer (checkpoints kept)")
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep
        self.async_save = async_save
        self.data_dir = None if data_dir is None else str(data_dir)
        self._tokenizer: dict[str, Any] | None = None  # the manifest's entry
        self._tokenizer_files: list[Path] = []
        if data_dir is not None:
            from srtrain.data import load_meta

            meta = load_meta(data_dir)
            self._tokenizer_files = meta.tokenizer_files
            self._tokenizer = {
                "kind": meta.tokenizer.kind,
                "files": [f"{TOKENIZER_DIR}/{f.name}" for f in self._tokenizer_files],
                "vocab_size": meta.vocab_size,
                **{key: getattr(meta, key) for key in ("bos_id", "eos_id", "pad_id", "unk_id")},
            }
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.rank, self.world_size = _rank_world(self._group)
        self._pending: Future | None = None
        self._pending_path: Path | None = None
        self._pending_write: tuple[Path, tuple[int, int]] | None = None
        self._publisher = (
            ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if async_save and self.rank == 0
            else None
        )
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for path in self.root.iterdir():
                if _TEMPORARY.fullmatch(path.name):
                    shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _token(self) -> str:
        """A random id that every rank agrees on."""
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        if self._group is not None:
            dist.broadcast(token, src=dist.get_global_rank(self._group, 0), group=self._group)
        return f"{int(token):016x}"

    def _manifest(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Any],
        has_optimizer_state: bool,
    ) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": self.world_size,
            "torch": torch.__version__,
            "model": _describe_model(model),
            "params": _describe_params(model, optimizer),
            "optimizer_state": has_optimizer_state,
            "optimizer_groups": json.loads(json.dumps(groups, default=str)),
            "data_dir": self.data_dir,
            "tokenizer": self._tokenizer,
            "extra": dict(extra),
        }

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint ``step-<step>`` (on every rank); returns its final path.

        ``extra``: JSON values (int, float, str, bool, None, list, dict), the same on every
        rank (checked); returned by :func:`load` as saved (tuples come back as lists).
        Synchronous saves are complete and visible on return; asynchronous ones once rank 0's
        background write finishes (at the latest by the next save, wait or close).
        """
        self.wait()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        _check_global(extra, self._group)
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp-{self._token()}"
        state = _state_dict(model, optimizer)

        def prepare() -> None:
            tmp.mkdir(parents=True, exist_ok=True)
            _write_json(
                tmp / f"rank-{self.rank}.json",
                {"rank": self.rank, "world_size": self.world_size, "rng": _rng_state()},
            )
            if self.rank == 0:
                _write_json(
                    tmp / MANIFEST, self._manifest(step, model, optimizer, extra, "optim" in state)
                )
                if self._tokenizer_files:
                    (tmp / TOKENIZER_DIR).mkdir()
                    for file in self._tokenizer_files:
                        shutil.copyfile(file, tmp / TOKENIZER_DIR / file.name)

        needed = (_local_bytes(state), free_bytes(self.root))
        self._settle_write(prepare, tmp, needed)
        writer = FileSystemWriter(tmp)
        if self.async_save:
            response = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            written: Future = getattr(response, "upload_completion", response)
            self._pending = (
                self._publisher.submit(self._publish_when_written, written, tmp, final)
                if self._publisher is not None
                else written
            )
            self._pending_path, self._pending_write = final, (tmp, needed)
            return final

        def write() -> None:
            dcp.save(state, storage_writer=writer, process_group=self._group)
            if self.rank == 0:
                self._publish(tmp, final)

        self._settle_write(write, tmp, needed)
        return final

    def wait(self) -> Path | None:
        """Finish a pending asynchronous save (every rank); its path, or None if none."""
        if self._pending is None:
            return None
        pending, path = self._pending, self._pending_path
        tmp, needed = self._pending_write
        self._pending = self._pending_path = self._pending_write = None
        self._settle_write(pending.result, tmp, needed)
        return path

    def _settle_write(self, action: Callable[[], None], tmp: Path, needed: tuple[int, int]) -> None:
        """:func:`_settle` of one part of a save into ``tmp`` (``needed``: this rank's bytes
        and the bytes free when the save began); a write that found no room is NoSpaceError.
        If any rank failed, rank 0 removes ``tmp`` (never loadable: it is no ``step-N`` and
        has no marker) to give the room back."""

        def checked() -> None:
            try:
                action()
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException
                own = getattr(err, "failures", {self.rank: None})
                if self.rank not in own:
                    return  # DCP's report of other ranks' failures: _settle raises theirs
                if out_of_space(err):
                    raise no_space(self.root, needed[0], free=needed[1]) from None
                raise

        try:
            _settle(checked, self._group)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def close(self) -> None:
        """Finish a pending save and release the manager's thread and process group."""
        try:
            self.wait()
        finally:
            if self._publisher is not None:
                self._publisher.shutdown()
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None

    def _publish_when_written(self, written: Future, tmp: Path, final: Path) -> None:
        written.result()
        self._publish(tmp, final)

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rank 0, after every rank's files are written: marker, rename, prune."""
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        with ThreadPoolExecutor(min(8, max(1, len(files)))) as pool:
            digests = list(pool.map(_sha256, files))
        marker = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(_STEP_DIR.fullmatch(final.name).group(1)),
            "files": {
                p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": d}
                for p, d in zip(files, digests, strict=True)
            },
        }
        fault_point("save")
        _write_json(tmp / f"{MARKER}.tmp", marker)
        os.replace(tmp / f"{MARKER}.tmp", tmp / MARKER)
        _fsync_dir(tmp)
        replaced = None
        if final.exists():
            replaced = final.with_name(f"{final.name}.trash-{secrets.token_hex(8)}")
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if replaced is not None:
            shutil.rmtree(replaced)
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        """Delete all but the ``keep`` newest checkpoints (never ``newest``), and every step
        directory without a COMPLETE marker older than ``newest`` (never usable), invisibly
        first."""
        step = int(_STEP_DIR.fullmatch(newest.name).group(1))
        others = [path for _, path in checkpoint_dirs(self.root.parent) if path != newest]
        doomed = others[: max(0, len(others) - (self.keep - 1))]
        doomed += [
            path
            for found, path in step_dirs(self.root.parent)
            if found < step and not (path / MARKER).is_file()
        ]
        for path in doomed:
            trash = path.with_name(f"{path.name}.trash-{secrets.token_hex(8)}")
            os.rename(path, trash)
            shutil.rmtree(trash)


# ------------------------------------------------------------------ loading


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    process_group: dist.ProcessGroup | None = None,
    check_extra: ExtraCheck | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into ``model`` and ``optimizer`` in place (every rank); return its
    ``extra``.

    Verifies the files first (CorruptCheckpointError), then the fingerprint
    (CheckpointMismatchError), so nothing is modified when either fails. Any world size
    loads any checkpoint; each rank restores the generator states its rank saved, if the
    saved run had that rank. With ``optimizer`` None only the model is loaded.
    ``process_group``: a group with a CPU backend (default: a temporary gloo group over all
    ranks). ``check_extra``: what is wrong with a saved ``extra`` the caller cannot use (None:
    nothing), checked with the files (CorruptCheckpointError).
    """
    with _cpu_group(process_group) as group:
        return _load(Path(path), model, optimizer, group, check_extra)


# What is wrong with a checkpoint's ``extra`` for its reader ("step of type str"), or None.
ExtraCheck = Callable[[dict[str, Any]], str | None]


def _load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
    check_extra: ExtraCheck | None = None,
) -> dict[str, Any]:
    rank, world = _rank_world(group)

    def check_files() -> tuple[set[str], Metadata, dict[str, Any], _RngState | None]:
        files = set(verify(path, rank, world)["files"])
        metadata = _SafeReader(path, files).read_metadata()
        manifest = _read_manifest(path)
        problem = check_extra(manifest["extra"]) if check_extra is not None else None
        if problem is not None:
            raise CorruptCheckpointError(
                f"checkpoint manifest {path / MANIFEST} has extra.{problem}"
            )
        return files, metadata, manifest, _read_rng(path, rank)

    files, metadata, manifest, rng = _settle(check_files, group, CorruptCheckpointError)
    stored = metadata.state_dict_metadata
    _check_fingerprint(path, manifest, model, optimizer)
    if optimizer is not None and rank == 0:
        _warn_hyperparameters(path, manifest, optimizer)
    with_optimizer = optimizer if manifest["optimizer_state"] else None
    needed = [f"model.{name}" for name in get_model_state_dict(model)]
    if with_optimizer is not None:
        needed += [f"optim.{name}.step" for name, _ in model.named_parameters()]
    missing = sorted(set(needed) - stored.keys())
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path} has no tensor {missing[0]}, which the "
            f"run needs ({len(missing)} missing)"
        )
    if with_optimizer is not None and not with_optimizer.state:
        with_optimizer.init_state()  # zero states for DCP to load into
    state = _state_dict(model, with_optimizer)
    same_sample = with_optimizer is not None and all(
        saved.get("shadow_sample") == group.get("shadow_sample")
        for saved, group in zip(
            manifest["optimizer_groups"], with_optimizer.param_groups, strict=False
        )
    )
    restart = _unrestorable_shadows(state, stored, same_sample)
    _read_tensors(state, path, files, process_group=group)
    set_model_state_dict(model, state["model"])
    if restart:
        params = dict(model.named_parameters())
        for name in restart:
            with_optimizer.restart_shadow(params[name])
    if rng is not None:
        _restore_rng(rng)
    return manifest["extra"]


def _unrestorable_shadows(
    state: dict[str, Any], stored: Mapping[str, Any], same_sample: bool
) -> list[str]:
    """Names of the parameters whose FP32 shadow (SRAdamW's ``shadow_m``, ``shadow_v``) the
    checkpoint lacks, holds at another size (saved without one or at another world size) or
    sampled otherwise (``same_sample`` False): their shadow is left out of ``state``'s load
    and restarted from the loaded states."""
    names = []
    for name, entries in state.get("optim", {}).items():
        keys = [k for k in entries if k.startswith("shadow_")]
        if keys and (
            not same_sample
            or any(
                getattr(stored.get(f"optim.{name}.{k}"), "size", None) != entries[k].shape
                for k in keys
            )
        ):
            state["optim"][name] = {k: v for k, v in entries.items() if k not in keys}
            names.append(name)
    return names


def load_latest_valid(
    run_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    log: Callable[[str], None] = print,
    otherwise: str | None = None,
    check_extra: ExtraCheck | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """Load the newest usable checkpoint of a run dir, newest to oldest; (step, extra).

    Each corrupt checkpoint passed over (a ``step-N`` directory without its COMPLETE marker
    included) gives rank 0 one ``log`` line naming it, why, and the step resumed from
    instead; None when the run dir has no checkpoint (a fresh run). When there are
    checkpoints but none is usable: CorruptCheckpointError, or, given ``otherwise`` (what
    the caller does instead, e.g. ``starting from checkpoint.load …``), a line for each
    ending with it and None. Raises CheckpointMismatchError at once (an older checkpoint of
    the same run would not match either). ``check_extra``: see :func:`load`.
    """
    candidates = [path for _, path in reversed(step_dirs(run_dir))]
    if not candidates:
        return None
    root = Path(run_dir) / CHECKPOINTS_DIR
    skipped: list[tuple[Path, str]] = []
    with _cpu_group(None) as group:
        rank, _ = _rank_world(group)

        def report(instead: str) -> None:
            if rank == 0:
                for corrupt, reason in skipped:
                    log(f"checkpoint {corrupt} is corrupt ({reason}); {instead}")

        for path in candidates:
            try:
                extra = _load(path, model, optimizer, group, check_extra)
            except CorruptCheckpointError as e:
                skipped.append((path, str(e).replace(f"{path}{os.sep}", "")))
                continue
            report(f"resuming from {path.name} instead")
            return checkpoint_step(path), extra
    if otherwise is not None:
        report(otherwise)
        return None
    newest, reason = skipped[0]
    raise CorruptCheckpointError(
        f"every checkpoint in {root} is corrupt ({len(candidates)}; {newest.name}: {reason}); "
        "move them away to start afresh, or set checkpoint.load to another checkpoint"
    )


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a complete checkpoint (its marker read first; CheckpointError)."""
    _read_marker(Path(path))
    return _read_manifest(Path(path))


def read_full_model(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint's manifest and its full (unsharded) model tensors by parameter name, on
    the CPU; verifies every file first. Runs in one process, without a process group."""
    path = Path(path)
    files = set(verify(path)["files"])
    manifest = _read_manifest(path)
    metadata = _SafeReader(path, files).read_metadata()
    tensors = {
        key.removeprefix("model."): torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _read_tensors({"model": tensors}, path, files, no_dist=True)
    return manifest, tensors


def _read_tensors(state: dict, path: Path, files, **how) -> None:
    """``dcp.load`` of ``state`` from checkpoint ``path`` through the reader that stays inside
    its listed ``files``; a failure is CorruptCheckpointError. ``how``: dcp.load's process
    group or ``no_dist``."""
    try:
        dcp.load(
            state, storage_reader=_SafeReader(path, files), planner=_TensorsOnlyPlanner(), **how
        )
    except CheckpointException as e:
        failure = next(iter(getattr(e, "failures", {}).values()), e)
        raise CorruptCheckpointError(f"checkpoint {path} could not be read: {failure}") from e
