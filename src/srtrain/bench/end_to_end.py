"""End-to-end training throughput, MFU, peak memory and state bytes for state-format variants.

Each variant trains in its own process (clean memory statistics) through the real
``train`` loop; rates are medians over log intervals after the first (warm-up).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "torch": ["optim.name=torch_adamw"],  # torch's fused AdamW, FP32 states: the baseline
    "fp32": [
        "optim.m_format=fp32",
        "optim.v_format=fp32",
        "optim.m_rounding=nearest",
        "optim.v_rounding=nearest",
    ],
    "bf16": ["optim.m_format=bf16", "optim.v_format=bf16"],
    "fp8": ["optim.m_format=fp8", "optim.v_format=fp8"],
    "fp4": ["optim.m_format=fp4", "optim.v_format=fp4"],
}


def run_one(overrides: list[str], out: Path) -> None:
    """Train once in this process and write the summary to ``out`` (rank 0)."""
    import torch.distributed as dist

    from srtrain.config import load_config
    from srtrain.trainer import run

    cfg = load_config(None, overrides)
    result = run(cfg)
    rates = result.tokens_per_s[1:] or result.tokens_per_s
    mfus = result.mfu[1:] or result.mfu
    if dist.get_rank() == 0:
        out.write_text(
            json.dumps(
                {
                    "tokens_per_s": statistics.median(rates),
                    "mfu": statistics.median(mfus),
                    "peak_memory_gib": result.peak_memory_gib,
                    "state_bytes_per_param": result.state_bytes_per_param,
                    "final_loss": result.losses[-1],
                }
            )
        )
    dist.destroy_process_group()


def run_variants(base: list[str], variants: list[str], nproc: int = 1) -> list[dict]:
    """Train each variant with the ``base`` overrides; one row per variant."""
    rows = []
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}; allowed: {', '.join(VARIANTS)}")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "summary.json"
            launcher = (
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={nproc}",
                ]
                if nproc > 1
                else [sys.executable]
            )
            cmd = [
                *launcher,
                "-m",
                "srtrain.bench.end_to_end",
                str(out),
                *base,
                *VARIANTS[name],
                f"train.run_dir={tmp}/run",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"variant {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
                )
            rows.append({"name": name, "nproc": nproc, **json.loads(out.read_text())})
    return rows


if __name__ == "__main__":
    run_one(sys.argv[2:], Path(sys.argv[1]))
