"""One measurement of the headline table, in the source tree under test.

``srtrain.bench.headline`` runs this file by path, in a fresh process whose ``PYTHONPATH``
puts one tree's ``srtrain`` first: the harness is the caller's, the code measured is the
tree's. So it uses only what every tree compared so far offers (``SRAdamW``'s constructor
and ``step``, ``srtrain.models.build_model``, ``srtrain.config.load_config`` and
``srtrain.trainer.run``), and the standard library, torch and (when installed) torchao.

``python headline_probe.py optimizer OUT PRESET WORLDS REPEATS VOCAB``: the optimizer step
at default arguments over rank 0's shards of PRESET (at vocabulary VOCAB) at each world size
(comma-separated),
timed with CUDA events around ``step()`` as a user's loop calls it (host work included;
on a machine without CUDA, the wall clock around the CPU step).

``python headline_probe.py train OUT CONFIG [OVERRIDES...]``: one training run of a
recipe through the trainer, its tokens/s and MFU per log interval after the first, and
its peak memory.

Each writes ``{"rows": [...]}`` to OUT as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

LR, WEIGHT_DECAY = 3e-4, 0.1
WARMUP_STEPS = 5 if torch.cuda.is_available() else 1  # a CPU step builds no kernels

# name → (SRAdamW keyword arguments beyond lr and weight decay); every other argument is
# SRAdamW's default, as a user constructs it
SRADAMW_VARIANTS: dict[str, dict] = {
    "SRAdamW BF16 states": {"m_format": "bf16", "v_format": "bf16"},
    "SRAdamW FP8 states": {"m_format": "fp8", "v_format": "fp8"},
    "SRAdamW FP4 states": {"m_format": "fp4_e2m1", "v_format": "fp4_e2m2"},
    # as the trainer builds it: the sampled FP32 shadow on (optim.shadow_sample's default)
    "SRAdamW FP8 states, shadow 1/1024": {
        "m_format": "fp8",
        "v_format": "fp8",
        "shadow_sample": 1024,
    },
}
TORCH_BASELINE = "torch AdamW fused, FP32 states"
TORCHAO_VARIANTS = {
    "torchao AdamW8bit": "AdamW8bit",
    "torchao AdamWFp8": "AdamWFp8",
    "torchao AdamW4bit": "AdamW4bit",
}


def shard_shapes(preset: str, world: int, vocab_size: int) -> list[tuple[int, ...]]:
    """Rank 0's FSDP2 shard (a dim-0 chunk) of every parameter of ``preset`` at
    ``vocab_size`` on ``world`` ranks."""
    from srtrain.models import build_model

    shapes = []
    for p in build_model(preset, vocab_size, 1024).parameters():
        shapes.append((-(-p.shape[0] // world), *p.shape[1:]))
    return shapes


def optimizers() -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    """Every optimizer of the table, by row name, as a user would construct it."""
    from srtrain.optim import SRAdamW

    made: dict[str, Callable] = {
        TORCH_BASELINE: lambda ps: torch.optim.AdamW(
            ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        ),
    }
    for name, kwargs in SRADAMW_VARIANTS.items():
        made[name] = lambda ps, kw=kwargs: SRAdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, **kw)
    try:
        import torchao.optim as ao
    except ImportError:
        return made
    for name, cls_name in TORCHAO_VARIANTS.items():
        cls = getattr(ao, cls_name, None)
        if cls is not None:
            made[name] = lambda ps, c=cls: c(ps, lr=LR, weight_decay=WEIGHT_DECAY)
    return made


def step_times_us(opt: torch.optim.Optimizer, repeats: int) -> list[float]:
    """Time of each of ``repeats`` calls of ``opt.step()`` after warm-up steps (kernel
    builds, plans): CUDA events around the call, each started with the GPU idle (on a CPU,
    the wall clock)."""
    for _ in range(WARMUP_STEPS):
        opt.step()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - start) * 1e6)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return times


def optimizer_rows(preset: str, worlds: list[int], repeats: int, vocab_size: int) -> list[dict]:
    """One row per (world size, optimizer): the median step time and its quartiles."""
    rows = []
    for world in worlds:
        shapes = shard_shapes(preset, world, vocab_size)
        numel = sum(torch.Size(s).numel() for s in shapes)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes
        ]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        for name, make in optimizers().items():
            opt = make(params)
            times = step_times_us(opt, repeats)
            q1, _, q3 = statistics.quantiles(times, n=4)
            rows.append(
                {
                    "part": "optimizer",
                    "name": f"{preset} W={world}: {name}",
                    "world": world,
                    "tensors": len(shapes),
                    "numel": numel,
                    "step_us": statistics.median(times),
                    "step_us_q1": q1,
                    "step_us_q3": q3,
                }
            )
            del opt
            if device == "cuda":
                torch.cuda.empty_cache()
        del params
    return rows


def train_rows(config: str, overrides: list[str], name: str) -> list[dict]:
    """One training run of ``config`` with ``overrides`` through the trainer."""
    import torch.distributed as dist

    from srtrain.config import load_config
    from srtrain.trainer import run

    cfg = load_config(config, overrides)
    result = run(cfg)
    rates = result.tokens_per_s[1:] or result.tokens_per_s
    mfus = result.mfu[1:] or result.mfu
    row = {
        "part": "train",
        "name": name,
        "config": config,
        "overrides": overrides,
        "resolved": cfg.to_dict(),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_intervals": rates,
        "mfu": statistics.median(mfus),
        "peak_gib": result.peak_memory_gib,
        "final_loss": result.losses[-1] if result.losses else None,
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return [row]


def main(argv: list[str]) -> int:
    mode, out, *rest = argv
    if mode == "optimizer":
        preset, worlds, repeats, vocab_size = rest
        worlds = [int(w) for w in worlds.split(",")]
        rows = optimizer_rows(preset, worlds, int(repeats), int(vocab_size))
    elif mode == "train":
        name, config, *overrides = rest
        rows = train_rows(config, overrides, name)
    else:
        raise SystemExit(f"unknown mode {mode!r}: optimizer or train")
    Path(out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
