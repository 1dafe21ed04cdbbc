"""The headline table, and the guard that compares source trees by it.

``python -m srtrain.bench --headline --out DIR`` measures, on one GPU, what a user gets:

- the optimizer step at default arguments over LLaMA-1B's 219 tensors (FP32 parameters),
  on one GPU and as rank 0 of eight: torch's fused AdamW, ``SRAdamW`` with BF16, FP8 and
  FP4 states (and FP8 with the sampled FP32 shadow the trainer keeps), and torchao's
  low-bit AdamWs when torchao is installed;
- the LLaMA-1B recipes end to end with their own defaults, scaled to one GPU (the
  per-GPU batch of an 8-GPU node, 64 sequences of 1024 tokens): FP8 states, FP4 states with
  BF16 weights, and torch's AdamW as the control: tokens/s, MFU and peak memory;
- the capacity figures recorded by ``bench --capacity``: each variant's newest.

It writes ``DIR/headline.json`` (date, device, versions, commit, command, every round's
values) and ``DIR/headline.md``, the table README's Performance section shows.

With ``--trees before=PATH,after=src`` every measurement runs once per tree and round, in
a fresh process importing that tree's ``srtrain`` (this harness stays the caller's:
:mod:`srtrain.bench.headline_probe`), trees alternating order from round to round; the
guard then lists every row whose median moved between the first and the last tree by more
than the spread both showed over the rounds of this call (and at least ``--tolerance``),
with no overlap between their values; an optimizer row by its time relative to the torch
control measured in the same process (:func:`compare`). ``--compare BASELINE.json`` (a recorded
``headline.json``) adds the same comparison of the last tree against that file's values;
without ``--trees`` it is the comparison. A run that finds a regression exits 1.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from srtrain.bench.trees import commit_with_digest, tree_commit, tree_digest

PROBE = Path(__file__).with_name("headline_probe.py")
PARTS = ("optimizer", "train")
PRESET = "llama-1b"
WORLDS = (1, 8)
DEFAULT_DATA_DIR = "data/builtin-32k"
DEFAULT_STEPS = 20
LOG_INTERVAL = 5


@dataclass(frozen=True)
class TrainVariant:
    """An end-to-end row: a recipe and the overrides that make the variant."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()


# key (``--variants``) → the end-to-end rows
TRAIN_VARIANTS = {
    "fp8": TrainVariant("LLaMA-1B recipe, FP8 states", "configs/llama-1b-fp8.yaml"),
    "fp4-bf16w": TrainVariant(
        "LLaMA-1B recipe, FP4 states, BF16 weights",
        "configs/llama-1b-fp4.yaml",
        ("parallel.bf16_params=true",),
    ),
    "torch": TrainVariant(
        "LLaMA-1B recipe, torch AdamW (control)",
        "configs/llama-1b.yaml",
        ("optim.name=torch_adamw",),
    ),
}

# measure → whether larger is better
MEASURES = {"step_us": False, "tokens_per_s": True, "mfu": True, "peak_gib": False}
DEFAULT_TOLERANCE = 0.01


def one_gpu_overrides(data_dir: str, steps: int, run_dir: str) -> list[str]:
    """A recipe scaled to one GPU with the per-GPU batch it has on an 8-GPU node (64
    sequences, micro-batch 16), on the built-in corpus at the recipe's 32k vocabulary, with
    no validation or checkpoints; everything else is the recipe's own."""
    return [
        f"data.dir={data_dir}",
        "data.source=builtin",
        "data.vocab_size=32000",
        "data.max_bytes=null",
        f"train.steps={steps}",
        "train.global_batch_size=64",
        "train.micro_batch_size=16",
        f"train.log_interval={LOG_INTERVAL}",
        "train.val_interval=0",
        "checkpoint.enabled=false",
        f"train.run_dir={run_dir}",
    ]


@dataclass(frozen=True)
class Settings:
    """What a headline call measures."""

    parts: tuple[str, ...] = PARTS
    variants: tuple[str, ...] = tuple(TRAIN_VARIANTS)  # the end-to-end rows
    preset: str = PRESET  # the optimizer rows' model
    worlds: tuple[int, ...] = WORLDS  # the optimizer rows' world sizes
    vocab_size: int = 32000  # the optimizer rows' vocabulary
    rounds: int = 2
    repeats: int = 50
    steps: int = DEFAULT_STEPS
    data_dir: str = DEFAULT_DATA_DIR
    tolerance: float = DEFAULT_TOLERANCE
    timeout: float = 900.0


def _probe(tree: Path, args: list[str], timeout: float, label: str) -> list[dict]:
    """Run the probe with ``tree``'s srtrain first on the path; its rows. Its output goes to
    stderr as it comes, after ``[label]``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
            PYTHONUNBUFFERED="1",
        )
        code = (
            "import runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        cmd = [sys.executable, "-c", code, str(PROBE), args[0], str(out), *args[1:]]
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = threading.Timer(timeout, proc.kill)  # a hung probe ends, and fails
        deadline.start()
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = [*tail[-39:], line]
            print(f"[{label}] {line}", end="", file=sys.stderr, flush=True)
        status = proc.wait()
        deadline.cancel()
        seconds = time.perf_counter() - started
        print(f"[{label}] exit {status} after {seconds:.0f} s", file=sys.stderr, flush=True)
        if status != 0 or not out.is_file():
            why = f"killed after {timeout:g} s" if seconds >= timeout else f"exit {status}"
            raise RuntimeError(f"{label} failed ({why}):\n{''.join(tail)}")
        return json.loads(out.read_text())["rows"]


def measurements(settings: Settings, run_dir: str) -> list[tuple[str, list[str]]]:
    """(label, probe arguments) of every measurement of one round, in order."""
    jobs: list[tuple[str, list[str]]] = []
    if "optimizer" in settings.parts:
        worlds = ",".join(str(w) for w in settings.worlds)
        args = [settings.preset, worlds, str(settings.repeats), str(settings.vocab_size)]
        jobs.append(("optimizer", ["optimizer", *args]))
    if "train" in settings.parts:
        for key in settings.variants:
            v = TRAIN_VARIANTS[key]
            overrides = one_gpu_overrides(settings.data_dir, settings.steps, run_dir)
            jobs.append((v.name, ["train", v.name, v.config, *overrides, *v.overrides]))
    return jobs


def run_rounds(
    trees: dict[str, Path], settings: Settings
) -> tuple[dict[str, dict[str, dict[str, list[float]]]], dict[str, list[dict]]]:
    """Every measurement of every round on every tree (trees alternate their order from
    round to round); (values, rows): values[tree][row][measure] over the rounds, and each
    tree's rows of its last round."""
    if "train" in settings.parts:
        configs = [TRAIN_VARIANTS[key].config for key in settings.variants]
        missing = [c for c in configs if not Path(c).is_file()]
        if missing:
            raise RuntimeError(
                f"{missing[0]} not found: run the headline from a checkout's root (the "
                "end-to-end rows train its recipes), or pass --parts optimizer"
            )
    values: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in trees}
    last: dict[str, list[dict]] = {name: [] for name in trees}
    names = list(trees)
    for index in range(settings.rounds):
        order = names if index % 2 == 0 else names[::-1]
        for label, args in measurements(settings, "RUN_DIR"):
            for name in order:
                with tempfile.TemporaryDirectory() as run_dir:
                    job = [
                        _tree_recipe(trees[name], a.replace("RUN_DIR", f"{run_dir}/run"))
                        for a in args
                    ]
                    tag = f"{name} {index + 1}/{settings.rounds} {label}"
                    rows = _probe(trees[name], job, settings.timeout, tag)
                for row in rows:
                    measured = values[name].setdefault(row["name"], {})
                    for measure in MEASURES:
                        if isinstance(row.get(measure), (int, float)):
                            measured.setdefault(measure, []).append(float(row[measure]))
                    if index == settings.rounds - 1:
                        last[name].append(row)
    return values, last


def _tree_recipe(tree: Path, arg: str) -> str:
    """A recipe path of a train job as the tree's own checkout holds it (``TREE/../configs``),
    where it does: each tree trains its own recipes; other arguments as they are."""
    if arg.startswith("configs/") and (tree.parent / arg).is_file():
        return str(tree.parent / arg)
    return arg


# ------------------------------------------------------------------------- the guard


def _spread(xs: Sequence[float]) -> float:
    """(max − min) / median of one tree's values of a measure over the rounds."""
    middle = statistics.median(xs)
    return (max(xs) - min(xs)) / abs(middle) if middle else 0.0


def optimizer_control(row: str) -> str | None:
    """The torch AdamW row measured in the same process as optimizer row ``row`` (same
    preset and world size), or None: ``row`` is the control itself, or not an optimizer
    row (each end-to-end row trains in a process of its own)."""
    from srtrain.bench.headline_probe import TORCH_BASELINE

    prefix, sep, name = row.partition(": ")
    if not sep or name == TORCH_BASELINE:
        return None
    return f"{prefix}: {TORCH_BASELINE}"


def is_optimizer_control(row: str) -> bool:
    """Whether ``row`` is an optimizer part's torch AdamW control row."""
    from srtrain.bench.headline_probe import TORCH_BASELINE

    return row.endswith(f": {TORCH_BASELINE}")


def _relative(
    values: dict[str, dict[str, list[float]]], row: str, measure: str
) -> list[float] | None:
    """``row``'s values of ``measure`` over the rounds, each divided by its round's control
    value (one process measured both); None where the row has no control or the rounds do
    not pair up."""
    control = optimizer_control(row)
    own = values.get(row, {}).get(measure)
    base = values.get(control, {}).get(measure) if control else None
    if not own or not base or len(own) != len(base) or not all(base):
        return None
    return [x / c for x, c in zip(own, base, strict=True)]


def _judge(b: Sequence[float], a: Sequence[float], measure: str, tolerance: float) -> dict:
    """The change of the median from ``b`` to ``a``, the noise band and the verdict."""
    mb, ma = statistics.median(b), statistics.median(a)
    change = ma / mb - 1 if mb else 0.0
    band = max(_spread(a), _spread(b), tolerance)
    apart = max(a) < min(b) or min(a) > max(b)
    verdict = "within noise"
    if apart and abs(change) > band:
        verdict = "better" if (change > 0) == MEASURES[measure] else "worse"
    return {"before": list(b), "after": list(a), "change": change, "band": band, "verdict": verdict}


def compare(
    before: dict[str, dict[str, list[float]]],
    after: dict[str, dict[str, list[float]]],
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[dict]:
    """Every (row, measure) both sides have: the change of the median from ``before`` to
    ``after``, the noise band (the larger relative spread of the two sides' values, at
    least ``tolerance``) and a verdict: ``worse`` or ``better`` where the change passes the
    band and the two sides' values do not overlap, else ``within noise``.

    An optimizer row is judged by its time relative to the torch AdamW control of the same
    round (``relative_to`` names it, ``raw_change`` keeps the change of the time itself):
    both ran in one process, so the ratio cancels what moves every step of that process
    (clocks, host load), which the rounds of a call do not sample well. The control row
    itself is judged by its time and marked ``control``: it runs no srtrain optimizer code,
    so its move is the machine's (or the harness's), listed but not a regression."""
    verdicts = []
    for row, measured in after.items():
        for measure, a in measured.items():
            b = before.get(row, {}).get(measure)
            if not b or not a:
                continue
            entry = {"row": row, "measure": measure}
            rel_b, rel_a = _relative(before, row, measure), _relative(after, row, measure)
            if rel_b and rel_a:
                raw = _judge(b, a, measure, tolerance)
                entry |= _judge(rel_b, rel_a, measure, tolerance)
                entry |= {"relative_to": optimizer_control(row), "raw_change": raw["change"]}
            else:
                entry |= _judge(b, a, measure, tolerance)
                if is_optimizer_control(row):
                    entry["control"] = True
            verdicts.append(entry)
    return verdicts


def regressions(verdicts: Iterable[dict]) -> int:
    """How many verdicts are regressions: worse, and not the optimizer's torch control."""
    return sum(v["verdict"] == "worse" and not v.get("control") for v in verdicts)


def verdict_table(verdicts: Iterable[dict], title: str) -> str:
    """The moved rows as text (every row when none moved is not listed)."""
    verdicts = list(verdicts)
    moved = [v for v in verdicts if v["verdict"] != "within noise"]
    lines = [f"{title}: {len(moved)} of {len(verdicts)} measures moved beyond the noise"]
    for v in moved:
        label = "CONTROL" if v.get("control") else v["verdict"].upper()
        measure = v["measure"] + (" ÷ control" if "relative_to" in v else "")
        line = (
            f"  {label:<7} {v['row']} [{measure}]: "
            f"{_values(v['before'])} → {_values(v['after'])} "
            f"({v['change']:+.1%}, noise band ±{v['band']:.1%}"
        )
        if "raw_change" in v:
            line += f"; the time itself {v['raw_change']:+.1%}"
        if v.get("control"):
            line += f"; {v['verdict']}: the machine moved, not srtrain"
        lines.append(line + ")")
    return "\n".join(lines)


def _values(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


# ---------------------------------------------------------------------- the capacity


def latest_capacity_files(directory: Path = Path("benchmarks/results")) -> list[Path]:
    """Every capacity result file recorded in ``directory``, oldest first (by name, which
    starts with the date); :func:`capacity_section` keeps each variant's newest rows."""
    return sorted(directory.glob("*-capacity-*.json"))


def capacity_section(files: Sequence[Path]) -> dict | None:
    """The capacity summary of recorded result files: each variant's ladder and throughput
    from the newest file (by name) holding that search of it; and the provenance of the
    files used."""
    if not files:
        return None
    from srtrain.bench.capacity import read_rows, summarize

    newest: dict[tuple[str, str], tuple[Path, list[dict]]] = {}
    for path in sorted(files, key=lambda p: Path(p).name):
        by_search: dict[tuple[str, str], list[dict]] = {}
        for row in read_rows([path]):
            by_search.setdefault((row["variant"], row.get("search", "")), []).append(row)
        for key, rows in by_search.items():
            newest[key] = (Path(path), rows)
    used = sorted({path for path, _ in newest.values()}, key=lambda p: p.name)
    sources = []
    for path in used:
        env = json.loads(path.read_text()).get("environment", {})
        sources.append({"file": str(path), **{k: env.get(k) for k in ("date", "device", "commit")}})
    rows = [row for _, rows in newest.values() for row in rows]
    return {"summary": summarize(rows), "sources": sources}


# -------------------------------------------------------------------------- the table


def spread_values(result: dict) -> dict[str, dict[str, list[float]]]:
    """The measured tree's values to show with their range: over the rounds when there were
    two or more; from one round, each row's spread within its run (the quartiles of its
    step times, its log intervals' tokens/s)."""
    tree = result["measured_tree"]
    values = result["values"][tree]
    if result["settings"]["rounds"] > 1:
        return values
    within = {}
    for row in result["rows"][tree]:
        measured = dict(values[row["name"]])
        if "step_us_q1" in row:
            measured["step_us"] = [row["step_us_q1"], row["step_us"], row["step_us_q3"]]
        if row.get("tokens_per_s_intervals"):
            measured["tokens_per_s"] = row["tokens_per_s_intervals"]
        within[row["name"]] = measured
    return within


def render_markdown(result: dict, capacity: bool = True) -> str:
    """The headline tables of a result (its last tree's values), with the provenance line;
    the recorded capacity too, with ``capacity``."""
    env = result["environment"]
    tree = result["measured_tree"]
    values = spread_values(result)
    rounds = result["settings"]["rounds"]
    commit = result["trees"][tree]["commit"]
    spread = (
        f"the median over {rounds} rounds in separate processes, with their range"
        if rounds > 1
        else "one run: step times as median (quartiles of the steps), tokens/s as median "
        "(range over the log intervals after the first)"
    )
    lines = [
        f"One {env['device']} (torch {env['torch']}, Triton {env['triton']}), commit "
        f"`{commit}`, {env['date'][:10]}: `{env['command']}`; {spread}.",
        "",
    ]
    optimizer = {r: v for r, v in values.items() if "step_us" in v}
    if optimizer:
        lines += _optimizer_table(optimizer)
    train = {r: v for r, v in values.items() if "tokens_per_s" in v}
    if train:
        steps = result["settings"]["steps"]
        lines += [
            "",
            f"| end to end, one GPU, the recipe's own defaults, 64 × 1024 tokens a step "
            f"({steps} steps, built-in corpus) | tokens/s | MFU | peak GiB |",
            "|---|---|---|---|",
        ]
        for row, v in train.items():
            lines.append(
                f"| {row} | {_ranged(v['tokens_per_s'], ',.0f')} | "
                f"{statistics.median(v['mfu']):.1%} | {statistics.median(v['peak_gib']):.1f} |"
            )
    if capacity and result.get("capacity"):
        lines += ["", *_capacity_table(result["capacity"])]
    return "\n".join(lines) + "\n"


def _ranged(xs: Sequence[float], spec: str, scale: float = 1.0) -> str:
    middle = format(statistics.median(xs) * scale, spec)
    if len(xs) < 2:
        return middle
    return f"{middle} ({format(min(xs) * scale, spec)}–{format(max(xs) * scale, spec)})"


def _optimizer_table(values: dict[str, dict[str, list[float]]]) -> list[str]:
    """Step time and speed-up over torch's fused AdamW, one column pair per world size."""
    from srtrain.bench.headline_probe import TORCH_BASELINE

    by_world: dict[int, dict[str, list[float]]] = {}
    tensors = ""
    for row, v in values.items():
        head, _, name = row.partition(": ")
        world = int(head.rsplit("W=", 1)[1])
        by_world.setdefault(world, {})[name] = v["step_us"]
        tensors = head.rsplit(" W=", 1)[0]
    worlds = sorted(by_world)
    header = f"| optimizer step, {tensors} (FP32 parameters), default arguments |"
    rule = "|---|"
    for w in worlds:
        where = "one GPU" if w == 1 else f"rank 0 of {w}"
        header += f" {where}: ms | × torch |"
        rule += "---|---|"
    lines = [header, rule]
    names = list(dict.fromkeys(n for w in worlds for n in by_world[w]))
    for name in names:
        line = f"| {name} |"
        for w in worlds:
            times = by_world[w].get(name)
            base = by_world[w].get(TORCH_BASELINE)
            if times is None:
                line += " – | – |"
                continue
            speedup = statistics.median(base) / statistics.median(times) if base else None
            ratio = "–" if speedup is None else f"{speedup:.2f}×"
            line += f" {_ranged(times, '.2f', 1e-3)} | {ratio} |"
        lines.append(line)
    return lines


def _capacity_table(capacity: dict) -> list[str]:
    sources = capacity["sources"]
    devices = "/".join(sorted({str(s["device"]) for s in sources}))
    records = ", ".join(
        f"{date} commit `{commit}`"
        for date, commit in sorted({((s["date"] or "")[:10], s["commit"]) for s in sources})
    )
    lines = [
        f"| largest LLaMA that trains on one GPU (recorded ladders: {devices}, {records}) | "
        "parameters | peak GiB | × torch |",
        "|---|---|---|---|",
    ]
    for variant, e in capacity["summary"].items():
        params, peak, ratio = (
            e.get(k) for k in ("params", "peak_allocated_gib", "params_vs_torch")
        )
        lines.append(
            f"| {variant} | {'–' if params is None else f'{params / 1e9:.2f}B'} | "
            f"{'–' if peak is None else f'{peak:.1f}'} | "
            f"{'–' if ratio is None else f'{ratio:.2f}×'} |"
        )
    return lines


# ------------------------------------------------------------------------- recording


def device_slug(device: str) -> str:
    """The device's model in a file name: ``NVIDIA H100 80GB HBM3`` → ``h100``, ``NVIDIA
    H200`` → ``h200``; the last word of a name without a model number."""
    model = re.search(r"\b[A-Za-z]+\d+[A-Za-z]*\b", device)
    return (model.group(0) if model else device.split()[-1]).lower()


def record(source: Path, directory: Path = Path("benchmarks/results")) -> Path:
    """Copy a headline result into ``directory`` (run from the checkout whose history holds
    the trees measured), each tree's commit (and the harness's, where its digest is known)
    read from its source digest: a machine that ran a copy of the checkout may not know its
    commit. The name is ``DATE-DEVICE-headline-COMMIT.json`` (``guard`` for several trees,
    the parts measured where not all); ValueError when the file is not a headline result,
    this is not such a checkout, or a tree's digest matches no commit."""
    if not Path(source).is_file():
        raise ValueError(f"{source}: no such file (give a headline.json a run wrote)")
    try:
        result = json.loads(Path(source).read_text())
        result["trees"], result["environment"]["date"]
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{source} is not JSON ({err}): give a headline.json a run wrote"
        ) from None
    except (KeyError, TypeError):
        raise ValueError(
            f"{source} holds no headline result: give a headline.json a run wrote"
        ) from None
    if not (directory.is_dir() and Path("src/srtrain").is_dir()):
        raise ValueError(
            f"no {directory}/ or src/srtrain/ here: run --record from the root of the srtrain "
            "checkout whose history holds the trees measured"
        )
    for name, tree in result["trees"].items():
        commit = commit_with_digest(tree["digest"])
        if commit is None:
            raise ValueError(
                f"{source}: tree {name!r} (digest {tree['digest']}) matches no commit "
                "of this checkout; record it from the checkout it was measured on"
            )
        tree["commit_seen"], tree["commit"] = tree["commit"], commit
    env = result["environment"]
    harness = commit_with_digest(env["source_digest"]) if "source_digest" in env else None
    if harness is not None and harness != env["commit"]:
        env["commit_recorded"], env["commit"] = env["commit"], harness
    device = device_slug(env["device"])
    measured = result["trees"][result["measured_tree"]]["commit"]
    parts = (
        ""
        if len(result["settings"]["parts"]) == len(PARTS)
        else "-" + "-".join(result["settings"]["parts"])
    )
    kind = "guard" if len(result["trees"]) > 1 else "headline"
    path = directory / f"{env['date'][:10]}-{device}-{kind}{parts}-{measured}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


# ----------------------------------------------------------------------------- a call


def run_headline(
    out: Path | None,
    trees: dict[str, Path],
    settings: Settings,
    environment: dict,
    baseline: Path | None = None,
    capacity_files: Sequence[Path] = (),
) -> int:
    """Measure, write ``out``/headline.json and headline.md, print the table and the guard's
    verdicts; 1 when a comparison found a row worse, else 0."""
    baseline_result = json.loads(baseline.read_text()) if baseline is not None else None
    values, rows = run_rounds(trees, settings)
    measured = list(trees)[-1]
    result = {
        "environment": environment,
        "settings": {
            **settings.__dict__,
            "parts": list(settings.parts),
            "variants": list(settings.variants),
            "worlds": list(settings.worlds),
        },
        "trees": {
            name: {"path": str(path), "commit": tree_commit(path), "digest": tree_digest(path)}
            for name, path in trees.items()
        },
        "measured_tree": measured,
        "values": values,
        "rows": rows,
        "capacity": capacity_section(capacity_files),
    }
    reports, worse = [], 0
    if len(trees) > 1:
        first = next(iter(trees))
        verdicts = compare(values[first], values[measured], settings.tolerance)
        result["guard"] = {"before": first, "after": measured, "verdicts": verdicts}
        reports.append(verdict_table(verdicts, f"guard: {first} → {measured}, in this call"))
        worse += regressions(verdicts)
    if baseline_result is not None:
        recorded = baseline_result["values"][baseline_result["measured_tree"]]
        verdicts = compare(recorded, values[measured], settings.tolerance)
        result["baseline"] = {"file": str(baseline), "verdicts": verdicts}
        title = f"against {baseline} (recorded in another call: machine drift counts too)"
        reports.append(verdict_table(verdicts, title))
        if len(trees) == 1:
            worse += regressions(verdicts)
    table = render_markdown(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "headline.json").write_text(json.dumps(result, indent=1))
        (out / "headline.md").write_text(table)
    print(table)
    for report in reports:
        print(report)
    return 1 if worse else 0
