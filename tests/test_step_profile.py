"""``experiments/step_profile.py``: the per-step breakdown of a profiler trace (spans
unioned and clipped to each step, the profiler's enclosing span dropped), and a real run of
the tiny model under it on the CPU."""

from __future__ import annotations

import json

from experiments.step_profile import innermost, main, step_breakdown, summarize, union_us


def _span(name: str, ts: float, dur: float, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_union_clips_and_merges_overlaps():
    assert union_us([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert union_us([(0, 10), (2, 4)], 0, 100) == 10  # nested
    assert union_us([(0, 10), (20, 30)], 5, 25) == 10  # clipped to the step
    assert union_us([], 0, 10) == 0


def test_the_enclosing_span_is_dropped():
    assert innermost([(0, 100), (0, 40), (40, 100)]) == [(0, 40), (40, 100)]
    assert innermost([(0, 40), (40, 100)]) == [(0, 40), (40, 100)]


def test_a_trace_breaks_down_per_step():
    trace = {
        "traceEvents": [
            _span("ProfilerStep#9", 0, 200),  # the profiler's span around both steps
            _span("ProfilerStep#10", 0, 100),
            _span("ProfilerStep#11", 100, 100),
            _span("FSDP::pre_forward", 10, 20),
            _span("FSDP::all_gather", 15, 10),  # inside the hook: counted once
            _span("Optimizer.step#SRAdamW.step", 80, 15),
            _span("Torch-Compiled Region: 0/0", 110, 50),
            _span("void kernel_a", 20, 30, "kernel"),
            _span("void kernel_b", 40, 20, "kernel"),  # overlaps kernel_a: busy 40 in step 10
            _span("Memcpy HtoD", 150, 60, "gpu_memcpy"),  # crosses into nothing past 200
            {"ph": "i", "name": "instant", "ts": 5},
        ]
    }
    first, second = step_breakdown(trace)
    assert (first["start_us"], first["wall_us"], first["gpu_busy_us"]) == (0, 100, 40)
    assert first["FSDP2 hooks and collectives"] == 20 and first["optimizer step"] == 15
    assert first["compiled code"] == 0
    assert (second["gpu_busy_us"], second["compiled code"]) == (50, 50)
    summary = summarize([first, second])
    assert summary["steps"] == 2 and summary["gpu_busy_us share"] == 0.45
    no_gpu = step_breakdown({"traceEvents": trace["traceEvents"][:7]})
    assert no_gpu[0]["gpu_busy_us"] is None and "gpu_busy_us" not in summarize(no_gpu)


def test_the_tiny_model_profiles_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(
        ["--json", str(out), "--window", "3", "configs/tiny.yaml", "train.steps=6",
         f"train.run_dir={tmp_path / 'run'}", "train.val_interval=0",
         "checkpoint.enabled=false"]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["steps"] == 3 and len(data["steps"]) == 3
    assert "gpu_busy_us" not in summary  # no GPU here
    assert 0 < summary["optimizer step share"] <= 1
    assert data["environment"]["command"].startswith("python -m experiments.step_profile")
    assert "optimizer step" in capsys.readouterr().out
