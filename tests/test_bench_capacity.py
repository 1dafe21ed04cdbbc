"""The capacity benchmark: its ladder, its searches, one real trial through a subprocess on the
CPU, and the summary of recorded rows (the GPU measurements themselves need a CUDA device)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from srtrain.bench.__main__ import main
from srtrain.bench.capacity import (
    DRY_LADDER,
    ERROR,
    FIT,
    LADDER,
    OOM,
    Recorder,
    build_plan,
    launch_trial,
    planned_start,
    predicted_bytes,
    run_capacity,
    search_ladder,
    search_throughput,
    summarize,
    summary_table,
    trial_spec,
)
from srtrain.bench.capacity_trial import TrialSpec, error_line, is_oom, run_trial
from srtrain.models import Shape, build_model_from_config, count_params, shape_config


def _params(shape: Shape, vocab: int) -> int:
    return count_params(build_model_from_config(shape_config(shape, vocab, 2048)))


def test_ladder_rungs_are_named_by_their_parameter_counts():
    counts = {name: _params(shape, 32000) for name, shape in LADDER.items()}
    assert counts == {
        "7b": 6_738_415_616,
        "13b": 13_015_864_320,
        "20b": 20_325_095_424,
        "26b": 26_108_353_024,
        "30b": 30_388_746_752,
        "35b": 35_089_832_960,
        "40b": 40_037_129_216,
        "43b": 42_510_777_344,
        "46b": 45_790_993_920,
        "52b": 52_333_387_776,
    }
    for name, shape in LADDER.items():
        assert round(counts[name] / 1e9) == int(name.removesuffix("b"))
        assert shape.hidden == 128 * shape.heads  # head dimension 128, as LLaMA's
        assert shape.intermediate % 256 == 0
    assert list(counts.values()) == sorted(counts.values())
    dry = {name: _params(shape, 512) for name, shape in DRY_LADDER.items()}
    assert dry == {"0.5m": 526_976, "3.4m": 3_426_560}


def _ladder_oracle(capacity: int, errors: tuple[int, ...] = ()):
    """A trial function for rungs 0..5 where rungs up to ``capacity`` fit; records calls."""
    calls: list[int] = []

    def trial(rung: str) -> str:
        i = int(rung)
        calls.append(i)
        return ERROR if i in errors else FIT if i <= capacity else OOM

    return trial, calls


@pytest.mark.parametrize(
    ("start", "capacity", "largest", "tried"),
    [
        (0, 2, "2", [0, 1, 2, 3]),  # climb from the bottom to the first failure
        (2, 2, "2", [2, 3]),  # the start is the answer: one trial above it
        (4, 2, "2", [4, 3, 2]),  # the start fails: descend to the first fit
        (3, 5, "5", [3, 4, 5]),  # everything above fits: stop at the top
        (3, -1, None, [3, 2, 1, 0]),  # nothing fits
    ],
)
def test_ladder_search_tries_the_fewest_rungs(start, capacity, largest, tried):
    trial, calls = _ladder_oracle(capacity)
    rungs = [str(i) for i in range(6)]
    assert search_ladder(rungs, str(start), trial) == largest
    assert calls == tried


def test_ladder_search_stops_at_an_error():
    rungs = [str(i) for i in range(6)]
    trial, calls = _ladder_oracle(2, errors=(4,))
    assert search_ladder(rungs, "4", trial) is None  # a failure that is not memory
    assert calls == [4]
    trial, calls = _ladder_oracle(5, errors=(3,))
    assert search_ladder(rungs, "1", trial) == "2"
    assert calls == [1, 2, 3]


@pytest.mark.parametrize(
    ("fits_without", "fits_with", "tried"),
    [
        # checkpointing is tried only above the largest micro-batch that fits without it
        (2, 4, [(1, False), (2, False), (4, False), (4, True), (8, True)]),
        (0, 2, [(1, False), (1, True), (2, True), (4, True)]),
        (8, 8, [(1, False), (2, False), (4, False), (8, False)]),
    ],
)
def test_throughput_search_order(fits_without, fits_with, tried):
    calls = []

    def trial(mb: int, ac: bool) -> str:
        calls.append((mb, ac))
        return FIT if mb <= (fits_with if ac else fits_without) else OOM

    search_throughput([8, 4, 2, 1], trial)
    assert calls == tried


def test_throughput_search_stops_at_an_error():
    calls = []

    def trial(mb: int, ac: bool) -> str:
        calls.append((mb, ac))
        return ERROR if mb == 2 else FIT

    search_throughput([1, 2, 4, 8], trial)
    assert calls == [(1, False), (2, False)]


def _row(
    variant,
    rung,
    params,
    fit,
    *,
    search="ladder",
    oom=None,
    peak=100.0,
    tps=None,
    mb=1,
    ac=True,
    error=None,
) -> dict:
    row = {
        "variant": variant,
        "rung": rung,
        "params": params,
        "search": search,
        "fit": fit,
        "micro_batch": mb,
        "activation_checkpointing": ac,
    }
    if fit:
        row.update(
            peak_allocated_gib=peak, peak_reserved_gib=peak + 1.5, tokens_per_s=tps, mfu=tps / 20000
        )
    else:
        row.update(oom=oom, error=error or "OutOfMemoryError: CUDA out of memory")
    return row


def test_summary_and_ratios_from_recorded_rows():
    b7, b13, b26, b30 = 6_738_415_616, 13_015_864_320, 26_108_353_024, 30_388_746_752
    rows = [
        _row("torch", "7b", b7, True, peak=110.0, tps=3000.0),
        _row("torch", "13b", b13, False, oom=True),
        _row("fp4-bf16w", "26b", b26, True, peak=131.0, tps=800.0),
        _row("fp4-bf16w", "30b", b30, False, oom=True),
        _row("torch", "7b", b7, True, search="throughput", tps=9000.0, mb=2, ac=False),
        _row("torch", "7b", b7, False, search="throughput", oom=True, mb=4, ac=False),
        _row("torch", "7b", b7, True, search="throughput", tps=8500.0, mb=4),
        _row("fp4-bf16w", "7b", b7, True, search="throughput", tps=10800.0, mb=8, ac=False),
        _row("fp4-bf16w", "7b", b7, True, search="throughput", tps=10000.0, mb=4, ac=False),
        _row("fp8", "13b", b13, False, oom=False, error="RuntimeError: NCCL error"),
    ]
    summary = summarize(rows)
    torch_, fp4 = summary["torch"], summary["fp4-bf16w"]
    assert (torch_["largest"], torch_["params"], torch_["no_fit"]) == ("7b", b7, "13b")
    assert (fp4["largest"], fp4["params"], fp4["no_fit"]) == ("26b", b26, "30b")
    assert fp4["peak_allocated_gib"] == 131.0 and fp4["peak_reserved_gib"] == 132.5
    assert fp4["params_vs_torch"] == b26 / b7
    assert (torch_["tokens_per_s"], torch_["micro_batch"], torch_["activation_checkpointing"]) == (
        9000.0,
        2,
        False,
    )
    assert (fp4["tokens_per_s"], fp4["micro_batch"]) == (10800.0, 8)
    assert fp4["tokens_per_s_vs_torch"] == 1.2
    assert summary["fp8"] == {"errors": ["13b: RuntimeError: NCCL error"]}
    table = summary_table(summary).splitlines()
    fp4_line = next(line for line in table if line.startswith("fp4-bf16w"))
    assert fp4_line.split() == [
        "fp4-bf16w",
        "26b",
        "26.11B",
        "131.0",
        "132.5",
        "-",
        "3.87",
        "30b",
        "|",
        "10,800",
        "0.540",
        "8",
        "off",
        "1.20",
    ]
    assert "error: 13b: RuntimeError: NCCL error" in summary_table(summary)


def test_a_trial_that_runs_out_of_memory_says_so():
    # 2^46-element projections (256 TiB in FP32, past any address space): the CPU allocator
    # refuses them when the model is materialised, whatever the kernel's overcommit policy
    shape = Shape("llama", hidden=2**23, intermediate=128, heads=2**16, layers=1)
    spec = TrialSpec("torch", "huge", shape, 64, 1, True, 1, 1, device="cpu", vocab_size=512)
    row = run_trial(spec)
    assert row["fit"] is False and row["oom"] is True and row["phase"] == "init"
    assert row["params"] > 2**48
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert error_line(
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2 GiB. GPU 0 has\na total  capacity"
        )
    ) == (
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB. GPU 0 has a total capacity"
    )
    assert len(error_line(RuntimeError("x" * 1000))) == 500


def _dry_spec(variant: str, *overrides: str) -> TrialSpec:
    return TrialSpec(
        variant,
        "0.5m",
        DRY_LADDER["0.5m"],
        64,
        2,
        True,
        1,
        2,
        device="cpu",
        vocab_size=512,
        search="ladder",
        repeat_batch=True,
        overrides=overrides,
    )


def _grads_left(model, optimizer, mesh, info) -> dict:
    return {"grads_left": sum(p.grad is not None for p in model.parameters())}


def test_the_in_backward_variant_steps_as_the_trainer_does(monkeypatch):
    """fp4-bf16w-inbwd: per step StepInBackward's begin, forward/backward, finish, and no
    clip_grad_norm_, step or zero_grad; no gradient is left after a step. With clipping off
    it trains what the ordinary step trains, loss for loss."""
    import srtrain.parallel
    from srtrain.optim import SRAdamW
    from srtrain.optim.in_backward import StepInBackward

    calls = []

    def spy(name, original):
        def wrapped(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapped

    def refused(*args, **kwargs):
        raise AssertionError("the step inside backward calls no ordinary step")

    for name in ("begin", "finish"):
        monkeypatch.setattr(StepInBackward, name, spy(name, getattr(StepInBackward, name)))
    monkeypatch.setattr(SRAdamW, "step", refused)
    monkeypatch.setattr(SRAdamW, "zero_grad", refused)
    monkeypatch.setattr(srtrain.parallel, "clip_grad_norm_", refused)
    row = run_trial(_dry_spec("fp4-bf16w-inbwd"), after=_grads_left)
    assert row["fit"] is True, row
    assert calls == ["begin", "finish"] * 3 and row["grads_left"] == 0
    assert row["skipped_steps"] == 0 and row["losses"][-1] < row["losses"][0]
    monkeypatch.undo()

    inside = run_trial(_dry_spec("fp4-bf16w-inbwd", "optim.grad_clip=0"))
    ordinary = run_trial(_dry_spec("fp4-bf16w", "optim.grad_clip=0"))
    assert inside["fit"] and ordinary["fit"]
    assert inside["losses"] == ordinary["losses"]
    assert inside["params"] == ordinary["params"] == 526_976


def test_a_trial_past_its_timeout_is_killed_and_recorded():
    spec = TrialSpec(
        "torch",
        "0.5m",
        DRY_LADDER["0.5m"],
        64,
        1,
        True,
        1,
        1,
        device="cpu",
        vocab_size=512,
        search="ladder",
    )
    row = launch_trial(spec, timeout=0.5)
    assert row["fit"] is False and row["oom"] is False
    assert row["error"] == "timeout after 0.5 s"
    assert row["wall_s"] >= 0.5 and row["rung"] == "0.5m"


@pytest.mark.slow
def test_capacity_dry_run_trains_one_trial_in_a_subprocess(tmp_path, capsys):
    out = tmp_path / "capacity.json"
    assert (
        main(
            [
                "--capacity",
                "--dry",
                "--variants",
                "torch",
                "--rungs",
                "0.5m",
                "--no-throughput",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["fit"] is True, row
    assert (row["variant"], row["rung"], row["search"], row["device"]) == (
        "torch",
        "0.5m",
        "ladder",
        "cpu",
    )
    assert (row["params"], row["seq_len"], row["micro_batch"], row["vocab_size"]) == (
        526_976,
        64,
        1,
        512,
    )
    assert row["activation_checkpointing"] is True
    assert row["init_s"] > 0 and row["tokens_per_s"] > 0 and row["wall_s"] > row["init_s"]
    assert row["skipped_steps"] == 0
    assert row["predicted_gib"] > 0 and row["predicted_fits"] is True
    assert abs(row["final_loss"] - math.log(512)) < 0.5  # random tokens: about ln(vocab)
    assert result["summary"]["torch"]["largest"] == "0.5m"
    assert result["environment"]["commit"]
    assert result["settings"]["ladder"] == ["0.5m"]
    printed = capsys.readouterr().out
    assert f"{'torch':<{len('fp4-bf16w-inbwd')}} 0.5m mb 1 AC on  fit" in printed
    assert any(line.split()[:3] == ["torch", "0.5m", "0.53M"] for line in printed.splitlines())
    # the recorded file summarizes again without running anything
    assert main(["--capacity", "--report", str(out)]) == 0
    assert "torch" in capsys.readouterr().out


def test_a_spent_budget_runs_no_trial(tmp_path):
    plan = build_plan(dry=True, budget=1.0)
    messages = []
    recorder = Recorder(tmp_path / "r.json", {}, {})
    assert run_capacity(plan, recorder, progress=messages.append) == []
    assert messages == ["time budget spent: the remaining trials were not run"]


@pytest.mark.slow
def test_the_planner_picks_each_variants_start_rung():
    plan = build_plan()
    starts = {v: planned_start(plan, v) for v in plan.variants}
    assert starts == {
        "torch": "7b",
        "fp8": "13b",
        "fp8-bf16w": "20b",
        "fp4-bf16w": "26b",
        "fp4-bf16w-inbwd": "43b",
    }
    # the step inside backward drops the whole model's gradients from the plan, not the rest
    at_26b = {
        v: predicted_bytes(trial_spec(plan, v, "26b", "ladder"))
        for v in ("fp4-bf16w", "fp4-bf16w-inbwd")
    }
    gradients = 2 * _params(LADDER["26b"], 32000)
    assert 0.9 * gradients < at_26b["fp4-bf16w"] - at_26b["fp4-bf16w-inbwd"] < gradients
    # the prediction follows the trial's settings: checkpointing off holds more activations
    with_ac = predicted_bytes(trial_spec(plan, "torch", "7b", "throughput", 2, True))
    without = predicted_bytes(trial_spec(plan, "torch", "7b", "throughput", 2, False))
    assert 100 * 2**30 < with_ac < without < 139 * 2**30


def test_plan_from_command_line_values():
    plan = build_plan(rungs="26b,7b,13b", starts="fp4-bf16w=26b", micro_batches="4,1")
    assert plan.ladder == ["7b", "13b", "26b"]
    assert plan.starts == {"fp4-bf16w": "26b"}
    assert plan.variants == ["torch", "fp8", "fp8-bf16w", "fp4-bf16w", "fp4-bf16w-inbwd"]
    assert build_plan().ladder[-5:] == ["35b", "40b", "43b", "46b", "52b"]
    assert (plan.throughput_rung, plan.micro_batches, plan.seq_len, plan.device) == (
        "7b",
        (1, 4),
        2048,
        "cuda",
    )
    assert build_plan(throughput=False, ladder=False).ladder == []
    for kwargs, message in [
        ({"variants": "fp16"}, "unknown variant 'fp16'"),
        ({"starts": "torch=8b"}, "unknown start rung '8b'"),
        ({"starts": "torch"}, "must look like variant=rung"),
        ({"micro_batches": "0,2"}, "--micro-batches '0,2'"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_plan(**kwargs)
