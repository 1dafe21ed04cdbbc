"""launch_plan makes the choices MultiStep made before it, case by case (recorded for the GPU
in tests/data/launch_plans_h200.json), and refuses choices it does not know."""

import json
from pathlib import Path

import pytest
import torch

from srtrain.kernels.launch_plan import LaunchPlan, launch_plan, run_length
from srtrain.kernels.layout import tile_layout
from srtrain.kernels.memory import tile_prefetch_ptx
from srtrain.numerics.formats import get_format

RECORDED = json.loads((Path(__file__).parent / "data" / "launch_plans_h200.json").read_text())


def _case_id(case: dict) -> str:
    return (
        f"{case['m_format']}-{case['v_format']}-{'sr' if case['stochastic'] else 'nr'}-"
        f"{case['param_dtype']}-{case['layout']}-{case['shapes']}-tile{case['tile']}"
    )


@pytest.mark.parametrize("case", RECORDED["cases"], ids=_case_id)
def test_launch_plan_reproduces_the_recorded_choices(case):
    """Tile, warps, registers, and per row alignment the table kept in registers, L2
    prefetch (and its PTX), quad loads, line stores, run accesses and element-wise access
    of every recorded GPU launch; the options since removed held their one value."""
    expected = case["expected"]
    dtype = getattr(torch, case["param_dtype"])
    m_fmt, v_fmt = get_format(case["m_format"]), get_format(case["v_format"])
    shapes = [tuple(s) for s in case["shapes"]]
    plan = launch_plan(
        shapes,
        dtype,
        dtype,
        m_fmt,
        v_fmt,
        case["block_size"],
        case["stochastic"],
        tile=case["tile"],
        hardware=True,
    )
    assert isinstance(plan, LaunchPlan)
    bs = tile_layout(shapes[0], (m_fmt, v_fmt), case["block_size"])[2]
    tb = max(1, plan.tile // bs)
    assert (tb, bs, tb * bs) == (expected["TB"], expected["BS"], expected["tile_elements"])
    assert (plan.num_warps, plan.max_registers) == (
        expected["num_warps"],
        expected["max_registers"],
    )
    assert plan.l2_every_thread == expected["l2_every_thread"]
    for aligned in (True, False):
        flags = expected["aligned" if aligned else "unaligned"]
        access = plan.access(aligned)
        assert {
            "SCALAR": access.scalar,
            "KEEP": access.keep_table,
            "L2_AHEAD": int(access.l2_ahead),
            "QUAD_LOADS": access.quad_loads,
            "LINE_STORES": access.line_stores,
            "RUN_ACCESSES": access.run_accesses,
            "RUN": run_length(tb, bs, plan.num_warps),
        } == {
            k: flags[k]
            for k in (
                "SCALAR",
                "KEEP",
                "L2_AHEAD",
                "QUAD_LOADS",
                "LINE_STORES",
                "RUN_ACCESSES",
                "RUN",
            )
        }
        assert (
            tile_prefetch_ptx(
                tb, bs, dtype.itemsize, dtype.itemsize, m_fmt, v_fmt, aligned, plan.l2_every_thread
            )
            == (RECORDED["l2_ptx"][flags["L2_PTX"]])
        )
        # removed options: registers-ahead loads of unscaled states only, full tiles
        # unmasked, square roots grouped
        assert (flags["PREFETCH"], flags["SPLIT"], flags["GROUPED_SQRT"]) == (
            expected["FLAT"],
            True,
            True,
        )


def test_launch_plan_choices_and_their_errors():
    """Choices replace the plan's own; an access a launch cannot make stays off; unknown
    choices and bad values are refused with one line naming them."""
    fp8, bf16 = get_format("fp8"), get_format("bf16")
    shapes = [(4, 64)]
    base = launch_plan(shapes, torch.float32, torch.float32, fp8, fp8, 32, True, hardware=True)
    chosen = launch_plan(
        shapes,
        torch.float32,
        torch.float32,
        fp8,
        fp8,
        32,
        True,
        hardware=True,
        num_warps=4,
        max_registers=None,
        quad_loads=False,
    )
    assert (chosen.num_warps, chosen.max_registers) == (4, None)
    assert base.aligned.quad_loads and not chosen.aligned.quad_loads
    flat = launch_plan(
        shapes,
        torch.float32,
        torch.float32,
        bf16,
        bf16,
        32,
        True,
        hardware=True,
        quad_loads=True,
        l2_ahead=1,
    )
    assert not flat.aligned.quad_loads and flat.aligned.l2_ahead
    interpreted = launch_plan(
        shapes, torch.float32, torch.float32, fp8, fp8, 32, False, hardware=False
    )
    assert not any(
        (
            interpreted.unaligned.scalar,
            interpreted.aligned.quad_loads,
            interpreted.unaligned.line_stores,
            interpreted.aligned.l2_ahead,
        )
    )
    for choice, match in (
        ({"num_warps": "few"}, "num_warps must be"),
        ({"max_registers": "many"}, "max_registers must be"),
        ({"l2_ahead": 2}, "l2_ahead must be"),
        ({"l2_ahead": True}, "l2_ahead must be"),
        ({"l2_every_thread": 1}, "l2_every_thread must be"),
        ({"quad_loads": 1}, "quad_loads must be"),
        ({"line_stores": 1}, "line_stores must be"),
        ({"run_accesses": "yes"}, "run_accesses must be"),
        ({"full_tiles": False}, "unknown launch choice 'full_tiles'"),
        ({"grouped_sqrt": False}, "unknown launch choice"),
        ({"prefetch": True}, "unknown launch choice"),
    ):
        with pytest.raises(ValueError, match=match):
            launch_plan(shapes, torch.float32, torch.float32, fp8, fp8, 32, True, **choice)
    with pytest.raises(ValueError, match="tile must be"):
        launch_plan(shapes, torch.float32, torch.float32, fp8, fp8, 32, True, tile=300)
