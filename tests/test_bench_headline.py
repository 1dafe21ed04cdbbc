"""The headline bench's guard and table: a slowdown that reproduces across rounds is
flagged, noise is not; the harness runs the real probe on each tree (CPU here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from srtrain.bench.capacity import parse_names
from srtrain.bench.headline import (
    PARTS,
    TRAIN_VARIANTS,
    Settings,
    capacity_section,
    compare,
    device_slug,
    latest_capacity_files,
    record,
    regressions,
    render_markdown,
    run_headline,
    run_rounds,
    verdict_table,
)
from srtrain.bench.headline_probe import TORCH_BASELINE
from srtrain.bench.trees import commit_digest, tree_digest

SRC = Path(__file__).resolve().parent.parent / "src"


def _verdicts(before: dict, after: dict, tolerance: float = 0.01) -> dict:
    return {(v["row"], v["measure"]): v["verdict"] for v in compare(before, after, tolerance)}


def test_a_planted_slowdown_is_flagged_and_noise_is_not():
    before = {
        "step A": {"step_us": [1000.0, 1012.0]},
        "step B": {"step_us": [1000.0, 1100.0]},
        "run C": {"tokens_per_s": [50_000.0, 50_400.0], "peak_gib": [40.0, 40.0]},
        "step D": {"step_us": [1000.0, 1001.0]},
    }
    after = {
        "step A": {"step_us": [1100.0, 1108.0]},  # +9.7% in both rounds: a regression
        "step B": {"step_us": [1060.0, 990.0]},  # inside the 10% spread B showed
        "run C": {"tokens_per_s": [45_000.0, 45_300.0], "peak_gib": [40.0, 40.0]},
        "step D": {"step_us": [1004.0, 1005.0]},  # apart, but +0.4%: under the tolerance
    }
    verdicts = _verdicts(before, after)
    assert verdicts == {
        ("step A", "step_us"): "worse",
        ("step B", "step_us"): "within noise",
        ("run C", "tokens_per_s"): "worse",  # fewer tokens/s is worse
        ("run C", "peak_gib"): "within noise",
        ("step D", "step_us"): "within noise",
    }
    # the same move the other way is an improvement; overlapping values never move
    assert _verdicts(after, before)[("step A", "step_us")] == "better"
    overlap = {"step A": {"step_us": [1000.0, 1200.0]}}
    assert _verdicts({"step A": {"step_us": [1100.0, 1150.0]}}, overlap) == {
        ("step A", "step_us"): "within noise"
    }
    table = verdict_table(compare(before, after), "guard")
    assert table.splitlines()[0] == "guard: 2 of 5 measures moved beyond the noise"
    assert "WORSE   step A [step_us]" in table and "+9.7%" in table


def test_a_move_inside_a_wide_spread_needs_to_pass_the_spread():
    """Values apart but the change smaller than the spread one side showed: noise."""
    before = {"s": {"step_us": [1000.0, 1040.0]}}  # 4% spread
    after = {"s": {"step_us": [1050.0, 1052.0]}}  # +3.1% at the medians
    assert _verdicts(before, after) == {("s", "step_us"): "within noise"}
    assert _verdicts(before, {"s": {"step_us": [1090.0, 1095.0]}}) == {("s", "step_us"): "worse"}


def test_optimizer_rows_are_judged_against_the_control_of_their_round():
    """A process that runs every step slower (the control too) moves no optimizer row; a
    row that slows against its round's control is a regression; the control's own move is
    listed as the machine's and does not fail the guard."""
    control, sr, other = (f"llama-1b W=8: {n}" for n in (TORCH_BASELINE, "SRAdamW BF16", "FP4"))
    before = {
        control: {"step_us": [2600.0, 2320.0]},
        sr: {"step_us": [1770.0, 1630.0]},
        other: {"step_us": [1500.0, 1340.0]},
    }
    after = {  # the host 10-20% slower in both rounds: every row with it, FP4 5% beyond
        control: {"step_us": [2830.0, 2820.0]},
        sr: {"step_us": [1940.0, 1970.0]},
        other: {"step_us": [1730.0, 1810.0]},
    }
    verdicts = {v["row"]: v for v in compare(before, after)}
    assert verdicts[control]["verdict"] == "worse" and verdicts[control]["control"]
    assert verdicts[sr]["verdict"] == "within noise"
    assert verdicts[sr]["relative_to"] == control and verdicts[sr]["raw_change"] > 0.1
    assert verdicts[other]["verdict"] == "worse"
    assert regressions(verdicts.values()) == 1
    table = verdict_table(verdicts.values(), "guard")
    assert f"CONTROL {control} [step_us]" in table and "the machine moved" in table
    assert f"WORSE   {other} [step_us ÷ control]" in table and "the time itself" in table
    # rounds that do not pair with the control's are judged by their time
    unpaired = {**after, control: {"step_us": [2830.0]}}
    assert "relative_to" not in {v["row"]: v for v in compare(before, unpaired)}[sr]


def test_rows_one_side_lacks_are_not_compared():
    assert compare({"a": {"step_us": [1.0, 1.0]}}, {"b": {"step_us": [2.0, 2.0]}}) == []


def test_parts_and_variants_are_checked():
    assert parse_names("train, optimizer", PARTS, "part") == ["train", "optimizer"]
    assert parse_names("fp8,torch", TRAIN_VARIANTS, "variant") == ["fp8", "torch"]
    with pytest.raises(ValueError, match="unknown part 'kernels'"):
        parse_names("optimizer,kernels", PARTS, "part")
    with pytest.raises(ValueError, match="no variant given"):
        parse_names(",", TRAIN_VARIANTS, "variant")


def _result(values: dict) -> dict:
    return {
        "environment": {
            "device": "NVIDIA H200",
            "torch": "2.11.0",
            "triton": "3.6.0",
            "date": "2026-12-04T21:00:00+00:00",
            "command": "python -m srtrain.bench --headline --out x",
        },
        "settings": {"rounds": 2, "steps": 20},
        "rows": {"this": []},
        "trees": {"this": {"path": "src", "commit": "abc1234"}},
        "measured_tree": "this",
        "values": {"this": values},
        "capacity": {
            "summary": {"torch": {"params": 6.74e9, "peak_allocated_gib": 101.4}},
            "sources": [{"device": "NVIDIA H200", "date": "2026-12-03", "commit": "17b787f"}],
        },
    }


def test_the_table_shows_medians_ranges_and_speedups():
    values = {
        f"llama-1b W=1: {TORCH_BASELINE}": {"step_us": [11_000.0, 11_400.0]},
        "llama-1b W=1: SRAdamW FP8 states": {"step_us": [7_000.0, 7_200.0]},
        f"llama-1b W=8: {TORCH_BASELINE}": {"step_us": [2_000.0, 2_000.0]},
        "llama-1b W=8: SRAdamW FP8 states": {"step_us": [1_000.0, 1_000.0]},
        "LLaMA-1B recipe, FP8 states": {
            "tokens_per_s": [55_000.0, 56_000.0],
            "mfu": [0.46, 0.47],
            "peak_gib": [43.9, 43.9],
        },
    }
    table = render_markdown(_result(values))
    assert "commit `abc1234`, 2026-12-04" in table
    assert "| SRAdamW FP8 states | 7.10 (7.00–7.20) | 1.58× | 1.00 (1.00–1.00) | 2.00× |" in table
    assert f"| {TORCH_BASELINE} | 11.20 (11.00–11.40) | 1.00× |" in table
    assert "| LLaMA-1B recipe, FP8 states | 55,500 (55,000–56,000) | 46.5% | 43.9 |" in table
    assert "| torch | 6.74B | 101.4 | – |" in table
    assert "commit `17b787f`" in table


@pytest.mark.slow
def test_the_guard_runs_the_probe_on_each_tree(tmp_path, capsys):
    """Two trees (this one twice), two rounds, the optimizer rows of a small model on the
    CPU: every row measured on both trees in every round, the files written, and a
    comparison of every row."""
    settings = Settings(
        parts=("optimizer",), preset="llama-tiny", worlds=(2,), vocab_size=256, repeats=2
    )
    trees = {"before": SRC, "after": SRC}
    env = {"device": "cpu", "torch": "x", "triton": "y", "date": "2026-12-04", "command": "c"}
    status = run_headline(tmp_path, trees, settings, env)
    result = json.loads((tmp_path / "headline.json").read_text())
    names = [
        f"llama-tiny W={w}: {n}"
        for w in (2,)
        for n in (TORCH_BASELINE, "SRAdamW BF16 states", "SRAdamW FP4 states")
    ]
    for tree in trees:
        for name in names:
            times = result["values"][tree][name]["step_us"]
            assert len(times) == 2 and min(times) > 0
    assert len(result["guard"]["verdicts"]) == len(result["values"]["after"])
    verdicts = result["guard"]["verdicts"]
    assert status == (1 if regressions(verdicts) else 0)  # a worse control row does not fail
    assert all(
        "relative_to" in v for v in verdicts if v["row"] != f"llama-tiny W=2: {TORCH_BASELINE}"
    )
    table = (tmp_path / "headline.md").read_text()
    assert "| SRAdamW FP8 states |" in table and "rank 0 of 2: ms" in table
    assert "guard: before → after" in capsys.readouterr().out


def test_the_train_part_needs_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="from a checkout's root"):
        run_rounds({"this": SRC}, Settings(parts=("train",)))


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


def test_a_trees_digest_names_the_commit_that_holds_it(tmp_path, monkeypatch):
    """The digest of a copy of a committed package equals its commit's, an edit changes it,
    and a result measured on the copy is recorded under the commit that introduced it (not
    a later one that left the package alone)."""
    package = tmp_path / "src" / "srtrain"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "sub" / "mod.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not code\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    first = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    digest = tree_digest(tmp_path / "src")
    assert digest == commit_digest("HEAD", tmp_path)
    (tmp_path / "README").write_text("docs only\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "docs")
    (package / "sub" / "mod.py").write_text("y = 3\n")
    assert tree_digest(tmp_path / "src") != commit_digest("HEAD", tmp_path)

    result = _result({})
    result["settings"]["parts"] = ["optimizer", "train"]
    result["trees"]["this"].update(commit="0000000+changes", digest=digest)
    result["environment"].update(commit="1111111", source_digest=digest)
    measured = tmp_path / "headline.json"
    measured.write_text(json.dumps(result))
    monkeypatch.chdir(tmp_path)
    recorded = record(measured, tmp_path)
    assert recorded.name == f"2026-12-04-h200-headline-{first}.json"
    written = json.loads(recorded.read_text())
    tree, env = written["trees"]["this"], written["environment"]
    assert (tree["commit"], tree["commit_seen"]) == (first, "0000000+changes")
    assert (env["commit"], env["commit_recorded"]) == (first, "1111111")
    result["trees"]["this"]["digest"] = "0" * 16
    measured.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="matches no commit"):
        record(measured, tmp_path)


def test_record_refuses_what_it_cannot_file(tmp_path, monkeypatch):
    """A missing, non-JSON or foreign file, and a directory that is no srtrain checkout, each
    end in one ValueError that says what to give or where to run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    with pytest.raises(ValueError, match="no such file"):
        record(tmp_path / "missing.json", tmp_path / "results")
    (tmp_path / "torn.json").write_text('{"trees": ')
    with pytest.raises(ValueError, match="is not JSON"):
        record(tmp_path / "torn.json", tmp_path / "results")
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="holds no headline result"):
        record(tmp_path / "other.json", tmp_path / "results")
    result = _result({})
    result["trees"]["this"]["digest"] = "0" * 16
    (tmp_path / "headline.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match="run --record from the root of the srtrain checkout"):
        record(tmp_path / "headline.json", tmp_path / "results")
    (tmp_path / "src" / "srtrain").mkdir(parents=True)  # the layout, but no git
    with pytest.raises(ValueError, match="is not a git checkout"):
        record(tmp_path / "headline.json", tmp_path / "results")


def _ladder_file(path, date: str, rows: list[tuple[str, str, int, bool]]) -> None:
    path.write_text(
        json.dumps(
            {
                "environment": {"date": date, "device": "GPU", "commit": date[:4]},
                "rows": [
                    {
                        "variant": v,
                        "rung": r,
                        "params": n,
                        "fit": fit,
                        "oom": not fit,
                        "search": "ladder",
                        "peak_allocated_gib": 1.0,
                    }
                    for v, r, n, fit in rows
                ],
            }
        )
    )


def test_capacity_keeps_each_variants_newest_ladder(tmp_path):
    """A later file that re-measures one variant replaces that variant's rows only (a
    smaller largest rung included: no maximum over history)."""
    _ladder_file(
        tmp_path / "2026-01-01-h200-capacity-ladder.json",
        "2026-01-01T00:00:00",
        [("torch", "7b", 7, True), ("fp4", "26b", 26, True), ("fp4", "30b", 30, False)],
    )
    _ladder_file(
        tmp_path / "2026-02-01-h200-capacity-fp4.json",
        "2026-02-01T00:00:00",
        [("fp4", "20b", 20, True), ("fp4", "26b", 26, False)],
    )
    section = capacity_section(latest_capacity_files(tmp_path))
    assert section["summary"]["torch"]["params"] == 7
    assert section["summary"]["fp4"]["params"] == 20
    assert section["summary"]["fp4"]["no_fit"] == "26b"
    assert [s["date"][:10] for s in section["sources"]] == ["2026-01-01", "2026-02-01"]


@pytest.mark.parametrize(
    "device, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("a 2-core AMD EPYC", "epyc"),
    ],
)
def test_record_names_the_device_model(device, slug):
    assert device_slug(device) == slug
