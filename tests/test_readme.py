"""README.md runs as written. Every fenced python block executes here on CPU; every command of
its bash blocks has an entry in COMMANDS that says how it is tested: run here (as written, or
with arguments appended that only shorten it), covered by a named test, or not runnable here
(CI's own setup, a GPU, the network, a cluster) and why. A README command missing from the
table, or an entry whose command left the README, fails the suite."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from srtrain.checkpoint import CheckpointManager
from srtrain.config import load_config
from srtrain.data import BatchLoader, load_meta
from srtrain.metrics import read_records
from srtrain.models import build_model_from_config, init_weights, preset_shape, shape_config
from srtrain.numerics.adamw import NUM_COUNTS
from srtrain.optim import SRAdamW

from conftest import TINY_DATA

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"  # runs README's second bash block: CI's own command
CI_BLOCK = 2
PYTHON_DOCS = (README, ROOT / "docs" / "training.md")  # the python blocks that run here
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$")

# ------------------------------------------------------------------------- reading README


def blocks(path: Path, language: str) -> list[tuple[int, str, str]]:
    """The fenced blocks of one language: (first line number, heading above it, code)."""
    text = path.read_text()
    out = []
    for match in BLOCK.finditer(text):
        if match.group(1) != language:
            continue
        before = text[: match.start()]
        headings = [
            HEADING.match(line).group(1)
            for line in BLOCK.sub("", before).splitlines()
            if HEADING.match(line)
        ]
        out.append((before.count("\n") + 2, headings[-1] if headings else "", match.group(2)))
    return out


def split_commands(script: str) -> list[str]:
    """The simple commands of a bash block: continuation lines joined, comments dropped,
    ``&&`` lists split, whitespace outside quotes collapsed to one space."""
    commands: list[str] = []
    for line in script.replace("\\\n", " ").splitlines():
        words, word, quote, i = [], "", "", 0
        parts: list[list[str]] = [words]
        while i < len(line):
            ch = line[i]
            if quote:
                word += ch
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                word, quote = word + ch, ch
            elif ch == "#" and not word:
                break  # a comment
            elif line.startswith("&&", i):
                if word:
                    words.append(word)
                word, words = "", []
                parts.append(words)
                i += 1
            elif ch.isspace():
                if word:
                    words.append(word)
                word = ""
            else:
                word += ch
            i += 1
        if word:
            words.append(word)
        commands.extend(" ".join(p) for p in parts if p)
    return commands


def readme_commands() -> list[str]:
    """Every command of README's bash blocks, in order, each once."""
    found = [c for _, _, code in blocks(README, "bash") for c in split_commands(code)]
    return list(dict.fromkeys(found))


def test_commands_are_split_like_bash():
    script = (
        "a --x 'q  # not a comment' && b  c   # a comment\n"
        "# a whole-line comment\n"
        "python -c \"import t; m = f('x')\"\n"
        "c --y 1 \\\n    --z 2\n"
    )
    assert split_commands(script) == [
        "a --x 'q  # not a comment'",
        "b c",
        "python -c \"import t; m = f('x')\"",
        "c --y 1 --z 2",
    ]


# ------------------------------------------------------------------ how a command is tested

RUN = "run here"  # as written, or with `shorten` appended
COVERED = "covered by an existing test"
CI = "CI's own command"
SUITE = "this test suite"
GPU = "GPU only"
NETWORK = "network only"
CLUSTER = "cluster only"


@dataclass(frozen=True)
class How:
    """How one README command is tested."""

    kind: str
    why: str = ""
    shorten: tuple[str, ...] = ()  # RUN: arguments appended, each of which only shortens it
    tests: tuple[str, ...] = ()  # tests that cover it on a CPU ("tests/test_x.py::test_name")
    setup: Callable[[Path, Path], None] | None = None  # RUN: its inputs (cwd, small corpus)
    check: Callable[[Path, str], None] | None = None  # RUN: asserts on its outputs (cwd, stdout)
    timeout: int = 180


def run(*shorten: str, setup=None, check=None, why: str = "") -> How:
    return How(RUN, why, shorten, setup=setup, check=check)


def covered(*tests: str, why: str) -> How:
    return How(COVERED, why, tests=tests)


def ci() -> How:
    return How(CI, f"{CI_SCRIPT.relative_to(ROOT)} runs README's bash block {CI_BLOCK} as is")


def suite(why: str) -> How:
    return How(SUITE, why)


def gpu(why: str, *tests: str) -> How:
    return How(GPU, why, tests=tests)


def network(why: str, *tests: str) -> How:
    return How(NETWORK, why, tests=tests)


def cluster(why: str, *tests: str) -> How:
    return How(CLUSTER, why, tests=tests)


# ------------------------------------------------- inputs and checks of the commands run here


def _jsonl_corpus(cwd: Path, data: Path) -> None:
    """my_corpus/*.jsonl: the standard library's modules, one JSON row of text each."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    (cwd / "my_corpus").mkdir()
    for i, part in enumerate((files[:30], files[30:])):
        rows = [json.dumps({"text": f.read_text(errors="replace")}) for f in part]
        (cwd / "my_corpus" / f"part{i}.jsonl").write_text("\n".join(rows) + "\n")


def _existing_tokenizer(cwd: Path, data: Path) -> None:
    shutil.copy(data / "tokenizer.model", cwd / "existing.model")


def _corpus_and_hf_tokenizer(cwd: Path, data: Path) -> None:
    """my_corpus/*.jsonl, and models/pythia-160m: a transformers tokenizer directory (a
    byte-level BPE trained here, GPT-NeoX's <|endoftext|> as BOS and EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _jsonl_corpus(cwd, data)
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [
        json.loads(line)["text"]
        for f in (cwd / "my_corpus").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    raw.train_from_iterator(texts, trainer)
    eos = "<|endoftext|>"
    wrapped = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=eos, eos_token=eos)
    wrapped.save_pretrained(cwd / "models" / "pythia-160m")


def _hf_tokenized(cwd: Path, stdout: str) -> None:
    from transformers import AutoTokenizer

    _prepared("data/pythia", vocab=1000)(cwd, stdout)
    meta = load_meta(cwd / "data/pythia")
    hf = AutoTokenizer.from_pretrained(cwd / "models" / "pythia-160m", local_files_only=True)
    assert (meta.tokenizer.kind, meta.eos_id, meta.dtype) == (
        "transformers",
        hf.eos_token_id,
        "uint16",
    )
    copied = AutoTokenizer.from_pretrained(cwd / "data/pythia/tokenizer", local_files_only=True)
    assert copied.get_vocab() == hf.get_vocab()


def _small_model(data: Path) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """A one-layer llama-tiny of width 64 at the small corpus's vocabulary (a transformers
    LlamaForCausalLM of 115k parameters), and ten real batches of the corpus."""
    shape = preset_shape("llama-tiny", hidden=64, intermediate=172, layers=1)
    model = build_model_from_config(
        shape_config(shape, load_meta(data).vocab_size, 64), device="cpu"
    )
    init_weights(model, 0)
    loader = BatchLoader(data, "train", global_batch_size=4, seq_len=64)
    batches = [{"input_ids": x, "labels": x} for x, _ in (next(loader) for _ in range(10))]
    return model, batches


def _checkpoint(cwd: Path, data: Path) -> Path:
    """runs/llama-100m-fp8/checkpoints/step-8000: the small model after two steps, FP8 states."""
    model, batches = _small_model(data)
    opt = SRAdamW(model.parameters(), lr=1e-3, m_format="fp8", v_format="fp8")
    for batch in batches[:2]:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    with CheckpointManager(cwd / "runs" / "llama-100m-fp8", keep=1, data_dir=data) as manager:
        return manager.save(8000, model, opt, {"step": 8000})


def _prepared(out: str, vocab: int, tokenizer: str | None = None) -> Callable[[Path, str], None]:
    def check(cwd: Path, stdout: str) -> None:
        meta = load_meta(cwd / out, verify=True)
        assert meta.vocab_size == vocab
        assert all(meta.splits[s].num_tokens > 0 for s in ("train", "val"))
        if tokenizer:
            assert (cwd / out / "tokenizer.model").read_bytes() == (cwd / tokenizer).read_bytes()

    return check


def _reused_tokenizer(cwd: Path, stdout: str) -> None:
    vocab = TINY_DATA["data.vocab_size"]
    _prepared("data/builtin", vocab=vocab, tokenizer="existing.model")(cwd, stdout)


def _fits(cwd: Path, stdout: str) -> None:
    assert stdout.splitlines()[-1] == "fits: yes"


def _ladder_fits(cwd: Path, stdout: str) -> None:
    assert stdout.splitlines()[-1].startswith("largest that fits: this run ")


def _fp4_theory_run(cwd: Path, stdout: str) -> None:
    run_dir = cwd / "runs" / "tiny"
    assert [r["step"] for r in read_records(run_dir)] == [1, 2, 3, 4]
    cfg = load_config(run_dir / "config.yaml")
    assert (cfg.optim.v_format, cfg.resets.mode) == ("fp4_e2m2", "theory")
    assert (run_dir / "checkpoints" / "step-4").is_dir()


def _exported_dir(cwd: Path, stdout: str) -> None:
    assert stdout.strip() == "srtrain.export: wrote hf/llama-100m-fp8"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(cwd / "hf" / "llama-100m-fp8")  # raises unless it loads


# ---------------------------------------------------- every README command and how it is tested

ROUND_TRIP = "tests/test_continue_pretraining.py::test_continue_pretraining_round_trip"

# One line per command, its exact text (continuation lines joined, comments dropped, `&&`
# lists split). A command added to README needs a line here; run(...) entries run in a
# directory of their own where `./train`, `configs/` and `launch/` are the repository's.
COMMANDS: dict[str, How] = {
    # README's first two blocks: setup and the default job, and CI's own command line
    "python3 -m venv .venv": ci(),
    ". .venv/bin/activate": ci(),
    "pip install -c constraints.txt torch triton": ci(),
    "pip install -c constraints.txt -e .": network("installs from PyPI; CI: the same, '.[test]'"),
    "pip install -c constraints.txt -e '.[test]'": ci(),
    "ruff check .": ci(),
    "ruff format --check .": ci(),
    "pytest -q -n 2": ci(),
    # Training
    "./train": covered(
        "tests/test_train.py::test_train_executable_runs_and_learns",
        why="the default job for 30 steps on a small corpus (as written: 300 steps, ~4 min)",
    ),
    "./train --config configs/llama-100m-fp8.yaml": gpu(
        "the recipe sets parallel.device=cuda and reads C4 (data/llama-100m, from the Hub)",
        "tests/test_configs.py::test_every_config_loads_and_names_its_run_dir",
    ),
    "./train optim.v_format=fp4 resets.mode=theory train.steps=1000": run(
        "data.max_bytes=1000000",
        "data.val_fraction=0.1",
        "train.steps=4",
        check=_fp4_theory_run,
        why="4 steps on 1 MB of the builtin corpus (10% held out: a window of validation);"
        " as written it prepares 16 MB and trains 1000 steps",
    ),
    "srtrain train --config configs/llama-100m-fp8.yaml": gpu(
        "the recipe sets parallel.device=cuda and reads C4 (data/llama-100m, from the Hub)",
        "tests/test_commands.py::test_train_runs_from_the_package",
    ),
    # Data
    "srtrain prepare --source allenai/c4:en --out data/llama-100m "
    "--vocab-size 32000 --max-bytes 11000000000": network("streams 11 GB of C4 from the Hub"),
    "srtrain prepare --source my_corpus/*.jsonl --out data/mine --vocab-size 32000": run(
        setup=_jsonl_corpus, check=_prepared("data/mine", vocab=32000)
    ),
    "srtrain prepare --source builtin --out data/builtin --tokenizer existing.model": run(
        setup=_existing_tokenizer, check=_reused_tokenizer
    ),
    # Launching on GPUs
    "launch/single_node.sh --config configs/llama-100m-fp8.yaml": gpu(
        "8 CUDA ranks (GPUS=8) of a CUDA recipe",
        "tests/test_configs.py::test_launcher_trains_on_two_cpu_ranks",
    ),
    "NNODES=2 HEAD_NODE_ADDR=node001 launch/multi_node.sh --config configs/llama-1b.yaml": cluster(
        "two GPU nodes",
        "tests/test_configs.py::test_launcher_trains_on_two_cpu_ranks",
        "tests/test_hsdp.py::test_multi_node_launch_replicates_across_nodes_by_default",
    ),
    "mkdir -p logs": cluster("the log dir of the SLURM job on its line"),
    "sbatch --nodes 4 launch/slurm.sbatch --config configs/llama-1b-fp8.yaml": cluster(
        "a SLURM cluster of GPU nodes",
        "tests/test_configs.py::test_slurm_script_requests_whole_requeueable_nodes",
    ),
    # Memory planner
    "srtrain plan --config configs/llama-1b-fp4.yaml --gpus 8": run(check=_fits),
    # Capacity
    "srtrain plan --ladder --gpus 8 --gpu-memory 139.8 train.global_batch_size=8 "
    "model.seq_len=2048 parallel.activation_checkpointing=true parallel.bf16_params=true "
    "optim.m_format=fp4 optim.v_format=fp4 optim.step_in_backward=true": run(check=_ladder_fits),
    "srtrain bench --capacity --no-throughput --out capacity-ladder.json": gpu(
        "trials of models up to 52B on a CUDA device",
        "tests/test_bench_capacity.py::test_capacity_dry_run_trains_one_trial_in_a_subprocess",
    ),
    # Performance
    "srtrain bench --headline --out headline/": gpu(
        "the optimizer step and the LLaMA-1B recipes on a CUDA device",
        "tests/test_bench_headline.py::test_the_guard_runs_the_probe_on_each_tree",
    ),
    "srtrain bench --headline --parts optimizer --trees before=../old/src,after=src "
    "--out guard/": gpu(
        "two trees on a CUDA device",
        "tests/test_bench_headline.py::test_the_guard_runs_the_probe_on_each_tree",
        "tests/test_bench_headline.py::test_a_planted_slowdown_is_flagged_and_noise_is_not",
    ),
    # Checkpoints, resume and export
    "srtrain export runs/llama-100m-fp8/checkpoints/step-8000 hf/llama-100m-fp8": run(
        setup=_checkpoint, check=_exported_dir
    ),
    # Continue pretraining a Hugging Face model
    "srtrain prepare --source my_corpus/*.jsonl --out data/pythia --tokenizer "
    "models/pythia-160m": run(
        setup=_corpus_and_hf_tokenizer,
        check=_hf_tokenized,
        why="a byte-level BPE built here stands in for the downloaded model's tokenizer",
    ),
    "srtrain prepare --source Salesforce/wikitext:wikitext-103-raw-v1 "
    "--out data/wiki --tokenizer models/pythia-160m": network(
        "streams WikiText-103 from the Hub (a second corpus, validated beside the first)"
    ),
    "srtrain train model.init_from=models/pythia-160m data.dir=data/pythia model.seq_len=2048 "
    'optim.lr=1e-4 train.run_dir=runs/pythia "train.val_sets=[wiki=data/wiki]"': covered(
        ROUND_TRIP,
        "tests/test_eval.py::test_val_sets_are_logged_beside_the_main_validation",
        why="20 steps from model.init_from of a tiny model; val sets on the tiny corpus; as"
        " written it trains Pythia-160M at sequence 2048 (a GPU's work)",
    ),
    "srtrain eval --checkpoint runs/pythia --data data/pythia --data data/wiki": covered(
        "tests/test_eval.py::test_checkpoint_loss_is_the_trainers_val_loss",
        why="a tiny run's checkpoint on two data dirs; as written it needs the run above",
    ),
    "srtrain export runs/pythia hf/pythia-continued": covered(
        ROUND_TRIP, why="exports the tiny runs; as written it needs the run above"
    ),
    "lm_eval --model hf --model_args pretrained=hf/pythia-continued --tasks hellaswag,arc_easy "
    "--device cuda:0 --batch_size 16": network(
        "lm-evaluation-harness (not a dependency) downloads its tasks from the Hub and runs on"
        " a GPU here"
    ),
    # Tests
    'pytest -q -m "not slow" -n 2 --durations=10': suite("the fast tier of this suite"),
    "pytest -q -n 12 tests/test_kernels.py tests/test_launch_plan.py tests/test_optim.py "
    "tests/test_update_size.py": gpu("on a CUDA machine; on a CPU CI runs these files"),
}


def test_every_readme_command_is_classified():
    commands = readme_commands()
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, (
        "README commands without an entry in COMMANDS; add one each, with run(...),"
        " covered(test, why=...), gpu/network/cluster(why, tests...):\n"
        + "\n".join(f'    {c!r}: gpu("why", "tests/test_x.py::test_covering_it"),' for c in missing)
    )
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, f"COMMANDS entries no longer in README (remove them): {stale}"


def test_ci_entries_are_what_ci_runs():
    """The commands marked ci() are those of the line CI runs (and no others)."""
    assert f"n=={CI_BLOCK}" in CI_SCRIPT.read_text(), f"{CI_SCRIPT} runs another README block"
    ci_line = blocks(README, "bash")[CI_BLOCK - 1][2].splitlines()[0]  # as .ci/run reads it
    assert {c for c, how in COMMANDS.items() if how.kind == CI} == set(split_commands(ci_line))


COVERING = sorted({t for how in COMMANDS.values() for t in how.tests})


@pytest.mark.parametrize("test_id", COVERING)
def test_covering_tests_exist(test_id):
    path, _, name = test_id.partition("::")
    assert (ROOT / path).is_file(), f"{path} does not exist"
    tree = ast.parse((ROOT / path).read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert name in defined, f"{path} has no {name}"


def test_entries_say_why():
    for command, how in COMMANDS.items():
        assert how.kind == RUN or how.why, f"{command!r}: {how.kind} needs a reason"
        assert how.kind != COVERED or how.tests, f"{command!r}: covered by which test?"
        assert not how.shorten or how.why, f"{command!r}: why shorten it?"


# ----------------------------------------------------------------- the commands that run here


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory where `./train`, `configs/` and `launch/` are the repository's,
    and an environment whose `python` is this interpreter, srtrain this tree's, the Hub off."""
    cwd, bin_dir = tmp_path / "work", tmp_path / "bin"
    cwd.mkdir()
    bin_dir.mkdir()
    for name in ("train", "configs", "launch"):
        (cwd / name).symlink_to(ROOT / name)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        (bin_dir / name).chmod(0o755)
    # the console script pip installs, run from this checkout's sources
    (bin_dir / "srtrain").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m srtrain "$@"\n'
    )
    (bin_dir / "srtrain").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return cwd, env


RUN_HERE = [c for c, how in COMMANDS.items() if how.kind == RUN]


def short(command: str, width: int = 60) -> str:
    """A test id: the command, cut at a word boundary."""
    return command if len(command) <= width else command[: command.rfind(" ", 0, width)] + " ..."


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN_HERE, ids=short)
def test_readme_command_runs(command, sandbox, request):
    how = COMMANDS[command]
    cwd, env = sandbox
    if how.setup:
        how.setup(cwd, Path(request.getfixturevalue("tiny_data")))
    line = " ".join([command, *map(shlex.quote, how.shorten)])
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=how.timeout,
        check=False,
    )
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if how.check:
        how.check(cwd, done.stdout)


# ------------------------------------------------------------------------- the python blocks


def _own_loop(namespace: dict, before: list[torch.Tensor], printed: str) -> None:
    """The loop trained the model, reported step 10's stall fractions, reset v."""
    model, opt = namespace["model"], namespace["opt"]
    params = list(model.parameters())
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
    assert namespace["counts"].shape == (len(params), NUM_COUNTS)
    # stall columns over the 10 steps; health columns on the reported step only
    assert (namespace["steps"], namespace["health_steps"]) == (10, 1)
    (line,) = printed.splitlines()
    m, v, changed = map(
        float, re.fullmatch(r"step 10: stalled m (\S+) v (\S+), .* (\S+)", line).groups()
    )
    assert 0 <= m <= 1 and 0 < v <= 1 and 0 < changed <= 1
    assert all(not opt.state[p]["v_codes"].any() for p in params)
    assert any(opt.state[p]["m_codes"].any() for p in params)


def python_blocks() -> dict[tuple[str, str], list[str]]:
    """Each distinct python block, keyed by (heading above it, code): where it stands."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in PYTHON_DOCS:
        for line, heading, code in blocks(path, "python"):
            found.setdefault((heading, code), []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _inside_backward(namespace: dict, before: list[torch.Tensor], printed: str) -> None:
    """The loop stepped every parameter inside backward on each of the ten batches and left
    no gradient behind."""
    model, opt, done = namespace["model"], namespace["opt"], namespace["done"]
    params = list(model.parameters())
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
    assert all(p.grad is None for p in params)
    assert done.skipped_units == [] and torch.isfinite(done.grad_norm)
    assert opt.take_stall_counts().steps == 10
    assert {int(opt.state[p]["step"]) for p in params} == {10}


# a python block's checks, by the heading it stands under (a new block needs an entry)
PYTHON_CHECKS = {
    "The optimizer in your own loop": _own_loop,
    "The step inside backward in your own loop": _inside_backward,
}
PYTHON_BLOCKS = python_blocks()


@pytest.mark.parametrize(
    ("heading", "code"), PYTHON_BLOCKS, ids=[",".join(w) for w in PYTHON_BLOCKS.values()]
)
def test_python_block_runs(heading, code, tiny_data):
    where = PYTHON_BLOCKS[heading, code][0]
    assert heading in PYTHON_CHECKS, f"{where}: no check for blocks under {heading!r}"
    model, batches = _small_model(Path(tiny_data))
    before = [p.detach().clone() for p in model.parameters()]
    namespace = {"model": model, "batches": batches}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, where, "exec"), namespace)
    PYTHON_CHECKS[heading](namespace, before, printed.getvalue())


def test_the_stall_figure_in_the_opening_is_the_theorys():
    """The opening's BF16 ``v`` stall share is what ``srtrain theory`` computes."""
    from srtrain.theory import stall_probability

    share = stall_probability("bf16", 0.999, "nearest", "v")
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"in BF16 at β₂=0.999, {share:.1%} of `v` updates" in text
