"""The reset-burst numbers, table and figure on small synthetic runs with known values."""

from __future__ import annotations

import pytest

from experiments.study import plots
from experiments.study.bursts import burst_grid, reset_bursts, twin_name
from experiments.study.report import (
    GridData,
    RunData,
    burst_section,
    burst_table,
    loss_table,
    seeds_table,
    val_steps_table,
)

STEPS = 200
PERIOD = 60
RESETS = [60, 120, 180]
RESET_RUN, TWIN = "a-sr-resets-rewarm-seed1", "a-sr-seed1"


def _since_reset(step: int) -> int | None:
    """Steps since the latest reset before ``step`` (None before the first)."""
    last = max((r for r in RESETS if r < step), default=None)
    return None if last is None else step - last


def _run(name: str, records: list[dict], resets: list[int], val: dict[str, float]) -> RunData:
    entry = {
        "name": name,
        "status": "complete",
        "steps_reached": STEPS,
        "steps_total": STEPS,
        "resets": {"m": list(resets), "v": list(resets)},
        "val_loss": val,
    }
    config = {"resets": {"mode": "periodic" if resets else "none"}, "optim": {}}
    return RunData(entry, config, records)


def _reset_run() -> RunData:
    """Update RMS 0.2 + 0.8/k at k = 1..50 steps after a reset (0.2 at other log steps); loss
    0.1 above the twin's 1..30 steps after a reset, 0.05 above it later, equal before."""
    records = []
    for step in range(1, STEPS + 1):
        k = _since_reset(step)
        gap = 0.0 if k is None else (0.1 if k <= 30 else 0.05)
        record = {"step": step, "loss": 2.0 + gap}
        if k is not None and k <= 50:
            record["update_rms"] = 0.2 + 0.8 / k
        if step % 10 == 0:
            record.update(stall_m=0.5, stall_v=0.9)
            record.setdefault("update_rms", 0.2)
        records.append(record)
    return _run(RESET_RUN, records, RESETS, {"100": 3.2})


def _plain_run(name: str, val: dict[str, float]) -> RunData:
    """Loss 2.0 every step; update RMS 0.5 at log steps up to the first reset, 0.3 after."""
    records = []
    for step in range(1, STEPS + 1):
        record = {"step": step, "loss": 2.0}
        if step % 10 == 0:
            record.update(stall_m=0.5, stall_v=0.9, update_rms=0.5 if step <= 60 else 0.3)
        records.append(record)
    return _run(name, records, [], val)


def _grid() -> GridData:
    grid = GridData("resets")
    grid.add(_plain_run("fp32", {"100": 3.0, "200": 2.5}))
    grid.add(_plain_run("fp32-seed1", {"100": 3.05, "200": 2.55}))
    grid.add(_plain_run(TWIN, {"100": 3.1, "200": 2.6}))
    grid.add(_reset_run())
    return grid


def _cells(lines: list[str], name: str) -> list[str]:
    row = next(line for line in lines if line.startswith(f"| {name} |"))
    return [c.strip() for c in row.strip("|").split("|")]


@pytest.mark.parametrize(
    ("name", "twin"),
    [
        ("fp4-sr-resets", "fp4-sr"),
        ("fp32-resets-rewarm", "fp32"),
        ("bf16-sr-resets-rewarm-seed1", "bf16-sr-seed1"),
        ("fp8-sr", None),
    ],
)
def test_twin_drops_the_resets_part_and_keeps_the_seed(name, twin):
    assert twin_name(name) == twin


def test_burst_numbers_follow_the_resets():
    (burst,) = reset_bursts(_grid())
    assert (burst.name, burst.twin, burst.period, burst.resets) == (RESET_RUN, TWIN, 60, RESETS)
    assert burst.rms_at(1) == pytest.approx(1.0)
    assert burst.rms_at(10) == pytest.approx(0.28)
    assert burst.rms_at(50) == pytest.approx(0.216)
    assert burst.rms_at(0) == pytest.approx(0.2)  # the reset steps are log steps
    assert burst.twin_rms == pytest.approx(0.3)  # log steps after the first reset only
    # before a reset: the first reset follows identical losses, the other two a gap of 0.05
    assert burst.gap_before == pytest.approx(0.05 * 2 / 3)
    assert burst.gap_peak == pytest.approx(0.1)
    assert burst.gap_late == pytest.approx(0.05)
    assert min(burst.gap) == -20 and max(burst.gap) == PERIOD


def test_burst_table_and_validation_table():
    grid = _grid()
    assert _cells(burst_table(grid), RESET_RUN) == [
        RESET_RUN,
        TWIN,
        "60",
        "3",
        "1.000",
        "0.280",
        "0.216",
        "0.300",
        "+0.0333",
        "+0.1000",
        "+0.0500",
    ]
    assert all(not line.startswith(("| fp32 |", f"| {TWIN} |")) for line in burst_table(grid))
    val = val_steps_table(grid)
    assert val[0] == "| run | 100 | 200 |"
    assert _cells(val, "fp32") == ["fp32", "3.0000", "2.5000"]
    assert _cells(val, "fp32-seed1") == ["fp32-seed1", "3.0500", "2.5500"]
    # each run against the fp32 run of its own seed; a blank where it did not get
    assert _cells(val, TWIN) == [TWIN, "+0.0500", "+0.0500"]
    assert _cells(val, RESET_RUN) == [RESET_RUN, "+0.1500", "–"]
    assert any("what a reset of v does" in line for line in burst_section(grid))


def test_loss_table_compares_with_the_fp32_run_of_the_same_seed_at_the_same_steps():
    grid = _grid()
    states = {"m_format": "fp8", "v_format": "fp8", "m_rounding": "stochastic"}
    for run in grid.runs.values():
        run.config["optim"] = {**states, "v_rounding": "stochastic"}
        run.entry["final_val_step"] = max(int(k) for k in run.entry["val_loss"])
        run.entry["final_val_loss"] = run.entry["val_loss"][str(run.entry["final_val_step"])]
    row = _cells(loss_table(grid), RESET_RUN)
    assert row[5:7] == ["3.2000", "+0.1500"]  # at step 100, fp32-seed1's 3.05
    # train loss over steps 101..200: 0.1 above the twin for 50 steps, 0.05 for 50
    assert row[8] == "+0.0750"


def test_seeds_table_mean_and_half_range_over_seeds():
    grid = GridData("resets")
    grid.add(_plain_run("fp32", {"100": 3.0, "200": 2.0}))
    grid.add(_plain_run("fp32-seed1", {"100": 3.2}))
    grid.add(_plain_run("b", {"100": 3.1, "200": 2.1}))
    grid.add(_plain_run("b-seed1", {"100": 3.5}))
    grid.add(_plain_run("c", {"100": 3.3}))  # one seed: not in the table
    table = seeds_table(grid)
    assert table[0] == "| run | seeds | 100 |"  # step 200: one seed only
    assert _cells(table, "fp32") == ["fp32", "2", "3.1000 ± 0.1000"]
    assert _cells(table, "b") == ["b", "2", "+0.2000 ± 0.1000"]
    assert not any(line.startswith("| c |") for line in table)
    assert seeds_table(GridData("none")) == []


def test_figure_is_written_with_and_without_reset_runs(tmp_path):
    grid = _grid()
    other = GridData("ablation")
    other.add(_plain_run("fp32", {"100": 3.0}))
    assert burst_grid({"ablation": other, "resets": grid}) is grid
    path = plots.reset_burst({"ablation": other, "resets": grid}, tmp_path / "burst.png")
    assert path.stat().st_size > 20_000
    assert burst_grid({"ablation": other}) is None
    empty = plots.reset_burst({"ablation": other}, tmp_path / "empty.png")
    assert 0 < empty.stat().st_size < path.stat().st_size


def test_resets_text_names_periods_and_resets_with_another_state():
    from experiments.study.report import resets_text

    both = {"m": [898, 223, 446], "v": [223, 446]}
    both["m"].sort()
    assert resets_text({"resets": both}) == "m every 898 and with v (3×), v every 223 (2×)"
    assert resets_text({"resets": {"m": [409, 818], "v": [409, 818]}}) == (
        "m every 409 (2×), v every 409 (2×)"
    )
    assert resets_text({"resets": {"v": [100, 350, 400]}}) == "v irregular (3×)"
    assert resets_text({"resets": {"m": [], "v": []}}) == "none"
