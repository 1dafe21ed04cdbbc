"""Reset schedules: periodic, theory-derived and adaptive (all-reduced across ranks)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from srtrain.optim.resets import ResetSchedule
from srtrain.theory import reset_period

from distributed import free_port


def test_periodic_and_theory_periods():
    # a v reset restarts m too; m may still reset alone
    s = ResetSchedule("periodic", m_period=3, v_period=5)
    due = {step: s.after_step(step) for step in range(1, 16)}
    assert [k for k, v in due.items() if "m" in v] == [3, 5, 6, 9, 10, 12, 15]
    assert due[5] == ["m", "v"] and due[6] == ["m"] and s.ages == {"m": 0, "v": 0}
    formats = {"m": "fp8", "v": "fp8"}
    t = ResetSchedule(
        "theory",
        formats=formats,
        roundings={"m": "stochastic", "v": "stochastic"},
        betas={"m": 0.9, "v": 0.999},
        states="v",
    )
    assert t.periods == {"m": 0, "v": reset_period("fp8", 0.999, "stochastic", "v", 200.0)}
    assert ResetSchedule("none").after_step(1000) == []


def _adaptive(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    s = ResetSchedule("adaptive", threshold=0.5, window=4, min_age=6)
    decisions = []
    for step in range(1, 25):
        # rank 0 sees mostly stalled v, rank 1 mostly moving: only the global fraction counts
        stalled_v = 9 if rank == 0 else 2 if step < 12 else 5
        counts = torch.tensor([[1, stalled_v, 0, 0]], dtype=torch.int64)
        s.observe(counts, local_elements=10)
        decisions.append(s.after_step(step))
    torch.save({"decisions": decisions, "fractions": s.last_fractions}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_adaptive_decides_alike_on_every_rank(tmp_path):
    out = str(tmp_path / "decisions")
    mp.spawn(_adaptive, args=(2, free_port(), out), nprocs=2, join=True)
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert r0 == r1
    due_steps = [i + 1 for i, d in enumerate(r0["decisions"]) if d]
    # global v fraction (9+2)/20 = 0.55 > 0.5 from the first window; min_age 6 delays to step 8
    assert due_steps[0] == 8 and all(r0["decisions"][i - 1] == ["m", "v"] for i in due_steps)
    assert r0["fractions"]["v"] == (9 + 5) / 20
    assert os.path.exists(f"{out}.0")
