"""The state-health table, report section and figure on small synthetic runs with known
values."""

from __future__ import annotations

import math

import pytest

from experiments.study import plots
from experiments.study.health import health_grid, health_rows
from experiments.study.report import GridData, RunData, StudyData, health_table, markdown

STEPS = 105  # log steps 10..100; steps 101..105 are plain steps
VAL = {"50": 3.5, "100": 3.25}


def _config(rounding: str, fmt: str = "fp4") -> dict:
    formats = {"fp4": ("fp4_e2m1", "fp4_e2m2"), "fp32": ("fp32", "fp32")}[fmt]
    return {
        "model": {"preset": "tiny", "seq_len": 8},
        "train": {"global_batch_size": 2, "steps": STEPS},
        "optim": {
            "lr": 1e-3,
            "beta2": 0.999,
            "m_format": formats[0],
            "v_format": formats[1],
            "m_rounding": rounding,
            "v_rounding": rounding,
        },
        "resets": {"mode": "none"},
    }


def _run(name: str, config: dict, shadow=None) -> RunData:
    """Loss 3.0 every step; stall fractions at log steps (every 10th up to 100), and
    ``shadow(step)``'s metrics there where given."""
    records = []
    for step in range(1, STEPS + 1):
        record = {"step": step, "loss": 3.0}
        if step % 10 == 0 and step <= 100:
            record.update(stall_m=0.4, stall_v=0.99)
            if shadow is not None:
                record.update(shadow(step))
        records.append(record)
    entry = {
        "name": name,
        "status": "complete",
        "steps_reached": STEPS,
        "steps_total": STEPS,
        "resets": {"m": [], "v": []},
        "val_loss": dict(VAL),
        "final_val_step": 100,
        "final_val_loss": VAL["100"],
    }
    return RunData(entry, config, records)


def _drifting(step: int) -> dict:
    """Nearest rounding: the cosine falls, rel_err m grows, bias v dips to -0.3 at step 30
    and ends at +0.1; rel_err v is not finite at the last log step."""
    return {
        "shadow_update_cosine": 0.9 - step / 1000,
        "shadow_rel_err_m": step / 100,
        "shadow_rel_err_v": math.nan if step == 100 else 0.5,
        "shadow_bias_m": 0.0,
        "shadow_bias_v": {30: -0.3, 100: 0.1}.get(step, -0.1),
        "underflow_m": 0.15,
        "saturated_m": 0.0123,
        "stall_m": 0.55,
    }


def _steady(step: int) -> dict:
    return {
        "shadow_update_cosine": 0.89,
        "shadow_rel_err_m": 0.45,
        "shadow_rel_err_v": 0.25,
        "shadow_bias_m": 0.0,
        "shadow_bias_v": 0.002 if step % 20 else -0.004,
        "underflow_m": 0.00036,
        "saturated_m": 0.0018,
    }


def _grid(name: str = "health") -> GridData:
    grid = GridData(name)
    grid.add(_run("fp4-nr", _config("nearest"), _drifting))
    grid.add(_run("old", _config("nearest")))  # recorded before the shadow existed
    grid.add(_run("fp4-sr", _config("stochastic"), _steady))
    return grid


def _cells(lines: list[str], name: str) -> list[str]:
    row = next(line for line in lines if line.startswith(f"| {name} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_health_table_reads_the_last_shadow_step_and_the_range_of_bias_v():
    table = health_table(_grid())
    assert table[0] == (
        "| run | states | step | val loss | update cosine | rel_err m | rel_err v | bias v | "
        "stall m | stall v | underflow m | saturated m | bias v min / max |"
    )
    assert _cells(table, "fp4-nr") == [
        "fp4-nr",
        "fp4_e2m1/fp4_e2m2 NR/NR",
        "100",  # the last log step, not the last step
        "3.2500",
        "0.800",
        "1.000",
        "–",  # not finite
        "+0.100",
        "0.550",
        "0.990",
        "0.1500",
        "0.0123",
        "-0.300 / +0.100",
    ]
    assert _cells(table, "fp4-sr")[4:] == [
        "0.890",
        "0.450",
        "0.250",
        "-0.004",
        "0.400",
        "0.990",
        "0.0004",
        "0.0018",
        "-0.004 / +0.002",
    ]
    assert not any(line.startswith("| old |") for line in table)
    assert [row.name for row in health_rows(_grid())] == ["fp4-nr", "fp4-sr"]


def test_health_grid_is_the_one_named_health_else_the_first_with_shadow_records():
    plain = GridData("ablation")
    plain.add(_run("old", _config("nearest")))
    other, health = _grid("other"), _grid("health")
    assert health_grid({"ablation": plain, "other": other, "health": health}) is health
    assert health_grid({"ablation": plain, "other": other}) is other
    assert health_grid({"ablation": plain}) is None


def test_report_has_the_health_section_only_with_shadow_records():
    plain = GridData("ablation")
    plain.add(_run("old", _config("nearest")))
    with_health = markdown(StudyData(grids={"ablation": plain, "health": _grid()}), [])
    assert "## Grid `health`: state health against the FP32 shadow" in with_health
    assert "| fp4-sr | fp4_e2m1/fp4_e2m2 SR/SR | 100 | 3.2500 | 0.890 |" in with_health
    without = markdown(StudyData(grids={"ablation": plain}), [])
    assert "state health" not in without


@pytest.fixture
def saved_figures(monkeypatch) -> list:
    """The figures the plots module saves, kept open for inspection."""
    figures = []
    save = plots._save

    def keep(fig, path):
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_health_figure_draws_a_line_per_shadow_run(tmp_path, saved_figures):
    path = plots.state_health({"health": _grid()}, tmp_path / "health.png")
    (fig,) = saved_figures
    axes = fig.axes
    assert len(axes) == 6
    cosine, rel_err_m, _, bias_v, _, loss = axes
    assert [line.get_label() for line in cosine.get_lines()] == ["fp4-nr", "fp4-sr"]
    assert [line.get_linestyle() for line in cosine.get_lines()] == ["--", "-"]
    assert cosine.get_yscale() == "logit" and rel_err_m.get_yscale() == "log"
    assert list(cosine.get_lines()[0].get_ydata()) == pytest.approx(
        [0.9 - s / 1000 for s in range(10, 101, 10)]
    )
    assert min(bias_v.get_lines()[0].get_ydata()) == pytest.approx(-0.3)
    # the moving average of the train loss and the validation dots, per run
    assert "fp4-nr (val 3.250)" in [line.get_label() for line in loss.get_lines()]
    dots = [line for line in loss.get_lines() if line.get_marker() == "o"]
    assert [list(d.get_xdata()) for d in dots] == [[50, 100], [50, 100]]
    assert path.stat().st_size > 20_000


def test_health_figure_falls_back_to_linear_axes_and_to_a_message(tmp_path, saved_figures):
    grid = _grid()
    exact = {"shadow_update_cosine": 1.0, "shadow_rel_err_m": 0.0, "shadow_bias_v": 0.0}
    grid.add(_run("fp32", _config("nearest", "fp32"), lambda step: exact))
    path = plots.state_health({"health": grid}, tmp_path / "health.png")
    cosine = saved_figures[0].axes[0]
    assert cosine.get_yscale() == "linear"  # a cosine of 1 has no logit
    assert len(cosine.get_lines()) == 3
    plain = GridData("ablation")
    plain.add(_run("old", _config("nearest")))
    empty = plots.state_health({"ablation": plain}, tmp_path / "empty.png")
    assert 0 < empty.stat().st_size < path.stat().st_size
    assert len(saved_figures) == 2 and not saved_figures[1].axes[0].get_lines()
