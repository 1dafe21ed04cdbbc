"""The benchmark's byte accounting (its timings need a GPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from experiments.kernel_bench.__main__ import main
from experiments.kernel_bench.rows import bench_shape, step_bytes
from srtrain.kernels.launch import quads_in_order, runs_in_order
from srtrain.kernels.memory import LOAD4


def test_step_bytes_count_each_tensor_once():
    shape = bench_shape(2**20)
    n = 2**20
    # fp32 param r+w (8) + fp32 grad (4) + bf16 m and v r+w (8) = 20 B per element
    assert step_bytes(shape, "bf16", "bf16", torch.float32, torch.float32, 32) == 20 * n
    # fp8 states: codes 1 B + one scale byte per 32 elements, read and written
    assert step_bytes(shape, "fp8", "fp8", torch.float32, torch.float32, 32) == (
        12 * n + 2 * 2 * (n + n // 32)
    )
    # fp4 states: two codes per byte
    assert step_bytes(shape, "fp4_e2m1", "fp4_e2m2", torch.bfloat16, torch.bfloat16, 32) == (
        6 * n + 2 * 2 * (n // 2 + n // 32)
    )


def test_model_bench_times_every_kernel_row_and_the_fp32_baseline():
    from experiments.kernel_bench.rows import model_variants, step_variants

    variants = model_variants()
    assert variants[0] == ("fp32", "fp32", False, torch.float32)
    assert variants[1:] == step_variants()
    assert {(m, v) for m, v, _, _ in variants[1:]} == {
        ("bf16", "bf16"),
        ("fp8", "fp8"),
        ("fp4_e2m1", "fp4_e2m2"),
    }
    assert {(sr, dtype) for _, _, sr, dtype in variants[1:]} == {
        (sr, dtype) for sr in (False, True) for dtype in (torch.float32, torch.bfloat16)
    }
    fp8_only = model_variants([("fp8", "fp8")])
    assert fp8_only[0] == variants[0] and {(m, v) for m, v, _, _ in fp8_only[1:]} == {
        ("fp8", "fp8")
    }
    assert len(fp8_only) == 1 + 4


@pytest.mark.slow
def test_compiled_spec_cast_keeps_the_spec_bits():
    """The bench times torch.compile of the SR cast spec; compiled, it rounds the same."""
    from experiments.kernel_bench.rows import compiled_spec_cast
    from srtrain.numerics.rounding import rng_key, sr_cast_bf16

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(4099, generator=g) * 10.0 ** torch.randint(-40, 38, (4099,), generator=g)
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-41])
    key = rng_key(5, 9, 2, 1)
    got = compiled_spec_cast()(x, key)
    assert torch.equal(got.view(torch.int16), sr_cast_bf16(x, key).view(torch.int16))


def test_dry_run_reports_state_bytes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--dry", "--numel", str(2**16), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    per_elem = {
        r["name"]: r["state_bytes"] / r["numel"] for r in result["rows"] if "state_bytes" in r
    }
    assert per_elem["m bf16 v bf16"] == 4.0
    assert per_elem["m fp8 v fp8"] == 2 + 2 / 32
    assert per_elem["m fp4_e2m1 v fp4_e2m2"] == 1 + 2 / 32
    # every format × rounding × parameter dtype the GPU bench times, with its bytes
    steps = {r["name"]: r["bytes"] / r["numel"] for r in result["rows"] if "param" in r["name"]}
    assert len(steps) == 12
    assert steps["step float32 param, m bf16 v bf16 SR"] == 20
    assert steps["step bfloat16 param, m bf16 v bf16 NR"] == 14
    assert steps["step bfloat16 param, m fp4_e2m1 v fp4_e2m2 SR"] == 6 + 2 * 2 * (1 / 2 + 1 / 32)
    assert result["environment"]["commit"]
    assert "m fp8 v fp8" in capsys.readouterr().out


def test_dry_run_on_rows_of_any_length_for_chosen_state_pairs(tmp_path):
    out = tmp_path / "bench.json"
    rows, cols = 6, 5461  # 171 scale blocks a row, the last 21 elements long
    assert (
        main(
            [
                "--dry",
                "--states",
                "fp8,fp4",
                "--cols",
                str(cols),
                "--numel",
                str(rows * cols),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    stored = {r["name"]: r["state_bytes"] for r in result["rows"] if "state_bytes" in r}
    scales = rows * 171
    assert stored == {
        "m fp8 v fp8": 2 * (rows * cols + scales),
        "m fp4_e2m1 v fp4_e2m2": 2 * (rows * 2731 + scales),
    }
    steps = {r["name"]: r["bytes"] for r in result["rows"] if "param" in r["name"]}
    assert len(steps) == 8
    assert steps["step float32 param, m fp8 v fp8 SR, rows of 5461"] == (
        12 * rows * cols + 2 * 2 * (rows * cols + scales)
    )


@pytest.mark.parametrize(
    "argv",
    [["--numel", "1000", "--cols", "64"], ["--numel", "64", "--cols", "0"], ["--states", "fp16"]],
)
def test_bench_refuses_shapes_and_states_it_cannot_build(argv, capsys):
    with pytest.raises(SystemExit):
        main(["--dry", *argv])
    assert "error" in capsys.readouterr().err


def test_profile_ranges_are_one_token_per_row():
    from experiments.kernel_bench.rows import profile_range, step_name

    name = step_name(torch.float32, "fp8", "fp8", True, 5461) + " grouped_sqrt=True"
    assert profile_range(name) == "step.float32.param.m.fp8.v.fp8.SR.rows.of.5461.grouped.sqrt.True"


def test_checkpoint_bench_times_save_and_load(tmp_path):
    import torch.distributed as dist

    from srtrain.bench.checkpoint_bench import run_checkpoint_bench

    try:
        rows = run_checkpoint_bench("llama-tiny", "fp8", vocab_size=256, root=str(tmp_path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert [r["name"] for r in rows] == ["save sync", "save async", "load"]
    assert all(r["complete_s"] >= r["blocking_s"] > 0 and r["bytes"] > 0 for r in rows)


def test_tile_loop_is_the_innermost_backward_branch():
    from experiments.kernel_bench.sass import Instruction, tile_loop

    listing = [
        Instruction(*i)
        for i in (
            (0x00, "LDG"),
            (0x10, "IMAD"),
            (0x20, "FMUL"),
            (0x30, "BRA", 0x50),
            (0x40, "STG"),
            (0x50, "BRA", 0x10),
            (0x60, "BRA", 0x00),
            (0x70, "EXIT"),
            (0x80, "BRA", 0x80),
        )
    ]
    assert tile_loop(listing) == {"IMAD": 1, "FMUL": 1, "BRA": 2, "STG": 1}
    with pytest.raises(RuntimeError, match="no loop"):
        tile_loop([Instruction(0x00, "EXIT"), Instruction(0x10, "BRA", 0x10)])


def test_fast_path_leaves_out_the_calls_a_predicated_branch_skips():
    """A division's call of its full routine, skipped by a predicated branch, is a slow
    path; a branch over memory accesses (the full tile's body), an unpredicated branch and
    a branch over no call are not."""
    from experiments.kernel_bench.sass import Instruction, slow_paths, tile_loop

    listing = [
        Instruction(*i)
        for i in (
            (0x00, "LDG"),
            (0x10, "FCHK"),
            (0x20, "BRA", 0x60, True),  # division: fast unless FCHK set P
            (0x30, "MOV"),
            (0x40, "CALL"),
            (0x50, "MOV"),
            (0x60, "BSYNC"),
            (0x70, "BRA", 0xB0, True),  # a tile path: calls and a store
            (0x80, "CALL"),
            (0x90, "STG"),
            (0xA0, "FADD"),
            (0xB0, "BRA", 0xD0),
            (0xC0, "CALL"),  # unpredicated
            (0xD0, "BRA", 0xF0, True),
            (0xE0, "FMUL"),  # no call
            (0xF0, "BRA", 0x00, True),
            (0x100, "EXIT"),
        )
    ]
    assert slow_paths(listing) == {0x30, 0x40, 0x50}
    fast = tile_loop(listing, fast_path=True)
    assert sum(tile_loop(listing).values()) - sum(fast.values()) == 3
    assert "MOV" not in fast and fast["CALL"] == 2


@pytest.mark.slow
def test_launch_shape_report_counts_elements_a_thread():
    """The sweep's shapes compiled for sm_90: eight elements a thread share per-tile and
    per-block work, so nearest FP8 issues fewer instructions per element than at four."""
    script = (
        "import json; from experiments.kernel_bench.sass import launch_shape_report; "
        "print(json.dumps(launch_shape_report([('fp8', 'fp8')], "
        "[(512, 4, 80), (512, 2, 128)])))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
    ).stdout
    rows = json.loads(out)
    assert [(r["name"], r["elements_per_thread"]) for r in rows] == [
        ("m fp8 v fp8 NR", 4),
        ("m fp8 v fp8 NR", 8),
        ("m fp8 v fp8 SR", 4),
        ("m fp8 v fp8 SR", 8),
    ]
    assert all(0 < r["registers"] <= r["max_registers"] for r in rows)
    four, eight = rows[0], rows[1]
    assert 0 < eight["instructions_per_element"] < four["instructions_per_element"]
    assert four["spill_instructions_in_loop"] == eight["spill_instructions_in_loop"] == 0


def test_source_lines_of_a_kernel_compiled_from_another_checkout_read_this_one():
    """A cached kernel names the files it was compiled from; the by-line report reads the
    same file of the packages imported here."""
    from experiments.kernel_bench.sass import _source_text
    from srtrain.kernels import tile

    with open(tile.__file__, encoding="utf-8") as f:
        first = f.readline().strip()
    elsewhere = os.path.join(os.sep, "elsewhere", "src", "srtrain", "kernels", "tile.py")
    assert first and _source_text(f"{elsewhere}:1") == first
    assert _source_text(os.path.join(os.sep, "elsewhere", "nothing.py") + ":1") == ""


@pytest.mark.slow
def test_instruction_report_compiles_for_sm90_without_a_gpu(tmp_path):
    """Compiled, not interpreted: the report runs in a process without TRITON_INTERPRET."""
    from experiments.kernel_bench.sass import instruction_budget

    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [sys.executable, "-m", "experiments.kernel_bench", "--sass", "--json", str(out)],
        env=env,
        check=True,
        capture_output=True,
    )
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 18
    # stochastic rounding adds the hash; block-scaled formats add the scale search
    bf16_nr, bf16_sr = rows["m bf16 v bf16 NR"], rows["m bf16 v bf16 SR"]
    assert 0 < bf16_nr["instructions_per_element"] < bf16_sr["instructions_per_element"]
    assert rows["m fp8 v fp8 SR"]["instructions_per_element"] > bf16_sr["instructions_per_element"]
    assert bf16_nr["bytes_per_element"] == 20 and 0 < bf16_nr["registers"] <= 255
    # a full tile's opcodes (the loop of both tile paths less the masked path's) add up to
    # its instructions; stochastic rounding adds integer and float work
    for row in rows.values():
        assert sum(row["full_tile_opcodes"].values()) == pytest.approx(
            row["instructions_per_element"] * row["elements_per_thread"]
        )
    fp8_nr, fp8_sr = rows["m fp8 v fp8 NR"], rows["m fp8 v fp8 SR"]
    assert fp8_sr["full_tile_opcodes"]["FADD"] > fp8_nr["full_tile_opcodes"].get("FADD", 0)
    # the launch's register cap holds
    assert all(
        0 < r["registers"] <= r["register_cap"] and r["registers_without_cap"] > 0
        for r in rows.values()
    )
    # rows of odd length keep the aligned layout at the aligned launch shape: no more spills,
    # no trip through shared memory, and little beyond the instructions of aligned rows
    # (their accesses are scalar, or 8-byte pieces issued for both places a run can start)
    for name in ("m fp8 v fp8 SR", "m fp4_e2m1 v fp4_e2m2 SR"):
        odd, aligned = rows[f"{name}, unaligned rows"], rows[name]
        assert (odd["num_warps"], odd["register_cap"]) == (2, 128), name
        assert odd["spill_instructions_in_loop"] <= aligned["spill_instructions_in_loop"], name
        assert odd["shared_memory_instructions_in_loop"] == 0, name
        assert odd["instructions_per_element"] < 1.2 * aligned["instructions_per_element"], name
    # BF16 parameters round too: more instructions on fewer bytes
    for name in ("m bf16 v bf16 SR", "m fp8 v fp8 NR"):
        bf16 = rows[f"{name}, BF16 params"]
        assert bf16["instructions_per_element"] > rows[name]["instructions_per_element"], name
        assert bf16["bytes_per_element"] < rows[name]["bytes_per_element"], name
    # 20 B per element at 4.19 TB/s: 132 SMs × 1.98 GHz × 128 / 2.1e11 elements/s
    assert instruction_budget(20) == pytest.approx(159.7, abs=0.1)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        main(["--sass"])
    # every step divides and takes square roots: the loop holds their slow paths, which the
    # fast path's count leaves out
    for row in rows.values():
        assert 0 < row["fast_path_instructions_per_element"] < row["instructions_per_element"]
        assert (
            row["masked_tile_fast_path_instructions_per_element"]
            < row["masked_tile_instructions_per_element"]
        )
    # by source line: the lines of a full tile's fast path add up to its instructions, and
    # the IEEE division is one of them
    lines_out = tmp_path / "lines.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.kernel_bench",
            "--sass",
            "--by-line",
            "--states",
            "fp8",
            "--json",
            str(lines_out),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    lines = json.loads(lines_out.read_text())["rows"]
    for rounding in ("NR", "SR"):
        mine = [r for r in lines if r["name"].startswith(f"m fp8 v fp8 {rounding} ")]
        assert sum(r["instructions_per_element"] for r in mine) == pytest.approx(
            rows[f"m fp8 v fp8 {rounding}"]["fast_path_instructions_per_element"]
        )
        assert any("div_rn" in r["source"] and r["instructions_per_element"] > 5 for r in mine)
    with pytest.raises(SystemExit):
        main(["--by-line"])


@pytest.mark.slow
def test_fp4_steps_load_float32_parameters_in_the_byte_pairs_layout():
    """Compiled for sm_90: the 16-byte PTX loads of the parameter and gradient hold runs of
    four elements a thread, and the FP4 tile converts fewer layouts than with tl.load; the
    check refuses the same IR once those loads are laid out one element a thread."""
    script = (
        "import json; from experiments.kernel_bench.sass import _compile; "
        "cases = [('fp4_e2m1', 'fp4_e2m2', True, {}), "
        "('fp4_e2m1', 'fp4_e2m2', True, {'quad_loads': False})]; "
        "print(json.dumps([_compile(m, v, sr, **kw).asm['ttgir'] for m, v, sr, kw in cases]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
    ).stdout
    quads, plain = json.loads(out)
    assert quads_in_order(quads) and not quads_in_order(plain)
    assert quads.count("ttg.convert_layout") < plain.count("ttg.convert_layout")
    # the loads' layout, with one element a thread in place of its runs
    load = next(line for line in quads.splitlines() if LOAD4.value in line)
    layout = re.search(r"tensor<[^>]*?, (#[\w.]+)", load).group(1)
    scalar = re.sub(
        rf"^({layout} = #ttg\.blocked<\{{sizePerThread = \[)[\d, ]+\]",
        lambda m: m.group(1) + "1, 1]",
        quads,
        flags=re.MULTILINE,
    )
    assert scalar != quads and not quads_in_order(scalar)


@pytest.mark.slow
def test_unaligned_steps_load_float32_runs_in_their_layout():
    """Compiled for sm_90, rows of odd length: the run accesses of the parameter and
    gradient hold runs of eight consecutive elements a thread, with no trip through shared
    memory, and the check refuses the same IR once they are laid out one element a thread."""
    script = (
        "import json; from experiments.kernel_bench.sass import _compile; "
        "print(json.dumps(_compile('fp8', 'fp8', True, aligned=False).asm['ttgir']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ttgir = json.loads(
        subprocess.run(
            [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
        ).stdout
    )
    assert runs_in_order(ttgir)
    assert "ttg.local_alloc" not in ttgir
    load = next(
        line
        for line in ttgir.splitlines()
        if "tt.elementwise_inline_asm" in line and "packed_element = 8" in line
    )
    layout = re.search(r"tensor<[^>]*?, (#[\w.]+)", load).group(1)
    scalar = re.sub(
        rf"^({layout} = #ttg\.blocked<\{{sizePerThread = \[)[\d, ]+\]",
        lambda m: m.group(1) + "1, 1]",
        ttgir,
        flags=re.MULTILINE,
    )
    assert scalar != ttgir and not runs_in_order(scalar)


def test_host_bench_times_the_step_host_work(tmp_path):
    """Without CUDA it plans and stages the launches (Triton's interpreter) and times that."""
    from srtrain.models import build_model

    out = tmp_path / "host.json"
    assert (
        main(["--host", "llama-tiny", "--worlds", "2", "--repeats", "3", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    shards = len(list(build_model("llama-tiny", 32000, 1024).parameters()))
    assert [r["name"] for r in rows] == [
        "llama-tiny W=2 m fp32 v fp32 NR",
        "llama-tiny W=2 m bf16 v bf16 SR",
        "llama-tiny W=2 m fp8 v fp8 SR",
        "llama-tiny W=2 m fp4_e2m1 v fp4_e2m2 SR",
        "llama-tiny W=2 update sizes, one measured step",
    ]
    *steps, sizes = rows
    for row in steps:
        assert row["shards"] == shards and row["launches"] >= 1
        assert 0 < row["plan_us"] < row["prepare_step_us"]
        assert ("step_us" in row) == torch.cuda.is_available()
    assert rows[0]["launches"] == 1  # unscaled states: one launch over every shard
    assert sizes["shards"] == shards and sizes["update_sizes_us"] > 0


def test_shadow_sample_takes_a_non_negative_integer(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "llama-1b", "--shadow-sample", "-1"])
    assert "--shadow-sample takes a non-negative integer" in capsys.readouterr().err


def test_compare_takes_launch_options_the_step_accepts():
    from experiments.kernel_bench.side_by_side import parse_compare, parse_states

    assert parse_compare("l2_every_thread=false,true") == ("l2_every_thread", [False, True])
    assert parse_compare("max_registers=none,128,auto") == ("max_registers", [None, 128, "auto"])
    assert parse_states("fp8,fp8-fp4") == [("fp8", "fp8"), ("fp8", "fp4_e2m2")]
    for spec, message in (
        ("warps=2,4", "OPTION one of"),
        ("tile=512", "two or more"),
        ("tile=512,512", "two or more"),
        ("tile=3,4", "power of two"),
        ("tile=x,512", "not a launch option value"),
        ("l2_ahead=-1,2", "l2_ahead must be"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_compare(spec)
    with pytest.raises(ValueError, match="unknown state pair"):
        parse_states("fp16")
    with pytest.raises(SystemExit):
        main(["--compare", "tile=3,4"])
    if not torch.cuda.is_available():
        assert main(["--compare", "tile=256,512"]) == 2  # the timings need a GPU


def test_trees_take_directories_that_hold_srtrain(tmp_path):
    from experiments.kernel_bench.trees import tree_arguments
    from srtrain.bench.trees import parse_trees

    src = os.path.join(os.path.dirname(__file__), "..", "src")
    assert list(parse_trees(f"a={src},b={src}")) == ["a", "b"]
    for spec, message in (
        (f"a={src}", "two or more"),
        (f"a={src},a={src}", "twice"),
        (f"a={tmp_path},b={src}", "holds no srtrain"),
        ("a", "NAME=PATH"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_trees(spec)
    assert tree_arguments(
        [
            "--trees",
            "a=x,b=y",
            "--model",
            "llama-1b",
            "--rounds=3",
            "--json",
            "out.json",
            "--repeats",
            "5",
        ]
    ) == ["--model", "llama-1b", "--repeats", "5"]
    with pytest.raises(ValueError, match="--train is not one of them"):
        tree_arguments(["--trees", "a=x,b=y", "--train"])
    with pytest.raises(SystemExit):
        main(["--trees", f"a={src}", "--dry"])


@pytest.mark.slow
def test_trees_run_each_tree_in_turn_and_match_rows(tmp_path, capsys):
    """Two trees whose byte accounting differs, side by side: every row holds each tree's
    values over the rounds, and each run's commit is its tree's."""
    import shutil

    repo = os.path.join(os.path.dirname(__file__), "..")
    src = os.path.join(repo, "src")
    checkout = tmp_path / "changed"  # a checkout's layout: src/srtrain beside experiments/
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(src, "srtrain"), checkout / "src" / "srtrain", ignore=ignore)
    shutil.copytree(os.path.join(repo, "experiments"), checkout / "experiments", ignore=ignore)
    changed = checkout / "src"
    kernels = checkout / "experiments" / "kernel_bench" / "rows.py"
    text = kernels.read_text()
    assert '"state_bytes": stored}' in text
    kernels.write_text(text.replace('"state_bytes": stored}', '"state_bytes": stored + 1}'))
    out = tmp_path / "trees.json"
    assert (
        main(
            [
                "--trees",
                f"before={src},after={changed}",
                "--dry",
                "--numel",
                str(2**12),
                "--rounds",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    fp8 = rows["m fp8 v fp8"]
    assert fp8["after.state_bytes"] == [s + 1 for s in fp8["before.state_bytes"]]
    assert len(fp8["before.state_bytes"]) == 2 and fp8["before.bytes"] == fp8["after.bytes"]
    assert len(rows) == len(result["rows"]) == 3 + 12
    trees = result["environment"]["trees"]
    assert [r["commit"] for r in trees["after"]["runs"]] == ["unknown"] * 2
    relayed = capsys.readouterr().err  # each run's output as it came, then its wall time
    for label in ("before 1/2", "after 1/2", "before 2/2", "after 2/2"):
        assert f"[{label}] name=m fp8 v fp8 |" in relayed and f"[{label}] exit 0 after " in relayed
    # a run past its time is stopped and named
    from experiments.kernel_bench.trees import compare_trees

    with pytest.raises(RuntimeError, match=r"timed out after 0\.01 s"):
        compare_trees({"before": changed, "after": changed}, ["--dry"], rounds=1, timeout=0.01)
    assert trees["before"]["path"] == os.path.realpath(src)
    # a tree whose run fails stops the comparison with its error
    assert (
        main(
            [
                "--trees",
                f"before={src},after={changed}",
                "--model",
                "no-such-preset",
                "--rounds",
                "1",
            ]
        )
        == 2
    )


def test_a_tree_git_does_not_track_has_no_commit(tmp_path):
    """A copy of the package inside a checkout (an ignored directory, say) is not that
    checkout's commit; the checkout's own tree is."""
    import shutil

    from srtrain.bench.trees import tree_commit

    src = os.path.join(os.path.dirname(__file__), "..", "src")
    if (
        subprocess.run(
            ["git", "-C", src, "ls-files", "--error-unmatch", "srtrain/__init__.py"],
            capture_output=True,
            check=False,
        ).returncode
        != 0
    ):
        pytest.skip("the tests run outside a git checkout")
    assert tree_commit(src) not in ("", "unknown")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    shutil.copytree(os.path.join(src, "srtrain", "bench"), repo / "copy" / "srtrain" / "bench")
    (repo / "copy" / "srtrain" / "__init__.py").write_text("")
    (repo / "README").write_text("x")
    subprocess.run(["git", "-C", str(repo), "add", "README"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
        check=True,
    )
    assert tree_commit(repo / "copy") == "unknown"
