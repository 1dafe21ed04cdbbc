"""``python -m srtrain.bench.node``: the one-node benchmark, every part in one command.

On a node of N GPUs (``torch.cuda.device_count()``, or ``--gpus``) it runs, each part in its
own torchrun launches under a timeout, one JSON file per part under ``--out``:

- ``70b``: Llama-3-70B (GQA, vocabulary 128256), seq 4096, activation checkpointing, FSDP2
  over N GPUs: FP4 states with BF16 weights trains on a repeated batch (the loss falls), with
  tokens/s, MFU and peak memory per GPU beside ``srtrain.plan``'s; torch's AdamW (FP32) on
  the same shape, expected out of memory, with the phase where it ran out.
- ``70b-fp8``: FP8 states with FP32 master weights, the most layers of the 70B shape that fit
  (a ladder search from the planner's guess).
- ``stalls``: the trainer on the 70B shape (FP4 states, BF16 weights) and the builtin corpus:
  losses, and stall fractions per layer group beside the theory, in TensorBoard (its event
  files under ``stalls-run/``) and in the JSON.
- ``scaling``: LLaMA-7B at 1, 2, 4, …, N GPUs with the same per-GPU batch: tokens/s,
  scaling efficiency and the optimizer step's share of the step time, per variant.
- ``hsdp``: 2 replicas × N/2 shards against N-way FSDP: tokens/s, memory, and the replicas'
  parameters and optimizer states compared bit for bit after 50 steps.
- ``checkpoint``: the 70B run's DCP save (sync, async) and load: seconds and bytes on disk.
- ``resume``: the trainer on the 70B shape saves at N GPUs and resumes at N/2; the losses
  of both segments.

A part that fails or runs out of memory is recorded in its JSON, never fatal; a part whose
JSON already says ``ok`` is skipped unless ``--force``. ``--minutes`` bounds the whole run: no
launch starts that could not finish in time (its row says it was skipped). ``--dry`` runs
every part on the CPU with gloo, 2 ranks and tiny shapes: the plumbing, not the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from srtrain.bench.capacity import outcome, predicted_bytes, search_ladder
from srtrain.bench.capacity_trial import TrialSpec, rank_row_path
from srtrain.models import PRESETS, Shape, shape_config

PARTS = ("70b", "70b-fp8", "stalls", "scaling", "hsdp", "checkpoint", "resume")
SCALING_VARIANTS = ("torch", "fp8", "fp4-bf16w")
GPU_MEMORY_GIB_FALLBACK = 140.0  # the planner's H200 when no device reports its size
OOM_LIMIT_S = 300.0  # seconds for a launch expected to run out of memory
MIN_LAUNCH_S = 30.0  # no launch starts with less time than this left in the budget

# the trainer's settings for the 70B runs: FP4 states, BF16 weights, checkpointed blocks
BIG_TRAIN = (
    "optim.m_format=fp4",
    "optim.v_format=fp4",
    "parallel.bf16_params=true",
    "parallel.activation_checkpointing=true",
    "train.log_interval=1",
    "train.val_interval=0",
    "optim.warmup_steps=2",
    "optim.lr=3e-4",
)


@dataclass
class NodeSettings:
    """The sizes every part runs at: the GPU node's, or the tiny CPU ones of ``--dry``."""

    dry: bool
    gpus: int
    device: str
    big: Shape  # the 70B shape
    big_name: str
    big_vocab: int
    big_seq: int
    mid: Shape  # the 7B shape of scaling and HSDP
    mid_name: str
    mid_vocab: int
    mid_seq: int
    big_steps: tuple[int, int]  # warm-up, measured
    fp8_layers: tuple[int, ...]  # the 70b-fp8 ladder, fewest layers first
    scaling_steps: tuple[int, int]
    hsdp_steps: tuple[int, int]
    train_steps: int  # the stalls part's trainer run
    # steps before the save (within the LR warm-up, so the schedule does not depend on the
    # run's length) and in all after the resume (the stalls run's length: its straight losses)
    resume_steps: tuple[int, int]
    data_vocab: int
    data_max_bytes: int | None
    gpu_memory_gib: float
    variants: tuple[str, ...] = SCALING_VARIANTS
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_run(cls, dry: bool, gpus: int, gpu_memory_gib: float) -> NodeSettings:
        """The GPU settings, or with ``dry`` the CPU ones (2 ranks)."""
        if dry:
            tiny = Shape("llama", 128, 344, 4, 2, kv_heads=2)
            return cls(
                dry=True,
                gpus=2,
                device="cpu",
                big=tiny,
                big_name="llama-tiny-gqa",
                big_vocab=512,
                big_seq=64,
                mid=tiny,
                mid_name="llama-tiny-gqa",
                mid_vocab=512,
                mid_seq=64,
                big_steps=(1, 2),
                fp8_layers=(1, 2),
                scaling_steps=(1, 1),
                hsdp_steps=(1, 3),
                train_steps=3,
                resume_steps=(2, 3),
                data_vocab=512,
                data_max_bytes=600_000,
                gpu_memory_gib=gpu_memory_gib,
            )
        return cls(
            dry=False,
            gpus=gpus,
            device="cuda",
            big=PRESETS["llama3-70b"],
            big_name="llama3-70b",
            big_vocab=128256,
            big_seq=4096,
            mid=PRESETS["llama2-7b"],
            mid_name="llama2-7b",
            mid_vocab=32000,
            mid_seq=4096,
            big_steps=(2, 8),
            fp8_layers=(16, 24, 32, 40, 48, 56, 64, 72, 80),
            scaling_steps=(2, 5),
            hsdp_steps=(5, 45),
            train_steps=10,
            resume_steps=(2, 10),
            data_vocab=4096,
            data_max_bytes=4_000_000,  # ~1M tokens: the trainer runs read a third of it
            gpu_memory_gib=gpu_memory_gib,
        )

    def sizes(self) -> list[int]:
        """The scaling part's GPU counts: 1, 2, 4, … up to N, and N itself."""
        sizes, n = [], 1
        while n < self.gpus:
            sizes.append(n)
            n *= 2
        return [*sizes, self.gpus]


def child_env() -> dict[str, str]:
    """The environment of a child process: this one, with this srtrain first on the path and
    no torchrun rank variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


class Budget:
    """The run's time budget: how long the next launch may take."""

    def __init__(self, minutes: float | None, timeout: float) -> None:
        self.deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self.timeout = timeout

    def next_timeout(self) -> float | None:
        """Seconds the next launch may run, or None when the budget is spent."""
        if self.deadline is None:
            return self.timeout
        left = self.deadline - time.monotonic()
        return None if left < min(self.timeout, MIN_LAUNCH_S) else min(self.timeout, left)


class Node:
    """One run of the node benchmark: where it writes, what it runs at, its budget."""

    def __init__(
        self,
        out: Path,
        scratch: Path,
        settings: NodeSettings,
        budget: Budget,
        environment: dict,
        log: Callable[[str], None] = print,
    ) -> None:
        self.out, self.scratch, self.settings = out, scratch, settings
        self.budget, self.environment, self.log = budget, environment, log
        self.data_dir = scratch / "data" / "builtin"
        for d in (out, scratch):
            d.mkdir(parents=True, exist_ok=True)
        self.launches = 0

    # -- launching ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = child_env()
        if self.settings.dry:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def launch(
        self, name: str, nproc: int, args: list[str], row_path: Path, limit: float | None = None
    ) -> dict:
        """Run ``python -m srtrain.bench.node_rank ARGS`` on ``nproc`` ranks under torchrun,
        with the budget's timeout (at most ``limit`` seconds); the rows its ranks wrote, merged
        into one: rank 0's, with every rank's peak memory and the first failing rank's error.
        Without rows, the reason and the tail of the log."""
        timeout = self.budget.next_timeout()
        if timeout is None:
            return {"fit": False, "oom": False, "skipped": True, "error": "time budget spent"}
        timeout = timeout if limit is None else min(timeout, limit)
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.launches += 1
        log_path = logs / f"{self.launches:03d}-{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "srtrain.bench.node_rank",
            *args,
        ]
        start = time.perf_counter()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True
            )
            try:
                status = proc.wait(timeout=timeout)
                reason = f"launch exited with status {status}"
            except subprocess.TimeoutExpired:
                reason = f"timeout after {timeout:g} s"
            finally:  # no launch outlives this process
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall = time.perf_counter() - start
        rows = {}
        for rank in range(nproc):
            path = rank_row_path(row_path, rank)
            if path.exists():
                rows[rank] = json.loads(path.read_text())
        text = log_path.read_text(errors="replace")
        failed = [rows[r] for r in sorted(rows) if not rows[r].get("fit")]
        if 0 in rows:
            row = dict(rows[0])
        elif failed:
            row = dict(failed[0])
        else:
            row = {"fit": False, "oom": "out of memory" in text.lower(), "error": reason}
        if failed and row.get("fit", False):
            row.update(
                {k: failed[0][k] for k in ("fit", "oom", "phase", "error") if k in failed[0]}
            )
        if not row.get("fit") and not failed and 0 not in rows:
            row["log_tail"] = text.strip().splitlines()[-20:]
        peaks = [rows[r].get("peak_allocated_gib") for r in sorted(rows)]
        if (
            len(rows) > 1
            and all(p is not None for p in peaks)
            and "per_rank_peak_allocated_gib" not in row
        ):
            row["per_rank_peak_allocated_gib"] = peaks
            row["peak_allocated_gib"] = max(peaks)
        if failed:  # where each failing rank stopped, and its peak then
            keys = ("phase", "oom", "error", "failure_peak_allocated_gib")
            row["failed_ranks"] = {
                str(r): {k: rows[r][k] for k in keys if k in rows[r]}
                for r in sorted(rows)
                if not rows[r].get("fit")
            }
        row.update(wall_s=wall, launch=reason, log=str(log_path.relative_to(self.out)), nproc=nproc)
        return row

    def trial(
        self, name: str, spec: TrialSpec, after: str = "", limit: float | None = None
    ) -> dict:
        """One capacity trial on ``spec.gpus`` ranks (at most ``limit`` seconds), with the
        planner's peak per GPU."""
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        try:
            spec_path = work / "spec.json"
            spec_path.write_text(json.dumps(spec.to_dict()))
            args = ["trial", str(spec_path), str(work / "row.json")]
            if after:
                args += ["--after", after, "--root", str(self.scratch)]
            row = {
                **spec.row(),
                "name": name,
                **self.launch(name, spec.gpus, args, work / "row.json", limit),
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
        try:
            predicted = predicted_bytes(spec) / 2**30
            row.update(
                predicted_gib=predicted, predicted_fits=predicted <= self.settings.gpu_memory_gib
            )
        except ValueError as err:
            row["predicted_error"] = str(err)
        self.log(_line(row))
        return row

    def train(self, name: str, nproc: int, overrides: list[str]) -> dict:
        """One ``srtrain.trainer.run`` on ``nproc`` ranks, with the planner's peak per GPU."""
        work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        try:
            row = {
                "name": name,
                **self.launch(
                    name, nproc, ["train", str(work / "row.json"), *overrides], work / "row.json"
                ),
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
        try:
            from srtrain.config import load_config
            from srtrain.plan import plan_run

            cfg = load_config(None, overrides)
            predicted = plan_run(cfg, nproc).plan.total / 2**30
            row.update(
                predicted_gib=predicted, predicted_fits=predicted <= self.settings.gpu_memory_gib
            )
        except ValueError as err:
            row["predicted_error"] = str(err)
        self.log(_line(row))
        return row

    # -- shapes and configs ------------------------------------------------------------------

    def spec(self, variant: str, big: bool, gpus: int, steps: tuple[int, int], **kw) -> TrialSpec:
        """A trial of the 70B (``big``) or the 7B shape: micro-batch 1 per GPU, activation
        checkpointing."""
        s = self.settings
        return TrialSpec(
            variant=variant,
            rung=kw.pop("rung", s.big_name if big else s.mid_name),
            shape=kw.pop("shape", s.big if big else s.mid),
            seq_len=s.big_seq if big else s.mid_seq,
            micro_batch=1,
            activation_checkpointing=True,
            warmup_steps=steps[0],
            measured_steps=steps[1],
            device=s.device,
            vocab_size=s.big_vocab if big else s.mid_vocab,
            gpus=gpus,
            **kw,
        )

    def prepare(self) -> None:
        """The trainer's token data (builtin corpus) and the 70B shape's config.json."""
        from srtrain.data import ensure_prepared

        s = self.settings
        kwargs = {"vocab_size": s.data_vocab}
        if s.data_max_bytes is not None:
            kwargs["max_bytes"] = s.data_max_bytes
        ensure_prepared(self.data_dir, source="builtin", val_fraction=0.02, **kwargs)
        self.big_config = self.scratch / s.big_name / "config.json"
        self.big_config.parent.mkdir(parents=True, exist_ok=True)
        shape_config(s.big, s.big_vocab, s.big_seq).to_json_file(str(self.big_config))

    def big_train(self, run_dir: Path, gpus: int, steps: int, *extra: str) -> list[str]:
        """Trainer overrides of a 70B run on the builtin corpus, one sequence per GPU."""
        s = self.settings
        return [
            f"model.hf_config={self.big_config}",
            f"model.seq_len={s.big_seq}",
            f"data.dir={self.data_dir}",
            f"parallel.device={s.device}",
            f"train.global_batch_size={gpus}",
            "train.micro_batch_size=1",
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            *BIG_TRAIN,
            *extra,
        ]

    # -- parts -------------------------------------------------------------------------------

    def part_70b(self) -> tuple[list[dict], dict]:
        s = self.settings
        lr = ("optim.lr=3e-4", "optim.warmup_steps=2")
        ours = self.trial(
            "fp4-bf16w",
            self.spec("fp4-bf16w", True, s.gpus, s.big_steps, repeat_batch=True, overrides=lr),
        )
        # expected out of memory: a rank left waiting on one that failed ends at the limit
        torch_row = self.trial(
            "torch", self.spec("torch", True, s.gpus, (1, 1), overrides=lr), limit=OOM_LIMIT_S
        )
        losses = ours.get("losses") or []
        summary = {
            "fp4-bf16w": _brief(ours) | {"loss_fell": bool(losses) and losses[-1] < losses[0]},
            "torch": _brief(torch_row),
        }
        return [ours, torch_row], summary

    def part_70b_fp8(self) -> tuple[list[dict], dict]:
        s = self.settings
        rows: list[dict] = []
        rungs = [f"{n}L" for n in s.fp8_layers]

        def spec(rung: str) -> TrialSpec:
            shape = dataclasses.replace(s.big, layers=int(rung.removesuffix("L")))
            return self.spec("fp8", True, s.gpus, (1, 2), rung=rung, shape=shape)

        start = rungs[0]
        for rung in rungs:
            if predicted_bytes(spec(rung)) / 2**30 > s.gpu_memory_gib:
                break
            start = rung

        def trial(rung: str) -> str:
            row = self.trial(f"fp8-{rung}", spec(rung))
            rows.append(row)
            return outcome(row)

        largest = search_ladder(rungs, start, trial)
        best = next((r for r in rows if r["rung"] == largest and r.get("fit")), None)
        summary = {"planner_start": start, "largest_fitting": largest}
        if best is not None:
            summary.update(_brief(best), params=best.get("params"), layers=best["layers"])
        return rows, summary

    def part_stalls(self) -> tuple[list[dict], dict]:
        s = self.settings
        run_dir = self.out / "stalls-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        row = self.train(
            "stalls",
            s.gpus,
            self.big_train(run_dir, s.gpus, s.train_steps, "checkpoint.enabled=false"),
        )
        reports = row.get("stall_reports") or {}
        last = reports[max(reports, key=int)] if reports else {}
        losses = row.get("losses") or []
        summary = _brief(row) | {
            "losses": losses,
            "loss_fell": bool(losses) and losses[-1] < losses[0],
            "tensorboard": str(run_dir.relative_to(self.out)),
            "predicted_stalls": row.get("predicted_stalls"),
            "last_stalled": last.get("stalled"),
            "last_stalled_by_group": last.get("stalled_by_group"),
        }
        return [row], summary

    def part_scaling(self) -> tuple[list[dict], dict]:
        s = self.settings
        rows, summary = [], {}
        for variant in s.variants:
            entry: dict = {}
            for n in s.sizes():
                row = self.trial(
                    f"scaling-{variant}-{n}", self.spec(variant, False, n, s.scaling_steps)
                )
                rows.append(row)
                if not row.get("fit"):
                    entry[str(n)] = {"fit": False, "oom": row.get("oom"), "error": row.get("error")}
                    continue
                one = entry.get("1", {}).get("tokens_per_s")
                step_s = row.get("measured_step_s") or 0.0
                entry[str(n)] = {
                    "tokens_per_s": row["tokens_per_s"],
                    "tokens_per_s_per_gpu": row["tokens_per_s"] / n,
                    "efficiency": row["tokens_per_s"] / (n * one) if one else None,
                    "optimizer_share": row["measured_optimizer_s"] / step_s if step_s else None,
                    "mfu": row.get("mfu"),
                    "peak_allocated_gib": row.get("peak_allocated_gib"),
                    "predicted_gib": row.get("predicted_gib"),
                }
            summary[variant] = entry
        return rows, summary

    def part_hsdp(self) -> tuple[list[dict], dict]:
        s = self.settings
        if s.gpus < 2 or s.gpus % 2:
            return [], {"skipped": f"HSDP needs an even number of GPUs, have {s.gpus}"}
        hsdp = self.trial(
            "hsdp-2x", self.spec("fp4-bf16w", False, s.gpus, s.hsdp_steps, replicas=2), "replicas"
        )
        flat = self.trial("fsdp", self.spec("fp4-bf16w", False, s.gpus, s.hsdp_steps))
        summary = {
            "steps": sum(s.hsdp_steps),
            f"hsdp 2x{s.gpus // 2}": _brief(hsdp),
            f"fsdp {s.gpus}": _brief(flat),
            "replicas_identical": hsdp.get("replicas_identical"),
            "replica_bytes_compared": hsdp.get("replica_bytes_compared"),
        }
        return [hsdp, flat], summary

    def part_checkpoint(self) -> tuple[list[dict], dict]:
        s = self.settings
        row = self.trial("checkpoint", self.spec("fp4-bf16w", True, s.gpus, (1, 1)), "checkpoint")
        summary = {r["name"]: r for r in row.get("checkpoints", [])}
        if row.get("params"):
            for r in summary.values():
                r["bytes_per_param"] = r["bytes"] / row["params"]
        if not row.get("fit"):
            summary["error"] = row.get("error")
        return [row], summary

    def part_resume(self) -> tuple[list[dict], dict]:
        s = self.settings
        half = max(1, s.gpus // 2)
        before, total = s.resume_steps
        first_dir, second_dir = self.scratch / "resume-save", self.scratch / "resume-load"
        for d in (first_dir, second_dir):
            shutil.rmtree(d, ignore_errors=True)
        try:
            saved = self.train(
                f"resume-save-{s.gpus}",
                s.gpus,
                self.big_train(
                    first_dir, s.gpus, before, "checkpoint.interval=0", "checkpoint.keep=1"
                ),
            )
            # the same global batch at half the ranks: two sequences per rank, one at a time
            resumed = self.train(
                f"resume-load-{half}",
                half,
                [
                    *self.big_train(second_dir, s.gpus, total),
                    f"checkpoint.load={first_dir / 'checkpoints' / f'step-{before}'}",
                    "checkpoint.enabled=false",
                ],
            )
        finally:
            for d in (first_dir, second_dir):
                shutil.rmtree(d, ignore_errors=True)
        a, b = saved.get("losses") or [], resumed.get("losses") or []
        straight = self._straight_losses(total)
        summary = {
            "saved_at": {"gpus": s.gpus, "step": before, **_brief(saved)},
            "resumed_at": {"gpus": half, "steps": total, **_brief(resumed)},
            "losses_before": a,
            "losses_after": b,
            "continued": bool(a) and len(b) == total - before,
        }
        if straight is not None and len(straight) == total and a and b:
            summary["straight_losses"] = straight
            summary["max_abs_diff_from_straight"] = max(
                abs(x - y) for x, y in zip(a + b, straight, strict=True)
            )
        return [saved, resumed], summary

    def _straight_losses(self, steps: int) -> list[float] | None:
        """The stalls part's losses (the same run, straight through at N GPUs), if recorded
        with ``steps`` steps."""
        path = self.out / "stalls.json"
        if not path.exists():
            return None
        losses = json.loads(path.read_text()).get("summary", {}).get("losses")
        return losses if losses and len(losses) == steps else None

    # -- the run -----------------------------------------------------------------------------

    def run_part(self, part: str, force: bool = False) -> dict:
        """Run one part and write ``<out>/<part>.json``; a failure is recorded, not raised.
        A part already recorded ``ok`` is read back unless ``force``."""
        path = self.out / f"{part}.json"
        if path.exists() and not force:
            done = json.loads(path.read_text())
            if done.get("status") == "ok":
                self.log(f"{part}: recorded ok in {path}, skipped (--force runs it again)")
                return done
        self.log(f"== {part}")
        start = time.perf_counter()
        method = getattr(self, "part_" + part.replace("-", "_"))
        try:
            rows, summary = method()
            failed = [r for r in rows if not r.get("fit")]
            expected = [
                r for r in failed if part == "70b" and r.get("variant") == "torch" and r.get("oom")
            ]
            ladder = part == "70b-fp8" and summary.get("largest_fitting")
            if any(r.get("skipped") for r in rows):
                status = "partial"
            elif not rows and "skipped" in summary:
                status = "skipped"
            elif len(failed) > len(expected) and not (ladder and all(r.get("oom") for r in failed)):
                status = "failed"
            else:
                status = "ok"
        except Exception as err:  # recorded: the other parts still run
            rows, summary, status = [], {"error": f"{type(err).__name__}: {err}"}, "failed"
        result = {
            "part": part,
            "status": status,
            "environment": {**self.environment, "gpus": self.settings.gpus},
            "settings": {
                k: v for k, v in dataclasses.asdict(self.settings).items() if k != "extra"
            },
            "wall_s": time.perf_counter() - start,
            "summary": summary,
            "rows": rows,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(_finite(result), indent=2, default=str))
        tmp.replace(path)
        self.log(f"{part}: {status} ({result['wall_s']:.0f} s) -> {path}")
        return result


def _finite(value):
    """JSON data with every NaN or infinity as None (standard JSON has neither)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _brief(row: dict) -> dict:
    """The numbers a summary keeps of a row."""
    keys = (
        "fit",
        "oom",
        "phase",
        "error",
        "params",
        "tokens_per_s",
        "mfu",
        "peak_allocated_gib",
        "per_rank_peak_allocated_gib",
        "peak_reserved_gib",
        "failure_peak_allocated_gib",
        "failed_ranks",
        "predicted_gib",
        "final_loss",
        "wall_s",
    )
    out = {k: row[k] for k in keys if k in row}
    if row.get("losses"):
        out["first_loss"], out["last_loss"] = row["losses"][0], row["losses"][-1]
    return out


def _line(row: dict) -> str:
    """One progress line for a finished launch."""
    name = row.get("name", "")
    plan = f" plan {row['predicted_gib']:.1f} GiB" if "predicted_gib" in row else ""
    if row.get("fit"):
        rate = row.get("tokens_per_s")
        rate = f" {rate:,.0f} tok/s" if rate else ""
        peak = row.get("peak_allocated_gib")
        peak = f" peak {peak:.1f} GiB" if peak is not None else ""
        return f"  {name}: ok{rate}{peak}{plan} ({row.get('wall_s', 0):.0f} s)"
    kind = "OOM" if row.get("oom") else "skipped" if row.get("skipped") else "FAILED"
    return f"  {name}: {kind} {row.get('phase', '')} {row.get('error', '')}{plan}"


_PROBE = """
import json, torch
from srtrain.bench.__main__ import environment
cuda = torch.cuda.is_available()
print(json.dumps({
    "environment": environment(),
    "gpus": torch.cuda.device_count() if cuda else 0,
    "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0.0,
}))
"""


def probe_node() -> dict:
    """The run's environment (date, device, versions, commit), its GPU count and each GPU's
    memory, found in a child process: this one never holds a CUDA context that would take
    memory from rank 0's GPU."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        env=child_env(),
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the parts, print where the results are."""
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.bench.node", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="directory of the part JSON files")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"of {','.join(PARTS)} (default all)"
    )
    parser.add_argument("--minutes", type=float, help="time budget of the whole run")
    parser.add_argument(
        "--timeout", type=float, default=540.0, help="seconds one launch may take (default 540)"
    )
    parser.add_argument("--gpus", type=int, help="N (default torch.cuda.device_count())")
    parser.add_argument(
        "--variants", help=f"scaling variants (default {','.join(SCALING_VARIANTS)})"
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        help="checkpoints and data (default: a temporary directory, removed after)",
    )
    parser.add_argument("--force", action="store_true", help="run parts already recorded ok")
    parser.add_argument(
        "--dry", action="store_true", help="every part on the CPU: gloo, 2 ranks, tiny shapes"
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {','.join(unknown)}; allowed: {','.join(PARTS)}")
    probe = probe_node()
    if not args.dry and not probe["gpus"]:
        print(
            "error: the node benchmark needs CUDA devices (--dry runs its CPU path)",
            file=sys.stderr,
        )
        return 2
    gpus = args.gpus or (probe["gpus"] if not args.dry else 2)
    memory = probe["memory_gib"] or GPU_MEMORY_GIB_FALLBACK
    settings = NodeSettings.for_run(args.dry, gpus, memory)
    if args.variants:
        settings.variants = tuple(args.variants.split(","))
        bad = [v for v in settings.variants if v not in SCALING_VARIANTS]
        if bad:
            parser.error(
                f"--variants: unknown {','.join(bad)}; allowed: {','.join(SCALING_VARIANTS)}"
            )
    env = probe["environment"]
    if args.dry:
        env["device"] = f"{env['device']} (--dry)"
    env["command"] = " ".join(
        ["python -m srtrain.bench.node", *(sys.argv[1:] if argv is None else argv)]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="srtrain-node-"))
    scratch.mkdir(parents=True, exist_ok=True)
    node = Node(
        args.out,
        scratch,
        settings,
        Budget(args.minutes, args.timeout),
        env,
        lambda line: print(line, flush=True),
    )
    try:
        node.prepare()
        results = {p: node.run_part(p, args.force)["status"] for p in parts}
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(" ".join(f"{p}={s}" for p, s in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
