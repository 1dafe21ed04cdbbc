"""The one-node benchmark (``python -m srtrain.bench.node``): its plumbing on the CPU with
``--dry`` (gloo, 2 ranks, tiny shapes), its budget and its resumability. The numbers it is
for need a node of GPUs."""

from __future__ import annotations

import json
import math

import pytest

from srtrain.bench.node import PARTS, Budget, Node, NodeSettings, main


def test_scaling_sizes_double_up_to_the_node():
    def sizes(gpus: int) -> list[int]:
        return NodeSettings.for_run(False, gpus, 140.0).sizes()

    assert sizes(8) == [1, 2, 4, 8]
    assert sizes(6) == [1, 2, 4, 6]
    assert sizes(1) == [1]
    assert NodeSettings.for_run(True, 8, 140.0).sizes() == [1, 2]  # --dry: 2 ranks


def _node(tmp_path, minutes: float | None) -> Node:
    settings = NodeSettings.for_run(True, 2, 140.0)
    return Node(
        tmp_path / "out",
        tmp_path / "scratch",
        settings,
        Budget(minutes, 60.0),
        {"command": "test"},
        log=lambda line: None,
    )


def test_a_spent_budget_records_every_launch_as_skipped(tmp_path):
    node = _node(tmp_path, minutes=0.0)
    result = node.run_part("scaling")
    assert result["status"] == "partial"
    assert [r["gpus"] for r in result["rows"]] == [1, 2] * len(node.settings.variants)
    assert all(r["skipped"] and not r["fit"] for r in result["rows"])
    assert node.launches == 0
    written = json.loads((node.out / "scaling.json").read_text())
    assert written["status"] == "partial" and written["environment"]["gpus"] == 2


def test_a_part_recorded_ok_is_not_run_again(tmp_path):
    node = _node(tmp_path, minutes=0.0)
    (node.out / "hsdp.json").write_text(json.dumps({"part": "hsdp", "status": "ok"}))
    assert node.run_part("hsdp") == {"part": "hsdp", "status": "ok"}
    assert node.run_part("hsdp", force=True)["status"] == "partial"  # budget: skipped


def test_unknown_parts_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--dry", "--out", str(tmp_path), "--parts", "70b,nope"])
    assert err.value.code == 2
    assert "--parts: unknown nope" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_runs_every_part_on_cpu(tmp_path):
    """Every part through torchrun on 2 gloo ranks; one scaling variant to keep it short."""
    out = tmp_path / "node"
    assert main(["--dry", "--out", str(out), "--variants", "fp4-bf16w"]) == 0
    results = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS}
    for part, result in results.items():
        assert result["status"] == "ok", (part, result["summary"])
        env = result["environment"]
        assert env["command"].startswith("python -m srtrain.bench.node --dry")
        assert env["date"] and env["commit"] and env["gpus"] == 2

    big = results["70b"]["summary"]["fp4-bf16w"]
    assert big["loss_fell"]  # the same batch every step: a model that trains learns it
    assert len(big["per_rank_peak_allocated_gib"]) == 2 and big["predicted_gib"] > 0
    assert results["70b"]["summary"]["torch"]["fit"]  # on a CPU nothing runs out of memory

    assert results["70b-fp8"]["summary"]["largest_fitting"] == "2L"

    stalls = results["stalls"]["summary"]
    assert len(stalls["losses"]) == 3
    assert set(stalls["last_stalled_by_group"]["v"]) >= {"attention", "mlp", "embeddings"}
    assert 0 < stalls["predicted_stalls"]["v"] <= 1
    assert list((out / "stalls-run" / "tb").glob("events.out.tfevents.*"))

    scaling = results["scaling"]["summary"]["fp4-bf16w"]
    assert set(scaling) == {"1", "2"}
    assert scaling["2"]["efficiency"] > 0
    assert all(0 < scaling[n]["optimizer_share"] < 1 for n in scaling)

    hsdp = results["hsdp"]["summary"]
    assert hsdp["replicas_identical"] is True and hsdp["replica_bytes_compared"] > 0
    assert hsdp["steps"] == 4 and hsdp["hsdp 2x1"]["fit"] and hsdp["fsdp 2"]["fit"]

    checkpoint = results["checkpoint"]["summary"]
    assert set(checkpoint) == {"save sync", "save async", "load"}
    assert all(r["bytes"] > 0 and r["complete_s"] > 0 for r in checkpoint.values())

    resume = results["resume"]["summary"]
    assert resume["continued"] and resume["resumed_at"]["gpus"] == 1
    # the resumed run at half the ranks continues the straight run (the stalls part's)
    assert resume["max_abs_diff_from_straight"] < 1e-4
    assert all(math.isfinite(x) for x in resume["losses_before"] + resume["losses_after"])
