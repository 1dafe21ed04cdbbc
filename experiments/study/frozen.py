"""BF16 weights without an FP32 master copy: which weights ever move under NR and under SR.

The same model, data and seed are trained twice in one plain single-process loop with
SRAdamW (FP32 states, so only the rounding of the weights differs): once rounding the BF16
weights to nearest, once stochastically, at a constant learning rate. After every step a
per-element mask records whether the stored bits of each weight changed. Elements of the 2-D
weight matrices (all but the input embedding table, whose rows only get gradients for the
tokens in a batch) are binned by their initial |w| on log-spaced bins.

Nearest rounding drops an update Δ when |Δ| is below half an ULP of w, i.e. when
|w| ≳ 2^8·|Δ| (between 256·|Δ| and 512·|Δ|, depending on where w sits in its binade); Adam's
|Δ| is about lr, so weights above a few hundred times lr freeze. The measured threshold is the
|w| at which the NR fraction of ever-changed weights falls below one half.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from experiments.study.summary import write_atomic
from srtrain.data import BatchLoader, load_meta
from srtrain.models import build_model, init_weights
from srtrain.optim import SRAdamW

FROZEN_FILE = "frozen.json"
ROUNDINGS = ("nearest", "stochastic")
HALF_ULP_FACTORS = (256, 512)  # NR drops Δ for |w| above 256·|Δ| .. 512·|Δ|
GRAD_CLIP = 1.0
DECADES = 4  # the bins span this many decades of |w| below the largest weight


@dataclass(frozen=True)
class FrozenSetup:
    """What both variants share."""

    preset: str = "llama-60m"
    data_dir: str = "data/study"
    steps: int = 300
    lr: float = 1e-4
    seed: int = 0
    batch: int = 16
    seq_len: int = 256
    weight_decay: float = 0.0
    device: str = "cpu"
    bins: int = 30


@dataclass
class VariantRun:
    """One rounding mode's result: per matrix its initial |w| and ever-changed mask."""

    initial: dict[str, torch.Tensor]
    ever: dict[str, torch.Tensor]
    changed_last: int
    losses: list[float]


def tracked_matrices(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The 2-D weight matrices whose elements are binned (not the input embedding)."""
    embedding = model.get_input_embeddings().weight
    return {name: p for name, p in model.named_parameters() if p.ndim == 2 and p is not embedding}


def bf16_model(setup: FrozenSetup, vocab_size: int) -> torch.nn.Module:
    """The preset, initialised in FP32 by seed, with every parameter then stored in BF16."""
    model = build_model(setup.preset, vocab_size, setup.seq_len)
    model.to_empty(device=setup.device)
    init_weights(model, setup.seed)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def train_variant(setup: FrozenSetup, rounding: str) -> VariantRun:
    """Train with BF16 weights rounded by ``rounding``; track which elements ever change."""
    meta = load_meta(setup.data_dir)
    model = bf16_model(setup, meta.vocab_size)
    matrices = tracked_matrices(model)
    initial = {n: p.detach().abs().clone() for n, p in matrices.items()}
    ever = {n: torch.zeros(p.shape, dtype=torch.bool, device=p.device) for n, p in matrices.items()}
    params = list(model.parameters())
    optimizer = SRAdamW(
        params,
        lr=setup.lr,
        weight_decay=setup.weight_decay,
        m_format="fp32",
        v_format="fp32",
        m_rounding="nearest",
        v_rounding="nearest",
        param_rounding=rounding,
        seed=setup.seed,
    )
    loader = BatchLoader(setup.data_dir, "train", setup.batch, setup.seq_len, 0, 1, setup.seed)
    losses: list[float] = []
    changed_last = 0
    for _ in range(setup.steps):
        x, y = next(loader)
        logits = model(input_ids=x.to(setup.device)).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(setup.device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        before = {n: p.detach().view(torch.int16).clone() for n, p in matrices.items()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        changed_last = 0
        for n, p in matrices.items():
            changed = p.detach().view(torch.int16) != before[n]
            ever[n] |= changed
            changed_last += int(changed.sum())
        losses.append(float(loss.detach()))
    return VariantRun(initial, ever, changed_last, losses)


def bin_edges(initial: dict[str, torch.Tensor], bins: int) -> list[float]:
    """Log-spaced edges spanning ``DECADES`` below the largest initial |w| (or down to the
    smallest non-zero one); smaller weights are counted in the first bin."""
    high = max(float(w.max()) for w in initial.values())
    smallest = min(float(w[w > 0].min()) for w in initial.values() if bool((w > 0).any()))
    low = min(max(smallest, high * 10.0**-DECADES), high * (1 - 1e-6))
    return [low * (high / low) ** (i / bins) for i in range(bins + 1)]


def binned_fractions(run: VariantRun, edges: list[float]) -> tuple[list[int], list[int]]:
    """Per bin of initial |w|: elements and elements that ever changed (zeros left out,
    weights below the first edge counted in the first bin)."""
    bins = len(edges) - 1
    inner = torch.tensor(edges[1:-1], dtype=torch.float32)
    counts = torch.zeros(bins, dtype=torch.int64)
    changed = torch.zeros(bins, dtype=torch.int64)
    for name, w in run.initial.items():
        w = w.float().flatten()
        keep = w > 0
        index = torch.bucketize(w[keep], inner.to(w.device))
        mask = run.ever[name].flatten()[keep]
        counts += torch.bincount(index, minlength=bins).cpu()
        changed += torch.bincount(index[mask], minlength=bins).cpu()
    return counts.tolist(), changed.tolist()


def nr_threshold(edges: list[float], counts: list[int], fractions: list[float]) -> float | None:
    """|w| where the NR ever-changed fraction first falls below 1/2 (log-interpolated)."""
    centres = [math.sqrt(a * b) for a, b in itertools.pairwise(edges)]
    points = [(c, f) for c, n, f in zip(centres, counts, fractions, strict=True) if n > 0]
    for (c0, f0), (c1, f1) in itertools.pairwise(points):
        if f0 >= 0.5 > f1:
            t = (f0 - 0.5) / (f0 - f1)
            return math.exp(math.log(c0) + t * (math.log(c1) - math.log(c0)))
    if points and points[0][1] < 0.5:
        return points[0][0]
    return None


def run_frozen(setup: FrozenSetup) -> dict[str, Any]:
    """Train both variants and return the frozen.json content."""
    runs = {r: train_variant(setup, r) for r in ROUNDINGS}
    first, second = (runs[r] for r in ROUNDINGS)
    for name, w in first.initial.items():
        if not torch.equal(w, second.initial[name]):
            raise RuntimeError(f"initial weights of {name} differ between the variants")
    edges = bin_edges(first.initial, setup.bins)
    total = sum(w.numel() for w in first.initial.values())
    out: dict[str, Any] = {
        "setup": setup.__dict__
        | {"param_rounding": list(ROUNDINGS), "states": "fp32 m and v", "lr_schedule": "constant"},
        "lr": setup.lr,
        "matrices": list(first.initial),
        "elements": total,
        "bins": {"edges": edges},
        "variants": {},
    }
    for rounding, run in runs.items():
        counts, changed = binned_fractions(run, edges)
        fractions = [c / n if n else None for c, n in zip(changed, counts, strict=True)]
        out["bins"]["count"] = counts
        out["variants"][rounding] = {
            "ever_changed_by_bin": fractions,
            "ever_changed": sum(int(m.sum()) for m in run.ever.values()) / total,
            "changed_last_step": run.changed_last / total,
            "losses": run.losses,
        }
    nr = out["variants"]["nearest"]["ever_changed_by_bin"]
    measured = nr_threshold(
        edges, out["bins"]["count"], [f if f is not None else math.nan for f in nr]
    )
    out["threshold"] = {
        "measured_abs_w": measured,
        "measured_over_lr": measured / setup.lr if measured is not None else None,
        **{f"predicted_{k}_lr": k * setup.lr for k in HALF_ULP_FACTORS},
        "rule": "NR drops an update Δ when |Δ| < ULP(w)/2, i.e. |w| ≳ 2^8·|Δ| with |Δ| ≈ lr",
    }
    return out


def write_frozen(setup: FrozenSetup, out_dir: Path) -> Path:
    """Run the experiment and write ``out_dir/frozen.json`` atomically, with an
    ``environment``: date, commit, device, torch and Triton versions."""
    import datetime

    from experiments.study.runner import CPU, provenance

    result = run_frozen(setup)
    gpus = [CPU] if setup.device == "cpu" else [str(torch.cuda.current_device())]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["environment"] = {"date": date, **provenance(gpus)}
    path = out_dir / FROZEN_FILE
    write_atomic(path, json.dumps(result, indent=1).encode())
    return path
