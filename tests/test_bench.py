"""The benchmark's byte accounting (its timings need a GPU)."""

from __future__ import annotations

import json

import torch

from srtrain.bench.__main__ import main
from srtrain.bench.kernels import bench_shape, step_bytes


def test_step_bytes_count_each_tensor_once():
    shape = bench_shape(2**20)
    n = 2**20
    # fp32 param r+w (8) + fp32 grad (4) + bf16 m and v r+w (8) = 20 B per element
    assert step_bytes(shape, "bf16", "bf16", torch.float32, torch.float32, 32) == 20 * n
    # fp8 states: codes 1 B + one scale byte per 32 elements, read and written
    assert step_bytes(shape, "fp8", "fp8", torch.float32, torch.float32, 32) == (
        12 * n + 2 * 2 * (n + n // 32))
    # fp4 states: two codes per byte
    assert step_bytes(shape, "fp4_e2m1", "fp4_e2m2", torch.bfloat16, torch.bfloat16, 32) == (
        6 * n + 2 * 2 * (n // 2 + n // 32))


def test_dry_run_reports_state_bytes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--dry", "--numel", str(2**16), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    per_elem = {r["name"]: r["state_bytes"] / r["numel"] for r in result["rows"]}
    assert per_elem["m bf16 v bf16"] == 4.0
    assert per_elem["m fp8 v fp8"] == 2 + 2 / 32
    assert per_elem["m fp4_e2m1 v fp4_e2m2"] == 1 + 2 / 32
    assert result["environment"]["commit"]
    assert "m fp8 v fp8" in capsys.readouterr().out


def test_checkpoint_bench_times_save_and_load(tmp_path):
    import torch.distributed as dist

    from srtrain.bench.checkpoint_bench import run_checkpoint_bench

    try:
        rows = run_checkpoint_bench("llama-tiny", "fp8", vocab_size=256, root=str(tmp_path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [r["name"] for r in rows] == ["save sync", "save async", "load"]
    assert all(r["complete_s"] >= r["blocking_s"] > 0 and r["bytes"] > 0 for r in rows)
