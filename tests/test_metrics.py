"""Stall aggregation across real gloo ranks, throughput/MFU, console lines, TensorBoard tags."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.study.summary import summarize
from srtrain.console import StepProgress
from srtrain.metrics import (
    MEMORY_MAXRSS,
    METRICS_FILE,
    MetricsLogger,
    StallAggregator,
    StallReport,
    ThroughputMeter,
    append_records,
    format_log_line,
    model_flops_utilization,
    parse_records,
    peak_flops,
    peak_memory_gib,
    read_records,
    trim_records,
)
from srtrain.numerics.adamw import (
    COUNT_M_SATURATED,
    COUNT_M_SCALE_CHANGED,
    COUNT_M_UNDERFLOW,
    COUNT_V_SATURATED,
    COUNT_V_SCALE_CHANGED,
    COUNT_V_UNDERFLOW,
    NUM_COUNTS,
    NUM_STALL_COUNTS,
)
from srtrain.param_groups import GROUPS

from distributed import free_port
from tb_server import read_tensorboard_scalars

WORLD = 2
PARAM_GROUPS = ["embeddings", "attention", "attention", "mlp", "mlp", "norms", "head"]
STEP_WINDOWS = [[1, 1, 3], [2]]  # steps covered by each accumulate call, per report window
# (steps, of which health steps) of each accumulate call, per report window
HEALTH_WINDOWS = [[(1, 1), (1, 0), (3, 1)], [(2, 0)], [(4, 2), (1, 0)]]


def rank_numels(rank: int) -> list[int]:
    """Local shard sizes; one parameter is large enough that counts pass 2**31."""
    return [5_000_000_000 + rank, 1000 + 7 * rank, 333, 4096 * (rank + 1), 17, 64 - rank, 0]


def rank_blocks(rank: int) -> list[tuple[int, int]]:
    """Local (m, v) block counts: m unscaled but in the mlp (as a group may hold another
    format), v's blocks everywhere but in the head's empty shard and the norms."""
    return [
        ((n + 31) // 32 if group == "mlp" else 0, 0 if group == "norms" else (n + 31) // 32)
        for n, group in zip(rank_numels(rank), PARAM_GROUPS, strict=True)
    ]


def rank_counts(rank: int, window: int, call: int, steps: int) -> torch.Tensor:
    """Known [P, NUM_COUNTS] counts for one accumulate call: each at most numel × steps
    (scale changes: blocks × steps)."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * window + call)
    limits = torch.tensor(rank_numels(rank), dtype=torch.int64)[:, None].repeat(1, NUM_COUNTS)
    blocks = torch.tensor(rank_blocks(rank), dtype=torch.int64)
    limits[:, [COUNT_M_SCALE_CHANGED, COUNT_V_SCALE_CHANGED]] = blocks
    frac = torch.rand(len(PARAM_GROUPS), NUM_COUNTS, generator=gen, dtype=torch.float64)
    return (frac * (limits * steps).double()).to(torch.int64)


def call_counts(rank: int, window: int, call: int, steps: int, health: int) -> torch.Tensor:
    """:func:`rank_counts` of a call of ``steps`` steps whose health counts cover ``health``
    of them."""
    counts = rank_counts(rank, window, call, steps)
    counts[:, NUM_STALL_COUNTS:] = rank_counts(rank, window, call, health)[:, NUM_STALL_COUNTS:]
    return counts


def all_health(windows: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Windows of calls whose steps all count the health counts."""
    return [[(steps, steps) for steps in window] for window in windows]


def expected_report(window: int, windows: list[list[tuple[int, int]]] | None = None) -> dict:
    """The global report for one window of ``windows`` (each call's steps and health steps;
    default :data:`STEP_WINDOWS`, every step counting health), summed by hand over both
    ranks."""
    windows = windows or all_health(STEP_WINDOWS)
    counts = {g: [0] * NUM_COUNTS for g in GROUPS}
    # element-steps; over the health steps: element-steps, m block-steps, v block-steps
    sizes = {g: [0, 0, 0, 0] for g in GROUPS}
    for rank in range(WORLD):
        for call, (steps, health) in enumerate(windows[window]):
            c = call_counts(rank, window, call, steps, health).tolist()
            for p, group in enumerate(PARAM_GROUPS):
                for col in range(NUM_COUNTS):
                    counts[group][col] += c[p][col]
                sizes[group][0] += rank_numels(rank)[p] * steps
                sizes[group][1] += rank_numels(rank)[p] * health
                sizes[group][2] += rank_blocks(rank)[p][0] * health
                sizes[group][3] += rank_blocks(rank)[p][1] * health
    present = {g: row for g, row in counts.items() if sizes[g][0] > 0}
    total = [sum(row[col] for row in counts.values()) for col in range(NUM_COUNTS)]
    element_steps = sum(size[0] for size in sizes.values())
    state_counts, by_group = {}, {}
    for tag, col, size_col in (
        ("underflow/m", COUNT_M_UNDERFLOW, 1),
        ("underflow/v", COUNT_V_UNDERFLOW, 1),
        ("saturated/m", COUNT_M_SATURATED, 1),
        ("saturated/v", COUNT_V_SATURATED, 1),
        ("scale_changed/m", COUNT_M_SCALE_CHANGED, 2),
        ("scale_changed/v", COUNT_V_SCALE_CHANGED, 3),
    ):
        size = sum(s[size_col] for s in sizes.values())
        if not size:
            continue
        state_counts[tag] = total[col] / size
        by_group[tag] = {
            g: row[col] / sizes[g][size_col] for g, row in present.items() if sizes[g][size_col]
        }
    return {
        "element_steps": element_steps,
        "stalled": {"m": total[0] / element_steps, "v": total[1] / element_steps},
        "stalled_by_group": {
            state: {g: row[col] / sizes[g][0] for g, row in present.items()}
            for col, state in enumerate(("m", "v"))
        },
        "param_changed": total[2] / element_steps,
        "param_changed_by_group": {g: row[2] / sizes[g][0] for g, row in present.items()},
        "nonfinite_grad_elements": total[3],
        "state_counts": state_counts,
        "state_counts_by_group": by_group,
        "health_steps": sum(health for _, health in windows[window]),
    }


def _aggregate_worker(
    rank: int, port: int, out_dir: str, windows: list[list[tuple[int, int]]]
) -> None:
    """One rank: accumulate known counts over ``windows`` (each call's steps and health
    steps; a call whose steps all count health leaves them to the default), reduce each,
    save the reports."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        agg = StallAggregator(PARAM_GROUPS, rank_numels(rank), "cpu", rank_blocks(rank))
        results = []
        for window, calls_steps in enumerate(windows):
            for call, (steps, health) in enumerate(calls_steps):
                sampled = {} if health == steps else {"health_steps": health}
                agg.accumulate(call_counts(rank, window, call, steps, health), steps, **sampled)
            if window == 0:
                agg.note_skipped_step()
            before = len(calls)
            report = agg.reduce()
            results.append({"report": report.__dict__, "all_reduces": len(calls) - before})
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"windows": results}))
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


@pytest.mark.slow
def test_stall_fractions_reduced_across_two_ranks(tmp_path: Path) -> None:
    windows = all_health(STEP_WINDOWS)
    mp.spawn(_aggregate_worker, args=(free_port(), str(tmp_path), windows), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        windows = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())["windows"]
        for window, result in enumerate(windows):
            assert result["all_reduces"] == 1
            got, want = result["report"], expected_report(window)
            assert want["element_steps"] > 2**31
            for key, value in want.items():
                assert got[key] == value, (rank, window, key)
            assert got["steps"] == sum(STEP_WINDOWS[window])
            assert got["skipped_steps"] == (1 if window == 0 else 0)
            assert set(got["stalled_by_group"]["m"]) == {"embeddings", "attention", "mlp", "norms"}
            assert set(got["state_counts_by_group"]["scale_changed/m"]) == {"mlp"}
            assert set(got["state_counts_by_group"]["scale_changed/v"]) == {
                "embeddings",
                "attention",
                "mlp",
            }


@pytest.mark.slow
def test_health_fractions_over_the_steps_that_counted_them_across_two_ranks(
    tmp_path: Path,
) -> None:
    """Health counted on some steps of each window (none in the second): its fractions are
    over the element-steps and block-steps of those steps alone, the stall fractions over
    all steps; a window without such steps reports none."""
    mp.spawn(
        _aggregate_worker,
        args=(free_port(), str(tmp_path), HEALTH_WINDOWS),
        nprocs=WORLD,
        join=True,
    )
    for rank in range(WORLD):
        windows = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())["windows"]
        for window, result in enumerate(windows):
            assert result["all_reduces"] == 1
            got, want = result["report"], expected_report(window, HEALTH_WINDOWS)
            for key, value in want.items():
                assert got[key] == value, (rank, window, key)
            assert got["steps"] == sum(steps for steps, _ in HEALTH_WINDOWS[window])
        assert windows[0]["report"]["health_steps"] == 2
        assert windows[0]["report"]["state_counts"]["underflow/m"] > 0
        assert windows[1]["report"]["state_counts"] == {}
        assert windows[1]["report"]["state_counts_by_group"] == {}


def test_health_fractions_are_over_the_health_steps() -> None:
    """Two steps, one of which counted health: its counts are fractions of one step's
    elements (and blocks), the stall counts of two steps'."""
    agg = StallAggregator(["mlp", "head"], [10, 30], "cpu", [(0, 1), (0, 3)])
    agg.accumulate(
        torch.tensor([[4, 9, 1, 0, 1, 0, 2, 0, 0, 1], [30, 15, 3, 2, 0, 3, 0, 0, 0, 2]]), 2, 1
    )
    report = agg.reduce()
    assert report.steps == 2 and report.health_steps == 1 and report.element_steps == 80
    assert report.stalled == {"m": 34 / 80, "v": 24 / 80}
    assert report.state_counts == {
        "underflow/m": 1 / 40,
        "underflow/v": 3 / 40,
        "saturated/m": 2 / 40,
        "saturated/v": 0.0,
        "scale_changed/v": 3 / 4,
    }
    assert report.state_counts_by_group["scale_changed/v"] == {"mlp": 1.0, "head": 2 / 3}
    agg.accumulate(torch.zeros(2, NUM_COUNTS, dtype=torch.int64), 3, 0)
    quiet = agg.reduce()
    assert quiet.health_steps == 0 and quiet.state_counts == {} and quiet.stalled["m"] == 0.0
    with pytest.raises(ValueError, match="3 health steps of 2 steps"):
        agg.accumulate(torch.zeros(2, NUM_COUNTS, dtype=torch.int64), 2, 3)


def test_single_process_reduce_and_reset() -> None:
    agg = StallAggregator(["mlp", "head"], [10, 30], "cpu")
    agg.accumulate(torch.tensor([[4, 9, 1, 0, 1, 0, 2, 0, 0, 0], [30, 15, 3, 2, 0, 3, 0, 0, 0, 0]]))
    agg.accumulate(torch.tensor([[6, 9, 1, 0, 1, 0, 0, 0, 0, 0], [30, 15, 0, 0, 0, 1, 0, 0, 0, 0]]))
    report = agg.reduce()
    assert report.state_counts == {
        "underflow/m": 2 / 80,
        "underflow/v": 4 / 80,
        "saturated/m": 2 / 80,
        "saturated/v": 0.0,
    }  # no blocks: no scale changes
    assert report.state_counts_by_group["underflow/v"] == {"mlp": 0.0, "head": 4 / 60}
    assert report.steps == 2 and report.element_steps == 80
    assert report.stalled == {"m": 70 / 80, "v": 48 / 80}
    assert report.stalled_by_group == {
        "m": {"mlp": 0.5, "head": 1.0},
        "v": {"mlp": 0.9, "head": 0.5},
    }
    assert report.param_changed == 5 / 80
    assert report.param_changed_by_group == {"mlp": 0.1, "head": 0.05}
    assert report.nonfinite_grad_elements == 2 and report.skipped_steps == 0
    empty = agg.reduce()
    assert empty.steps == 0 and math.isnan(empty.stalled["m"]) and empty.stalled_by_group["m"] == {}


def test_aggregator_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="'ffn' is not one of"):
        StallAggregator(["ffn"], [4], "cpu")
    agg = StallAggregator(["mlp"], [4], "cpu")
    with pytest.raises(ValueError, match=r"expected \(1, 10\) and torch.int64"):
        agg.accumulate(torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="one \\(m, v\\) pair per parameter"):
        StallAggregator(["mlp"], [4], "cpu", [(1, 1), (1, 1)])


def test_throughput_mfu_and_memory() -> None:
    assert model_flops_utilization(6e9, 40_000.0, 989e12, 2) == 6e9 * 40_000.0 / (989e12 * 2)
    assert math.isnan(model_flops_utilization(6e9, 40_000.0, None, 2))
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", override=312e12) == 312e12
    meter = ThroughputMeter(flops_per_token=1e6, peak=1e9, world_size=2)
    meter.update(500)
    meter.update(1500)
    tokens_per_s, mfu = meter.measure()
    assert tokens_per_s > 0 and mfu == pytest.approx(1e6 * tokens_per_s / 2e9)
    assert meter.measure()[0] == 0.0
    gib, source = peak_memory_gib("cpu")
    assert source == MEMORY_MAXRSS and 0.01 < gib < 1024


def make_report(m: float, v: float, changed: float, nonfinite: int = 0, skipped: int = 0):
    """A StallReport with attention/mlp groups around the given overall fractions."""
    return StallReport(
        steps=10,
        element_steps=1000,
        stalled={"m": m, "v": v},
        stalled_by_group={
            "m": {"attention": m - 0.01, "mlp": m + 0.01},
            "v": {"attention": v - 0.02, "mlp": v + 0.02},
        },
        param_changed=changed,
        param_changed_by_group={"attention": changed / 2, "mlp": changed * 2},
        nonfinite_grad_elements=nonfinite,
        skipped_steps=skipped,
        state_counts={"underflow/m": m / 100, "scale_changed/v": v / 10},
        state_counts_by_group={
            "underflow/m": {"attention": m / 50, "mlp": 0.0},
            "scale_changed/v": {"mlp": v / 5},
        },
    )


def test_console_line_has_measured_and_predicted(tmp_path: Path) -> None:
    scalars = {
        "loss/train": 3.21456,
        "lr": 3e-4,
        "grad_norm": 0.8123,
        "throughput/tokens_per_s": 123456.7,
        "mfu": 0.4123,
        "memory/max_allocated_gib": 12.345,
    }
    report = make_report(0.8123, 0.9531, 0.25, nonfinite=7, skipped=1)
    line = format_log_line(120, scalars, report, {"m": 0.825, "v": 0.946}, resets={"v"})
    assert line == (
        "step 120 | loss 3.2146 | lr 3.000e-04 | gnorm 0.812 | 123,457 tok/s | mfu 41.2% | "
        "mem 12.35 GiB | stall m 0.812/0.825 v 0.953/0.946 chg 0.250 | "
        "nonfinite 7 skipped 1 | reset v"
    )
    cpu_line = format_log_line(
        5,
        {"memory/max_allocated_gib": 0.5},
        make_report(0.5, 0.5, 0.1),
        {},
        memory_source=MEMORY_MAXRSS,
    )
    assert "mem 0.50 GiB (maxrss)" in cpu_line and "stall m 0.500/n/a v 0.500/n/a" in cpu_line
    progress = StepProgress(300, elapsed_s=41.2, eta_s=570.9)
    timed = format_log_line(
        20,
        {"loss/train": 4.5, "throughput/tokens_per_s": 1000.0, "mfu": math.nan},
        progress=progress,
    )
    assert timed == (
        "step 20/300 | 0:00:41 elapsed, ETA 0:09:30 | loss 4.5000 | 1,000 tok/s | mfu n/a"
    )
    assert format_log_line(100, {"loss/val": 3.25}, progress=StepProgress(300)) == (
        "step 100/300 | val loss 3.2500"
    )

    out = io.StringIO()
    logger = MetricsLogger(tmp_path, rank=1, stream=out)
    logger.log_text("hello")
    logger.log_step(1, scalars, report, {"m": 0.8, "v": 0.9})
    logger.close()
    assert out.getvalue() == ""
    assert not (tmp_path / "tb").exists()


def test_unknown_mfu_is_left_out_of_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = io.StringIO()
    with MetricsLogger(tmp_path, rank=0, stream=out) as logger:
        logger.log_step(
            10, {"loss/train": 4.5, "mfu": math.nan}, progress=StepProgress(20, 3.0, 3.0)
        )
    assert out.getvalue() == "step 10/20 | 0:00:03 elapsed, ETA 0:00:03 | loss 4.5000 | mfu n/a\n"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss/train"]


def test_tensorboard_tags_read_back_over_http(tmp_path: Path) -> None:
    predicted = {"m": 0.825, "v": 0.946}
    steps = {
        10: (
            {
                "loss/train": 4.5,
                "lr": 1e-4,
                "grad_norm": 1.5,
                "throughput/tokens_per_s": 1000.0,
                "mfu": 0.3,
                "memory/max_allocated_gib": 1.25,
            },
            make_report(0.7, 0.9, 0.4, 3, 1),
        ),
        20: (
            {
                "loss/train": 4.0,
                "loss/val": 4.2,
                "lr": 2e-4,
                "grad_norm": 1.25,
                "throughput/tokens_per_s": 2000.0,
                "mfu": 0.35,
                "memory/max_allocated_gib": 1.5,
            },
            make_report(0.75, 0.92, 0.3),
        ),
        30: (
            {
                "loss/train": 3.5,
                "lr": 3e-4,
                "grad_norm": 1.0,
                "throughput/tokens_per_s": 3000.0,
                "mfu": 0.4,
                "memory/max_allocated_gib": 1.75,
            },
            make_report(0.8, 0.95, 0.2),
        ),
    }
    out = io.StringIO()
    with MetricsLogger(tmp_path, rank=0, stream=out) as logger:
        for step, (scalars, report) in steps.items():
            if step == 20:
                logger.log_reset(15, ["m"])
                logger.log_reset(20, ["v"])
            logger.log_step(step, scalars, report, predicted)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[1].endswith("reset m,v") and "reset" not in lines[2]

    expected: dict[str, list[tuple[int, float]]] = {}
    for step, (scalars, report) in steps.items():
        values = dict(scalars)
        values.update(
            {
                "stall/m": report.stalled["m"],
                "stall/v": report.stalled["v"],
                "stall/param_changed": report.param_changed,
                "stall_predicted/m": predicted["m"],
                "stall_predicted/v": predicted["v"],
                "nonfinite/grad_elements": report.nonfinite_grad_elements,
                "nonfinite/skipped_steps": report.skipped_steps,
            }
        )
        for state in ("m", "v"):
            for group, fraction in report.stalled_by_group[state].items():
                values[f"stall/{state}/{group}"] = fraction
        for tag, fraction in report.state_counts.items():
            values[tag] = fraction
            for group, value in report.state_counts_by_group[tag].items():
                values[f"{tag}/{group}"] = value
        for tag, value in values.items():
            expected.setdefault(tag, []).append((step, value))
    expected["reset/m"] = [(10, 0.0), (15, 1.0), (20, 0.0), (30, 0.0)]
    expected["reset/v"] = [(10, 0.0), (20, 1.0), (30, 0.0)]

    runs = read_tensorboard_scalars(tmp_path / "tb", expected, timeout_s=45)
    assert list(runs) == ["."]
    scalars = runs["."]
    for tag, series in expected.items():
        want = [(step, float(np.float32(value))) for step, value in series]
        assert scalars[tag] == want, tag


# ------------------------------------------------------------------ metrics.jsonl


def test_records_are_strict_json_and_read_back_as_nan(tmp_path: Path) -> None:
    append_records(
        tmp_path,
        [
            {"step": 1, "loss": 5.5, "grad_norm": 1.25},
            {"step": 2, "loss": math.nan, "grad_norm": math.inf, "lr": -math.inf},
        ],
    )
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    assert [json.loads(line, parse_constant=refuse) for line in lines][1] == {
        "step": 2,
        "loss": None,
        "grad_norm": None,
        "lr": None,
    }
    first, second = read_records(tmp_path)
    assert first == {"step": 1, "loss": 5.5, "grad_norm": 1.25}
    assert all(math.isnan(second[k]) for k in ("loss", "grad_norm", "lr"))
    # the study's summary takes null where a float was
    config = {
        "train": {"steps": 2},
        "resets": {"mode": "none", "m_period": 0, "v_period": 0},
        "optim": {
            **{"beta1": 0.9, "beta2": 0.999, "m_format": "bf16", "v_format": "bf16"},
            **{"m_rounding": "stochastic", "v_rounding": "stochastic"},
        },
    }
    summary = summarize(config, parse_records("\n".join(lines)), {"val_loss": {}, "resets": {}})
    assert summary["final_train_loss"] == 5.5 and summary["steps_reached"] == 2


def test_a_torn_last_line_is_dropped_with_one_notice(tmp_path: Path) -> None:
    append_records(tmp_path, [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)])
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 4, "loss": 0.2')  # a writer killed mid-line
    notices: list[str] = []
    assert [r["step"] for r in read_records(tmp_path, notices.append)] == [1, 2, 3]
    assert notices == [
        f"notice: {tmp_path / METRICS_FILE}: dropped 1 unreadable line(s): line 4 (the last "
        "line, cut short by a killed writer)"
    ]
    trim_records(tmp_path, 2)  # resuming from step 2 rewrites the file whole
    append_records(tmp_path, [{"step": 3, "loss": 0.5}])
    assert read_records(tmp_path, notices.append) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5},
        {"step": 3, "loss": 0.5},
    ]
    assert len(notices) == 1
    trim_records(tmp_path, 0)  # a start without a checkpoint: the history starts afresh
    assert read_records(tmp_path) == [] and (tmp_path / METRICS_FILE).read_text() == ""


_TRIM_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from srtrain.metrics import trim_records
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # over the limit a write kills the process
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
trim_records(sys.argv[1], int(sys.argv[2]))
"""


def test_a_kill_while_trimming_leaves_the_history(tmp_path: Path) -> None:
    """Resuming rewrites metrics.jsonl; a process killed while writing the kept records (by
    a file size limit, mid-write) leaves every record in place."""
    records = [{"step": s, "loss": 1.0 / s, "grad_norm": 0.5} for s in range(1, 201)]
    append_records(tmp_path, records)
    assert (tmp_path / METRICS_FILE).stat().st_size > 4000
    killed = subprocess.run(
        [sys.executable, "-c", _TRIM_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path), "150"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert read_records(tmp_path) == records
