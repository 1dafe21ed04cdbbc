"""srtrain.eval: the trainer's own validation loss of a checkpoint or an HF directory, on one
process and on two gloo ranks; data that does not fit the model refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import LlamaConfig, LlamaForCausalLM

import srtrain
from srtrain.checkpoint import latest
from srtrain.config import ConfigError, load_config
from srtrain.data import prepare
from srtrain.eval import Settings, checkpoint_source, evaluate, hf_source, main
from srtrain.export import export
from srtrain.metrics import format_log_line, read_records
from srtrain.parallel import init_distributed

from conftest import tiny_overrides
from distributed import free_port, set_worker_env

STEPS = 6


@pytest.fixture
def process_group():
    """Tear down the group of one that in-process runs start."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def code_data(tiny_data, tmp_path_factory) -> str:
    """Another corpus (srtrain's own sources) tokenized with the tiny corpus' tokenizer."""
    root = tmp_path_factory.mktemp("code")
    for module in Path(srtrain.__file__).parent.glob("*.py"):
        (root / "text").mkdir(exist_ok=True)
        (root / "text" / f"{module.stem}.txt").write_text(module.read_text())
    tokenizer = Path(tiny_data) / "tokenizer.model"
    return str(prepare(root / "text", root / "data", tokenizer=tokenizer, val_fraction=0.3))


@pytest.fixture(scope="module")
def trained(tiny_data, code_data, tmp_path_factory) -> Path:
    """A run dir of llama-tiny trained for a few steps on the tiny corpus, validated on it and
    on ``code_data`` (``train.val_sets``)."""
    from srtrain.trainer import run

    run_dir = tmp_path_factory.mktemp("eval") / "run"
    overrides = {
        "train.steps": STEPS,
        "train.val_interval": STEPS // 2,
        "train.log_interval": 1,
        "train.val_sets": f"[code={code_data}]",
    }
    result = run(load_config(None, tiny_overrides(tiny_data, run_dir, **overrides)))
    dist.destroy_process_group()
    assert list(result.val_set_losses) == ["code"]
    assert list(result.val_set_losses["code"]) == list(result.val_losses) == [3, 6]
    return run_dir


def _val_loss(run_dir: Path, key: str = "val_loss") -> float:
    """The run's last validation loss (``key``) in metrics.jsonl."""
    return [r[key] for r in read_records(run_dir) if key in r][-1]


def test_checkpoint_loss_is_the_trainers_val_loss(
    trained, tiny_data, code_data, capsys, process_group
):
    argv = ["--checkpoint", str(trained), "--data", tiny_data, "--device", "cpu"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"srtrain.eval: {latest(trained)}"
    want = _val_loss(trained)
    assert lines[1] == (
        f"{tiny_data}: loss {want:.4f}, perplexity {math.exp(want):.3f} "
        "(val split, 2 batches of 8 × 64 tokens)"
    )
    source = checkpoint_source(trained, {})
    assert source.settings == Settings(seq_len=64, batch_size=8, batches=2)
    main_set, code = evaluate(source, [tiny_data, code_data], init_distributed("cpu"))
    assert main_set.loss == want  # the same windows, the same sharded model: bit for bit
    assert code.loss == _val_loss(trained, "val_loss/code") != want


def test_val_sets_are_logged_beside_the_main_validation(trained, code_data):
    records = {r["step"]: r for r in read_records(trained)}
    assert [s for s, r in records.items() if "val_loss/code" in r] == [3, 6]
    assert all(math.isfinite(records[s]["val_loss/code"]) for s in (3, 6))
    events = EventAccumulator(str(trained / "tb"))
    events.Reload()
    logged = events.Scalars("loss/val/code")
    assert [e.step for e in logged] == [3, 6]
    assert logged[-1].value == pytest.approx(records[6]["val_loss/code"])


def test_val_sets_are_checked_before_step_one(tiny_data, code_data, tmp_path, process_group):
    from srtrain.trainer import run

    other = prepare("builtin", tmp_path / "other", vocab_size=512, max_bytes=150_000)
    cases = {
        str(tmp_path / "missing"): f"train.val_sets: missing: no prepared data at {tmp_path}",
        str(other): f"train.val_sets: other: {other} was tokenized with another tokenizer than "
        f"the run's data {tiny_data}; prepare it with that tokenizer (python -m srtrain.data "
        f"prepare --tokenizer {tiny_data}/tokenizer.model ...)",
    }
    for entry, message in cases.items():
        overrides = {"train.val_sets": f"[{entry}]"}
        cfg = load_config(None, tiny_overrides(tiny_data, tmp_path / "run", **overrides))
        with pytest.raises(ConfigError) as info:
            run(cfg)
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_exported_model_gives_the_checkpoint_loss(trained, tiny_data, tmp_path, process_group):
    export(latest(trained), tmp_path / "hf")
    info = init_distributed("cpu")
    [whole] = evaluate(hf_source(tmp_path / "hf", {"seq_len": 64}), [tiny_data], info)
    overrides = {"batch_size": 8, "batches": whole.batches}
    [again] = evaluate(checkpoint_source(trained, overrides), [tiny_data], info)
    assert whole.batches == again.batches > 2  # the whole split
    assert whole.loss == pytest.approx(again.loss, rel=1e-6)


def _one_error(capsys, argv: list[str]) -> str:
    assert main([*argv, "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    return captured.err.removeprefix("error: ").strip()


def test_data_that_does_not_fit_is_one_line(trained, tiny_data, tmp_path, capsys, process_group):
    other = prepare("builtin", tmp_path / "other", vocab_size=512, max_bytes=150_000)
    message = _one_error(capsys, ["--checkpoint", str(trained), "--data", str(other)])
    assert message.startswith(
        f"{other} was tokenized with another tokenizer than the run of {latest(trained)}"
    )
    assert "prepare it with that tokenizer" in message

    small = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_hidden_layers=1,
            max_position_embeddings=64,
        )
    )
    small.save_pretrained(tmp_path / "small")
    capsys.readouterr()
    message = _one_error(capsys, ["--hf", str(tmp_path / "small"), "--data", tiny_data])
    assert message == (
        f"{tiny_data} has a vocabulary of 512 tokens, more than the 300 of the model of "
        f"{tmp_path / 'small'}; prepare it with the model's tokenizer "
        "(python -m srtrain.data prepare --tokenizer ...)"
    )
    message = _one_error(
        capsys, ["--checkpoint", str(trained), "--data", tiny_data, "--seq-len", "128"]
    )
    assert message == (
        f"--seq-len 128 is longer than the model of {latest(trained)} takes (64 positions); "
        "lower --seq-len"
    )
    message = _one_error(capsys, ["--checkpoint", str(trained), "--data", str(tmp_path / "no")])
    assert message.startswith(f"no prepared data at {tmp_path / 'no'}")
    message = _one_error(capsys, ["--checkpoint", str(tmp_path / "none"), "--data", tiny_data])
    assert "does not exist" in message
    message = _one_error(
        capsys, ["--checkpoint", str(trained), "--data", tiny_data, "--batch-size", "0"]
    )
    assert message == "--batch-size: must be > 0, got 0"


def _rank_worker(rank: int, port: int, run_dir: str, data: str, out: str) -> None:
    set_worker_env(rank, 2, port, OMP_NUM_THREADS="1")
    info = init_distributed("cpu")
    overrides = {"batches": 5}
    results = evaluate(checkpoint_source(run_dir, overrides), [data, data], info)
    Path(out, f"rank-{rank}.json").write_text(json.dumps([r.loss for r in results]))
    dist.barrier()  # no rank tears its group down while another still uses it
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_the_one_process_loss(trained, tiny_data, tmp_path, process_group):
    mp.start_processes(
        _rank_worker,
        args=(free_port(), str(trained), tiny_data, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    losses = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    overrides = {"batches": 5}
    [alone] = evaluate(checkpoint_source(trained, overrides), [tiny_data], init_distributed("cpu"))
    assert losses[0] == losses[1]  # every rank gets the global result
    assert losses[0][0] == losses[0][1] == pytest.approx(alone.loss, rel=1e-6)


def test_console_line_shows_each_val_set():
    line = format_log_line(6, {"loss/val": 2.5, "loss/val/code": 3.25, "loss/val/web": 4.0})
    assert line == "step 6 | val loss 2.5000 | val code 3.2500 | val web 4.0000"
