"""Experiment configs load and say what their names say; the launch scripts run torchrun."""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from srtrain.config import Config, load_config, validate_world
from srtrain.metrics import read_records
from srtrain.plan import plan_run

from conftest import TINY_DATA
from distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
LAUNCH = ROOT / "launch"
RECIPES = ("llama-60m", "llama-100m", "llama-350m", "llama-1b", "neox-160m", "neox-410m")
VARIANTS = {  # name suffix -> (m_format, v_format, rounding, resets.mode)
    "fp32": ("fp32", "fp32", "nearest", "none"),
    "bf16": ("bf16", "bf16", "stochastic", "none"),
    "fp8": ("fp8", "fp8", "stochastic", "none"),
    "fp4": ("fp4_e2m1", "fp4_e2m2", "stochastic", "none"),
}
VARIANT_KEYS = {
    "optim.m_format",
    "optim.v_format",
    "optim.m_rounding",
    "optim.v_rounding",
    "resets.mode",
    "train.run_dir",
}
PEAK_LR = {
    "llama-60m": 1e-3,
    "llama-100m": 1e-3,
    "llama-350m": 4e-4,
    "llama-1b": 3e-4,
    "neox-160m": 6e-4,
    "neox-410m": 3e-4,
}
NODE_GPUS = 8
SCRIPTS = ("single_node.sh", "multi_node.sh", "slurm.sbatch")
STEP_LINE = re.compile(r"^step (\d+)/\d+ \| \S+ elapsed, ETA \S+ \| loss (\S+)", re.MULTILINE)


def _flat(cfg: Config) -> dict[str, object]:
    return {
        f"{section}.{key}": value
        for section, values in cfg.to_dict().items()
        for key, value in values.items()
    }


def _config_files() -> list[Path]:
    return sorted(CONFIGS.glob("*.yaml"))


# ------------------------------------------------------------------------------ configs


def test_config_directory_holds_tiny_recipes_and_all_variants():
    names = {p.stem for p in _config_files()}
    expected = {"tiny", *RECIPES, *(f"{r}-{v}" for r in RECIPES for v in VARIANTS)}
    assert names == expected


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.stem)
def test_every_config_loads_and_names_its_run_dir(path):
    cfg = load_config(path)
    assert cfg.train.run_dir == f"runs/{path.stem}"


def test_tiny_is_the_default_config():
    assert load_config(CONFIGS / "tiny.yaml") == Config()
    tree = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    defaults = Config().to_dict()
    assert {s: set(v) for s, v in tree.items()} == {s: set(v) for s, v in defaults.items()}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_hyperparameters(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    o, t = cfg.optim, cfg.train
    assert cfg.model.preset == name
    assert cfg.model.seq_len == (2048 if name.startswith("neox") else 1024)
    assert o.lr == PEAK_LR[name]
    assert (o.beta1, o.beta2) == (0.9, 0.999)
    assert (o.weight_decay, o.grad_clip, o.min_lr_ratio) == (0.1, 1.0, 0.1)
    assert 0.01 * t.steps <= o.warmup_steps <= 0.1 * t.steps
    assert (o.m_format, o.v_format) == ("bf16", "bf16")
    assert (o.m_rounding, o.v_rounding) == ("stochastic", "stochastic")
    assert cfg.resets.mode == "none"
    assert cfg.parallel.compute_dtype == "bf16"
    # compiled on CUDA, and checkpointing only where the planner says a run needs it: on
    # one node of 8 H200s, none does at its own micro-batch
    assert (cfg.parallel.compile, cfg.parallel.activation_checkpointing) == ("auto", "auto")
    assert plan_run(cfg, 8).checkpointing == (False, False)
    assert cfg.data.dir == f"data/{name}"
    assert cfg.data.vocab_size == 32000
    assert cfg.data.source.split(":")[0].count("/") == 1  # a Hugging Face dataset name
    assert cfg.data.max_bytes is not None
    assert (cfg.checkpoint.interval, cfg.checkpoint.keep) == (1000, 3)
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    assert tokens_per_step == (2**18 if name in ("llama-60m", "llama-100m") else 2**19)
    # ~4 bytes of text per token: the prepared corpus covers the whole run without repeating
    assert cfg.data.max_bytes >= 4.2 * tokens_per_step * t.steps
    for nodes in (1, 2):
        validate_world(cfg, nodes * NODE_GPUS)


@pytest.mark.parametrize("suffix", VARIANTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_variant_changes_only_state_keys(recipe, suffix):
    path = CONFIGS / f"{recipe}-{suffix}.yaml"
    tree = yaml.safe_load(path.read_text())
    assert tree.pop("base") == f"{recipe}.yaml"
    written = {f"{s}.{k}" for s, values in tree.items() for k in values}
    assert written <= VARIANT_KEYS
    base, variant = _flat(load_config(CONFIGS / f"{recipe}.yaml")), _flat(load_config(path))
    changed = {key for key in base if base[key] != variant[key]}
    assert "train.run_dir" in changed
    assert changed <= VARIANT_KEYS
    m_format, v_format, rounding, resets = VARIANTS[suffix]
    assert (variant["optim.m_format"], variant["optim.v_format"]) == (m_format, v_format)
    assert variant["optim.m_rounding"] == variant["optim.v_rounding"] == rounding
    assert variant["resets.mode"] == resets


# ------------------------------------------------------------------------------- launch


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_script_is_executable_strict_and_documented(script):
    path = LAUNCH / script
    assert os.access(path, os.X_OK)
    subprocess.run(["bash", "-n", str(path)], check=True)
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert any(line.startswith("# Usage") for line in lines[1:12])
    assert "set -euo pipefail" in lines


def test_slurm_script_requests_whole_requeueable_nodes():
    text = (LAUNCH / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.MULTILINE))
    assert directives["gpus-per-node"] == "8"
    assert directives["ntasks-per-node"] == "1"
    assert {"nodes", "exclusive", "requeue", "time"} <= set(directives)
    assert directives["output"].startswith("logs/")
    assert "scontrol show hostnames" in text
    assert "launch/multi_node.sh" in text


# Stand-ins for SLURM's commands: srun runs until a SIGTERM reaches it (SLURM signals the
# processes of a job step; scancel --signal does that here), and every call is logged.
_SRUN = """#!/usr/bin/env bash
echo $$ > "$STUBS/srun.pid"
trap 'echo "srun: SIGTERM" >> "$STUBS/log"; exit 143' TERM
while :; do sleep 0.05; done
"""
_SCANCEL = """#!/usr/bin/env bash
echo "scancel $*" >> "$STUBS/log"
kill -TERM "$(cat "$STUBS/srun.pid")"
"""
_SCONTROL = """#!/usr/bin/env bash
if [[ "$1" == show ]]; then echo node001; else echo "scontrol $*" >> "$STUBS/log"; fi
"""


def _slurm_job(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """slurm.sbatch started as SLURM would (job 42), with its srun running."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in (("srun", _SRUN), ("scancel", _SCANCEL), ("scontrol", _SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUBS": str(stubs),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node001",
        "SLURM_JOB_NUM_NODES": "1",
        "SRTRAIN_ROOT": str(ROOT),
    }
    job = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), "train.steps=10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (stubs / "srun.pid").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.02)
    return job, stubs


def test_slurm_job_stops_its_ranks_ahead_of_the_time_limit_and_requeues(tmp_path):
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.MULTILINE)
    job, stubs = _slurm_job(tmp_path)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch script
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 143, out
    assert (stubs / "log").read_text().splitlines() == [
        "scancel --signal=TERM 42",
        "srun: SIGTERM",
        "scontrol requeue 42",
    ]
    assert "requeued" in out


def test_slurm_job_ended_by_slurm_waits_for_its_ranks(tmp_path):
    """Preemption or scancel: SLURM signals every process; the script waits for the ranks to
    save and neither signals them again nor requeues (SLURM requeues a preempted job)."""
    job, stubs = _slurm_job(tmp_path)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert job.poll() is None  # still waiting for srun
    os.kill(int((stubs / "srun.pid").read_text()), signal.SIGTERM)
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 143, out
    assert (stubs / "log").read_text().splitlines() == ["srun: SIGTERM"]


def test_multi_node_needs_its_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "HEAD_NODE_ADDR")}
    proc = subprocess.run(
        [str(LAUNCH / "multi_node.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode != 0
    assert "NNODES" in proc.stderr


def _launch(
    script: str, env: dict[str, str], data_dir: str, run_dir: Path, cwd: Path
) -> tuple[list[int], list[float]]:
    """Run a launch script on 2 CPU ranks for 3 steps; the logged steps and losses."""
    overrides = {
        "train.steps": 3,
        "train.log_interval": 1,
        "train.val_interval": 0,
        "parallel.device": "cpu",
        "train.global_batch_size": 4,
        "data.dir": data_dir,
        **TINY_DATA,
        "train.run_dir": str(run_dir),
    }
    full_env = {
        **os.environ,
        **env,
        "TORCHRUN": f"{shlex.quote(sys.executable)} -m torch.distributed.run",
    }
    proc = subprocess.run(
        [str(LAUNCH / script), *(f"{k}={v}" for k, v in overrides.items())],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    logged = [int(m.group(1)) for m in STEP_LINE.finditer(output)]
    losses = [r["loss"] for r in read_records(run_dir)]
    return logged, losses


@pytest.fixture(scope="module")
def launched(tiny_data, tmp_path_factory) -> dict[str, tuple[list[int], list[float]]]:
    """Both launchers, each run once from a directory outside the repository."""
    tmp = tmp_path_factory.mktemp("launch")
    return {
        "single": _launch("single_node.sh", {"GPUS": "2"}, tiny_data, tmp / "single", tmp),
        "multi": _launch(
            "multi_node.sh",
            {
                "NNODES": "1",
                "GPUS_PER_NODE": "2",
                "HEAD_NODE_ADDR": "127.0.0.1",
                "RDZV_PORT": str(free_port()),
                "RDZV_ID": "test-configs",
            },
            tiny_data,
            tmp / "multi",
            tmp,
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["single", "multi"])
def test_launcher_trains_on_two_cpu_ranks(launched, launcher):
    logged, losses = launched[launcher]
    assert logged == [1, 2, 3]
    assert len(losses) == 3
    vocab = TINY_DATA["data.vocab_size"]
    assert all(math.isfinite(x) and abs(x - math.log(vocab)) < 1.0 for x in losses)


@pytest.mark.slow
def test_launchers_agree_bit_for_bit(launched):
    assert launched["single"][1] == launched["multi"][1]
