"""Files a forger or a broken disk leaves: checkpoint files replaced with COMPLETE's hashes
recomputed, DCP metadata pointing elsewhere, malformed safetensors headers."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path

from srtrain.checkpoint import MARKER


def forge(path: Path, name: str, data: bytes) -> None:
    """Replace checkpoint ``path``'s file ``name`` with ``data`` and recompute its entry in
    COMPLETE, as a forger would."""
    (path / name).write_bytes(data)
    marker = json.loads((path / MARKER).read_text())
    marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(marker))


def metadata_pointing_at(path: Path, target: str) -> bytes:
    """Checkpoint ``path``'s own DCP metadata with every tensor's storage file renamed."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = target
    return pickle.dumps(metadata)


_OFFSETS = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}})
_DTYPE = json.dumps({"w": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}})
MALFORMED_SAFETENSORS = {  # what is wrong → the bytes of the file
    "cut inside its length": b"\x10\x00",
    "header length past the end": struct.pack("<Q", 10**6) + b"{}",
    "header not JSON": struct.pack("<Q", 5) + b"{abc}",
    "offsets past the end": struct.pack("<Q", len(_OFFSETS)) + _OFFSETS.encode() + bytes(16),
    "unknown dtype": struct.pack("<Q", len(_DTYPE)) + _DTYPE.encode() + bytes(16),
}
