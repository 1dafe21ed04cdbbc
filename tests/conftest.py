"""Test setup: Triton kernels run in its interpreter on machines without CUDA; shared data."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_DATA = {"data.max_bytes": 600_000, "data.vocab_size": 512, "data.val_fraction": 0.1}


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    """A small builtin corpus, tokenized once per test session."""
    from srtrain.data import ensure_prepared

    out = tmp_path_factory.mktemp("tiny_data") / "builtin"
    ensure_prepared(
        out,
        source="builtin",
        vocab_size=TINY_DATA["data.vocab_size"],
        max_bytes=TINY_DATA["data.max_bytes"],
        val_fraction=TINY_DATA["data.val_fraction"],
    )
    return str(out)


def tiny_overrides(data_dir: str, run_dir, **extra) -> list[str]:
    """Overrides for a short CPU run of llama-tiny on the shared small corpus. It computes in
    FP32 (``parallel.compute_dtype=auto`` on a CPU); runs that cover BF16 compute ask for it."""
    values = {
        "data.dir": data_dir,
        **TINY_DATA,
        "model.seq_len": 64,
        "train.global_batch_size": 8,
        "train.steps": 30,
        "train.log_interval": 5,
        "train.val_interval": 15,
        "train.val_batches": 2,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 5,
        "parallel.device": "cpu",
        "train.run_dir": str(run_dir),
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def figures_module():
    """``tools/figures.py`` (the lab's figure registry), imported once per process."""
    module = sys.modules.get("figures")
    if module is None:
        path = Path(__file__).resolve().parents[1] / "tools" / "figures.py"
        spec = importlib.util.spec_from_file_location("figures", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["figures"] = module
        spec.loader.exec_module(module)
    return module
