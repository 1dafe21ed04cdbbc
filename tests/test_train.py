"""End-to-end training: ./train, 2-rank FSDP2 runs, resets, TensorBoard, two-node torchrun."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from srtrain.checkpoint import checkpoint_dirs
from srtrain.data import load_meta, prepare
from srtrain.errors import DEBUG_ENV
from srtrain.metrics import read_records

from conftest import tiny_overrides
from distributed import free_port, set_worker_env, worker_env
from tb_server import read_tensorboard_scalars

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train")
REQUIRED_TAGS = [
    "loss/train",
    "loss/val",
    "lr",
    "grad_norm",
    "throughput/tokens_per_s",
    "mfu",
    "memory/max_allocated_gib",
    "stall/m",
    "stall/v",
    "stall/param_changed",
    "stall_predicted/m",
    "stall_predicted/v",
    "reset/m",
    "reset/v",
    "stall/m/attention",
    "stall/v/mlp",
    "stall/v/embeddings",
    "stall/v/norms",
    "stall/m/head",
    "underflow/m",
    "underflow/v",
    "saturated/m",
    "saturated/v",
    "scale_changed/m",
    "scale_changed/v",
    "underflow/m/attention",
    "saturated/v/mlp",
    "scale_changed/m/embeddings",
    "scale_changed/v/head",
]
STATE_COUNT_KEYS = ("underflow_m", "underflow_v", "saturated_m", "saturated_v")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    set_worker_env(rank, world, port, OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from srtrain.config import load_config
    from srtrain.trainer import run

    result = run(load_config(None, overrides))
    reports = {
        step: {"m": r.stalled["m"], "v": r.stalled["v"]} for step, r in result.stall_reports.items()
    }
    Path(f"{out}.{rank}").write_text(
        json.dumps(
            {
                "losses": result.losses,
                "val": result.val_losses,
                "resets": result.resets,
                "stalls": reports,
                "state_bytes": result.state_bytes_per_param,
            }
        )
    )
    dist.destroy_process_group()


def spawn_run(world: int, overrides: list[str], out: Path) -> list[dict]:
    mp.spawn(_worker, args=(world, free_port(), overrides, str(out)), nprocs=world, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


@pytest.mark.slow
def test_train_executable_runs_and_learns(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            TRAIN,
            *tiny_overrides(tiny_data, run_dir, **{"parallel.compute_dtype": "bf16"}),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert any("stall m " in line and " v " in line for line in lines), proc.stdout
    losses = [r["loss"] for r in read_records(run_dir)]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 0.5
    logged = [r for r in read_records(run_dir) if "stall_m" in r]
    # BF16 states: underflow and saturation fractions, no block scales to change
    assert logged and all(0.0 <= r[k] <= 1.0 for r in logged for k in STATE_COUNT_KEYS)
    assert not any(k.startswith("scale_changed") for r in logged for k in r)
    assert (run_dir / "config.yaml").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["optim.v_format=fp6"], "error: optim.v_format: unknown format 'fp6'"),
        (["--config", "missing.yaml"], "error: config file not found: missing.yaml"),
        (["data.dir=/nonexistent/d", "data.source=/nonexistent/corpus.txt"], "error: "),
        (
            ["data.dir=data/bultin"],
            "error: data.dir data/bultin does not exist; set data.source to prepare it there",
        ),
        (
            ["optim.name=torch_adamw", "resets.mode=periodic", "resets.v_period=5"],
            "error: resets.mode: 'periodic' resets SRAdamW's states",
        ),
        pytest.param(
            ["parallel.device=cuda"],
            "error: parallel.device: 'cuda' asked for, but no CUDA device is available here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
    ],
)
def test_bad_config_or_data_is_one_line(args, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, TRAIN, *args, f"train.run_dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_default_data_dir_is_prepared_from_builtin(tmp_path):
    """The default job's data/builtin, missing, is prepared from the builtin corpus (the
    config names no source) and trains."""
    proc = subprocess.run(
        [
            sys.executable,
            TRAIN,
            "data.max_bytes=300000",
            "data.vocab_size=512",
            "model.seq_len=32",
            "train.global_batch_size=2",
            "train.steps=2",
            "train.val_batches=1",
            "parallel.device=cpu",
            "train.run_dir=run",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "data: preparing data/builtin from builtin" in proc.stdout
    assert load_meta(tmp_path / "data" / "builtin").source["kind"] == "builtin"
    assert [r["step"] for r in read_records(tmp_path / "run")] == [1, 2]


def short_val_data(tiny_data: str, out: Path) -> Path:
    """A data dir in the tiny data's tokens whose val split is one document of about 130
    tokens (20 documents, 5% held out)."""
    words = ["def", "value", "return", "self", "import", "while", "print", "None"]
    docs = [" ".join(words[(i * j) % 8] for j in range(50)) for i in range(20)]
    source = out.parent / f"{out.name}.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return prepare(source, out, tokenizer=f"{tiny_data}/tokenizer.model", val_fraction=0.05)


@pytest.mark.slow
def test_short_validation_split_on_one_and_two_ranks(tiny_data, tmp_path, capfd):
    """A val split of 7 windows under a batch of 8 is validated on all of them: one notice
    line, the same loss on 1 and 2 ranks (rank 1's share of 4 padded), bit for bit the same
    after a resume."""
    data = short_val_data(tiny_data, tmp_path / "data")
    seq_len = (load_meta(data).splits["val"].num_tokens - 1) // 7
    kw = {
        "data.dir": str(data),
        "model.seq_len": seq_len,
        "train.steps": 2,
        "train.log_interval": 1,
        "train.val_interval": 1,
        "checkpoint.interval": 1,
    }
    notice = (
        f"validation: split 'val' has 7 windows of seq_len {seq_len}, fewer than a batch of 8; "
        "validating on those 7 windows"
    )
    two = spawn_run(2, tiny_overrides(tiny_data, tmp_path / "two", **kw), tmp_path / "two")
    assert capfd.readouterr().out.count(notice) == 1
    one = spawn_run(1, tiny_overrides(tiny_data, tmp_path / "one", **kw), tmp_path / "one")
    assert capfd.readouterr().out.count(notice) == 1
    assert two[0]["val"] == two[1]["val"] and set(two[0]["val"]) == {"1", "2"}
    # the weights of a 2-rank run differ from a 1-rank run's in their last bits only; a share
    # of the windows left out would move the loss by far more than this tolerance
    assert two[0]["val"] == pytest.approx(one[0]["val"], rel=1e-5)
    assert abs(two[0]["val"]["2"] - two[0]["val"]["1"]) > 1e-3  # it measures the model

    shutil.rmtree(dict(checkpoint_dirs(tmp_path / "two"))[2])
    resumed = spawn_run(2, tiny_overrides(tiny_data, tmp_path / "two", **kw), tmp_path / "again")
    assert resumed[0]["val"] == {"2": two[0]["val"]["2"]}
    assert [r["val_loss"] for r in read_records(tmp_path / "two")] == [
        two[0]["val"]["1"],
        two[0]["val"]["2"],
    ]


@pytest.mark.slow
def test_two_ranks_llama_neox_resets_and_tensorboard(tiny_data, tmp_path):
    """2-rank FSDP2 runs learn; both ranks reset alike; stalls track the 1-rank run; TB tags."""
    reset_kw = {
        "resets.mode": "periodic",
        "resets.m_period": 10,
        "resets.v_period": 10,
        "optim.m_format": "fp8",
        "optim.v_format": "fp4",
        "train.steps": 20,
        "train.val_interval": 10,
        "train.peak_flops": 1e12,
    }  # MFU needs a peak
    two = spawn_run(2, tiny_overrides(tiny_data, tmp_path / "two", **reset_kw), tmp_path / "two")
    one = spawn_run(1, tiny_overrides(tiny_data, tmp_path / "one", **reset_kw), tmp_path / "one")
    assert two[0]["losses"] == two[1]["losses"]  # the loss is all-reduced
    assert two[0]["resets"] == two[1]["resets"] == {"10": ["m", "v"], "20": ["m", "v"]}
    losses = two[0]["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    # the runs drift apart in their last bits, most after a reset, when v's stalled fraction
    # climbs by about 0.03 a step: they agree within 0.05 (an aggregation error, such as
    # one rank's stalls over both ranks' elements, would halve a fraction of 0.6 or more)
    for step, stalls in two[0]["stalls"].items():
        for state in ("m", "v"):
            assert abs(stalls[state] - one[0]["stalls"][step][state]) < 0.05, (step, state)
    neox = spawn_run(
        2,
        tiny_overrides(
            tiny_data,
            tmp_path / "neox",
            **{"model.preset": "neox-tiny", "train.steps": 20, "parallel.compute_dtype": "bf16"},
        ),
        tmp_path / "neox",
    )
    assert sum(neox[0]["losses"][-5:]) / 5 < neox[0]["losses"][0] - 0.5
    scalars = read_tensorboard_scalars(tmp_path / "two" / "tb", REQUIRED_TAGS)
    run = next(iter(scalars.values()))
    assert {step for step, value in run["reset/v"] if value == 1.0} == {10, 20}
    assert all(0.0 <= v <= 1.0 for _, v in run["stall/v"])
    assert all(0.0 < v <= 1.0 for _, v in run["scale_changed/v"])
    logged = [r for r in read_records(tmp_path / "two") if "stall_m" in r]
    keys = (*STATE_COUNT_KEYS, "scale_changed_m", "scale_changed_v")
    assert logged and all(0.0 <= r[k] <= 1.0 for r in logged for k in keys)
    assert all(v > 0 for _, v in run["throughput/tokens_per_s"])
    assert [round(v, 4) for _, v in run["loss/train"]] == [round(x, 4) for x in losses[4::5]]


@pytest.mark.slow
def test_reducing_every_micro_batch_accumulates_the_same_gradients(tiny_data, tmp_path):
    common = {
        "train.steps": 4,
        "train.micro_batch_size": 2,
        "train.val_interval": 0,
        "checkpoint.enabled": "false",
    }
    once, every = (
        spawn_run(
            2,
            tiny_overrides(
                tiny_data, tmp_path / name, **common, **{"parallel.reduce_every_micro_batch": flag}
            ),
            tmp_path / f"{name}.json",
        )[0]
        for name, flag in (("once", "false"), ("every", "true"))
    )
    # FP32 gradients summed in another order: the same run to float tolerance
    assert len(once["losses"]) == 4
    assert once["losses"] == pytest.approx(every["losses"], rel=1e-5, abs=1e-6)


def test_one_fsdp_unit_trains_and_resumes_as_a_unit_a_block(tiny_data, tmp_path):
    """parallel.fsdp_units=model (one unit, auto's choice in one process) and blocks give the
    same losses and stall counts bit for bit, over accumulated micro-batches; a checkpoint
    of one resumes in the other and continues the curve exactly."""
    common = {
        "train.steps": 4,
        "train.micro_batch_size": 4,
        "train.log_interval": 1,
        "train.val_interval": 0,
        "checkpoint.interval": 2,
        "checkpoint.keep": 2,
    }
    runs = {
        units: spawn_run(
            1,
            tiny_overrides(tiny_data, tmp_path / units, **common, **{"parallel.fsdp_units": units}),
            tmp_path / f"{units}.json",
        )[0]
        for units in ("model", "blocks")
    }
    assert len(runs["model"]["losses"]) == 4
    assert runs["model"] == runs["blocks"]
    seed = tmp_path / "model" / "checkpoints" / "step-2"
    resumed = spawn_run(
        1,
        tiny_overrides(
            tiny_data,
            tmp_path / "resumed",
            **common,
            **{"parallel.fsdp_units": "blocks", "checkpoint.load": str(seed)},
        ),
        tmp_path / "resumed.json",
    )[0]
    assert resumed["losses"] == runs["model"]["losses"][2:]


@pytest.mark.slow
def test_torch_adamw_baseline_matches_fp32_states_and_resumes_exactly(tiny_data, tmp_path):
    """optim.name=torch_adamw trains on 2 ranks with 8 state bytes a parameter and no stall
    reports, tracks SRAdamW with FP32 states, and resumes from a checkpoint bit for bit."""
    kw = {
        "train.steps": 12,
        "train.log_interval": 1,
        "train.val_interval": 0,
        "checkpoint.interval": 6,
        "checkpoint.keep": 3,
    }
    torch_kw = {**kw, "optim.name": "torch_adamw"}
    full = spawn_run(2, tiny_overrides(tiny_data, tmp_path / "full", **torch_kw), tmp_path / "full")
    assert full[0]["stalls"] == {} and full[0]["state_bytes"] == 8.0
    assert all("stall_m" not in r for r in read_records(tmp_path / "full"))
    fp32 = spawn_run(
        2,
        tiny_overrides(
            tiny_data,
            tmp_path / "fp32",
            **kw,
            **{
                "optim.m_format": "fp32",
                "optim.v_format": "fp32",
                "optim.m_rounding": "nearest",
                "optim.v_rounding": "nearest",
            },
        ),
        tmp_path / "fp32",
    )
    assert full[0]["losses"][0] == fp32[0]["losses"][0]
    assert max(abs(a - b) for a, b in zip(full[0]["losses"], fp32[0]["losses"], strict=True)) < 1e-3
    step6 = dict(checkpoint_dirs(tmp_path / "full"))[6]
    resumed = spawn_run(
        2,
        tiny_overrides(
            tiny_data, tmp_path / "resumed", **torch_kw, **{"checkpoint.load": str(step6)}
        ),
        tmp_path / "resumed",
    )
    assert resumed[0]["losses"] == full[0]["losses"][6:]


@pytest.mark.slow
def test_two_node_torchrun_matches_single_node(tiny_data, tmp_path):
    """Two rendezvous participants on 127.0.0.1 train exactly like two local ranks."""
    overrides = tiny_overrides(
        tiny_data, tmp_path / "nodes", **{"train.steps": 10, "train.val_interval": 0}
    )
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-node-test",
        "--max-restarts",
        "0",
        TRAIN,
        *overrides,
    ]
    nodes = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outputs
    two_node = [r["loss"] for r in read_records(tmp_path / "nodes")]
    local = spawn_run(
        2,
        tiny_overrides(
            tiny_data, tmp_path / "local", **{"train.steps": 10, "train.val_interval": 0}
        ),
        tmp_path / "local",
    )
    assert two_node == local[0]["losses"]


def _tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _two_ranks(args: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """``train`` on 2 gloo ranks, each its own process started as torchrun starts workers."""
    port = free_port()
    env = _env()
    env.pop(DEBUG_ENV, None)
    procs = [
        subprocess.Popen(
            [sys.executable, TRAIN, *args],
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, **worker_env(r, 2, port)},
        )
        for r in range(2)
    ]
    return [
        subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs
    ]


def _assert_one_line(ranks: list[subprocess.CompletedProcess], message: str) -> None:
    """Exit code 2 on every rank; one ``error:`` line in all, from rank 0; no traceback."""
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-3000:] for r in ranks]
    assert ranks[0].stderr.startswith(f"error: {message}"), ranks[0].stderr
    assert ranks[0].stderr.count("\n") == 1 and ranks[1].stderr == "", ranks[1].stderr


@pytest.mark.slow
def test_refused_starts_are_one_line_and_write_nothing(tiny_data, tmp_path):
    """A resume onto checkpoints of another state format, a run dir whose checkpoints are all
    corrupt, and a run dir that cannot be created: on 2 ranks each is one line from rank 0,
    exit code 2 on both ranks, and the run dir stays byte for byte as it was; one corrupt
    checkpoint is passed over with one log line."""
    run_dir = tmp_path / "run"
    base = tiny_overrides(
        tiny_data,
        run_dir,
        **{"train.log_interval": 2, "train.val_interval": 0, "checkpoint.interval": 2},
    )
    done = subprocess.run(
        [sys.executable, TRAIN, *base, "train.steps=4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    steps = {step: path for step, path in checkpoint_dirs(run_dir)}
    assert sorted(steps) == [2, 4]
    before = _tree(run_dir)

    other_format = _two_ranks([*base, "train.steps=6", "optim.v_format=fp8"], tmp_path)
    _assert_one_line(other_format, f"checkpoint {steps[4]} has v_format bf16 but the run uses fp8")
    assert _tree(run_dir) == before  # config.yaml, metrics.jsonl, tb, checkpoints

    for path in steps.values():  # garbled: found by whichever rank hashes the file
        data = path / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = _tree(run_dir)
    corrupt = _two_ranks([*base, "train.steps=6"], tmp_path)
    _assert_one_line(
        corrupt,
        f"every checkpoint in {run_dir / 'checkpoints'} is corrupt (2; "
        "step-4: checkpoint file __0_0.distcp does not match its sha256",
    )
    assert _tree(run_dir) == before

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = _two_ranks([*base, f"train.run_dir={blocker}/sub"], tmp_path)
    _assert_one_line(
        unwritable, f"train.run_dir: {blocker}/sub cannot be created: {blocker} is not a directory"
    )


@pytest.mark.slow
def test_a_run_that_skips_most_steps_warns_and_fails(tiny_data, tmp_path):
    """optim.lr=1e3: every step after the first has a non-finite gradient norm and is
    skipped; the run ends with one warning line and exit code 3, and metrics.jsonl stays
    strict JSON (null for the non-finite values)."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        tiny_data, run_dir, **{"optim.lr": 1000.0, "train.steps": 6, "train.log_interval": 1}
    )
    proc = subprocess.run(
        [sys.executable, TRAIN, *overrides], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "warning: 5 of the 6 steps trained were skipped for a non-finite gradient norm (83%, "
        "over train.max_skipped_fraction=0.1): the model did not train as configured; lower "
        "optim.lr or check the data"
    )
    assert proc.stdout.strip().splitlines()[-1].startswith("done: 6 steps")

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["grad_norm"] for r in records][1:] == [None] * 5
    assert [r["step"] for r in read_records(run_dir)] == list(range(1, 7))
