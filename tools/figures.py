#!/usr/bin/env python3
"""Figures in README.md and docs/*.md, rendered from the recorded result files.

A generated block in a page is everything between two marker lines::

    <!-- figures: capacity -->
    ...Markdown that ``capacity()`` below renders...
    <!-- /figures -->

``python tools/figures.py`` renders every block of every page and reports the blocks whose
text differs from what their function renders now (exit status 1, with a diff);
``python tools/figures.py --write`` rewrites them in place. ``tests/test_figures.py`` runs
the check, so a hand edit inside a block, or a change to the data or to the code a figure
is computed with (the memory planner, the stall model's fitted spread), fails until the
blocks are written again. A name may appear in several pages; it renders the same text in
each. Prose is wrapped to the pages' width; tables and code are left as rendered.

Registering a block is a function that returns Markdown (a sentence, a paragraph, a table;
no marker lines, no trailing newline) under a name::

    @figure("performance")
    def performance() -> str:
        '''README Performance: the headline table.'''
        data = result("benchmarks/results/2026-12-05-h200-headline.json")
        return f"One {data['environment']['device']} ({provenance(data['environment'])}): ..."

then the two marker lines around the place it goes, and ``python tools/figures.py
--write``. Read every number from the files the figure names, and the date, device and
commit from their ``environment`` (:func:`provenance`); say beside each figure what it is
measured against (the baseline), how many seeds it has, and which parameter was fitted to
which data. :func:`result` reads a JSON file of the checkout, :func:`summary` and
:func:`run_file` a study grid's ``summary.json`` and its runs' files.

This is a lab tool, run from a checkout: the result files (``benchmarks/results``,
``docs/results/data``) are not part of the installed package, and the pages it writes are
the checkout's. It imports the checkout's ``src/srtrain`` and ``experiments``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
import tarfile
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT):  # the checkout's srtrain and experiments
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

START = re.compile(r"^<!-- figures: (?P<name>[\w.-]+) -->$")
END = "<!-- /figures -->"
STUDY = ROOT / "docs" / "results" / "data"
CAPACITY_FILES = (
    "benchmarks/results/2026-12-03-h200-capacity-ladder.json",
    "benchmarks/results/2026-12-03-h200-capacity-7b.json",
    "benchmarks/results/2026-12-05-h200-capacity-inbwd.json",  # the step inside backward
    "benchmarks/results/2026-12-05-h200-capacity-7b.json",  # 7B: ordinary against inside
)
LADDER_FILES = (CAPACITY_FILES[0], CAPACITY_FILES[2])

REGISTRY: dict[str, Callable[[], str]] = {}


def figure(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register ``fn`` as the renderer of the blocks called ``name``."""

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in REGISTRY:
            raise ValueError(f"figure {name!r} is registered twice")
        REGISTRY[name] = fn
        return fn

    return register


def pages() -> list[Path]:
    """The pages that may hold blocks: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ------------------------------------------------------------------------------ blocks


class FigureError(Exception):
    """A page whose markers do not pair up, or a block no function renders."""


@dataclass(frozen=True)
class Block:
    """A generated block: its name and the lines between its markers (``start`` is the
    index of the opening marker, ``end`` that of the closing one)."""

    name: str
    start: int
    end: int


def find_blocks(lines: Sequence[str], where: str = "page") -> list[Block]:
    """The blocks of a page's lines; markers that do not pair up are an error."""
    found, open_block = [], None
    for i, line in enumerate(lines):
        match = START.match(line.rstrip("\n"))
        if match:
            if open_block is not None:
                raise FigureError(f"{where}:{i + 1}: block opened inside {open_block[0]!r}")
            open_block = (match["name"], i)
        elif line.rstrip("\n") == END:
            if open_block is None:
                raise FigureError(f"{where}:{i + 1}: {END} without an opening marker")
            found.append(Block(open_block[0], open_block[1], i))
            open_block = None
    if open_block is not None:
        raise FigureError(f"{where}:{open_block[1] + 1}: block {open_block[0]!r} is not closed")
    return found


WIDTH = 92  # prose lines are wrapped to this width, as the pages' own text is


def wrap(text: str) -> str:
    """Prose paragraphs wrapped to :data:`WIDTH`; tables, fenced code and lines that start
    a list item or a heading are left as they are."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        keep = fenced or line.startswith(("```", "|", "#", "- ", "* ", "<!--")) or not line
        out.append(
            line
            if keep
            else textwrap.fill(line, WIDTH, break_long_words=False, break_on_hyphens=False)
        )
    return "\n".join(out)


@cache
def render(name: str) -> str:
    """The text of block ``name`` as its function renders it now (prose wrapped)."""
    if name not in REGISTRY:
        raise FigureError(f"no figure is registered as {name!r}")
    return wrap(REGISTRY[name]().rstrip("\n"))


def rewritten(text: str, where: str = "page") -> str:
    """A page's text with every block rendered afresh."""
    lines = text.splitlines(keepends=True)
    out, last = [], 0
    for block in find_blocks(lines, where):
        out += lines[last : block.start + 1]
        out.append(render(block.name) + "\n")
        last = block.end
    return "".join(out + lines[last:])


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def check(paths: Iterable[Path] | None = None) -> list[str]:
    """A unified diff per page whose blocks differ from what they render now."""
    diffs = []
    for path in pages() if paths is None else paths:
        text = path.read_text()
        where = _where(path)
        fresh = rewritten(text, where)
        if fresh != text:
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        text.splitlines(keepends=True),
                        fresh.splitlines(keepends=True),
                        f"{where} (as written)",
                        f"{where} (rendered now)",
                    )
                )
            )
    return diffs


def write(paths: Iterable[Path] | None = None) -> list[Path]:
    """Rewrite the blocks of every page in place; returns the pages that changed."""
    changed = []
    for path in pages() if paths is None else paths:
        text = path.read_text()
        fresh = rewritten(text, _where(path))
        if fresh != text:
            path.write_text(fresh)
            changed.append(path)
    return changed


# -------------------------------------------------------------------------- data access


@cache
def result(path: str) -> dict[str, Any]:
    """A JSON result file, by its path in the checkout."""
    return json.loads((ROOT / path).read_text())


@cache
def summary(grid_dir: str) -> dict[str, Any]:
    """The ``summary.json`` of a recorded study grid (a directory under docs/results/data)."""
    return json.loads((STUDY / grid_dir / "summary.json").read_text())


def runs(grid_dir: str) -> dict[str, dict[str, Any]]:
    """A recorded grid's summary entries by run name."""
    return {entry["name"]: entry for entry in summary(grid_dir)["runs"]}


@cache
def _members(grid_dir: str) -> dict[str, bytes]:
    with tarfile.open(STUDY / grid_dir / "results.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def run_file(grid_dir: str, run: str, name: str) -> str:
    """A file of one run of a recorded grid (``config.yaml``, ``train.log``, ...)."""
    return _members(grid_dir)[f"{run}/{name}"].decode()


@cache
def run_config(grid_dir: str, run: str) -> dict[str, Any]:
    """The resolved config a recorded run trained with."""
    import yaml

    return yaml.safe_load(run_file(grid_dir, run, "config.yaml"))


def short_date(text: str) -> str:
    """The date part of an ISO timestamp."""
    return text[:10]


def provenance(env: dict[str, Any]) -> str:
    """``2026-12-03, NVIDIA H200, commit 17b787f`` from a result's environment (fields it
    lacks read 'not recorded')."""
    commit = env.get("commit") or "unknown"
    commit_text = "commit not recorded" if commit == "unknown" else f"commit `{commit}`"
    device = env.get("device") or "device not recorded"
    return f"{short_date(env.get('date', ''))}, {device}, {commit_text}"


def study_provenance(grid_dir: str) -> str:
    """Date, device and commit of a recorded grid, from its summary (the study runner
    records device and commit from this version on; older summaries read 'unknown')."""
    s = summary(grid_dir)
    device = s.get("device", "unknown")
    commit = s.get("commit", "unknown")
    parts = [short_date(s["started"])]
    unknown = [
        what for what, value in (("device", device), ("commit", commit)) if value == "unknown"
    ]
    if device != "unknown":
        parts.append(f"{len(s['gpus'])}× {device}" if len(s["gpus"]) > 1 else device)
    if commit != "unknown":
        parts.append(f"commit `{commit}`")
    if unknown:
        parts.append(" and ".join(unknown) + " not recorded")
    return ", ".join(parts)


# ------------------------------------------------------------------------------ numbers


def signed(value: float, digits: int = 3) -> str:
    """``+0.012`` / ``−0.008`` (a true minus sign)."""
    return f"{value:+.{digits}f}".replace("-", "−")


def plain(value: float, digits: int = 3) -> str:
    """``0.012`` / ``−0.008``."""
    return f"{value:.{digits}f}".replace("-", "−")


def span(values: Iterable[float], fmt: Callable[[float], str] = signed) -> str:
    """``a to b`` over the values (one value: itself)."""
    values = sorted(values)
    lo, hi = fmt(values[0]), fmt(values[-1])
    return lo if lo == hi else f"{lo} to {hi}"


def dash_span(values: Iterable[float], fmt: Callable[[float], str] = plain) -> str:
    """``a–b`` over the values (one value: itself)."""
    values = sorted(values)
    lo, hi = fmt(values[0]), fmt(values[-1])
    return lo if lo == hi else f"{lo}–{hi}"


def count_word(n: int) -> str:
    """``two`` for 2 (up to ten), else the digits."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    return words[n] if 0 <= n < len(words) else str(n)


def millions(count: int) -> str:
    """``58.1M`` / ``1.34B``."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


# ------------------------------------------------------------------------------- models

MODEL_NAMES = {"llama-60m": "LLaMA-60M", "neox-160m": "NeoX-160M"}
FORMAT_NAMES = {
    "fp32": "FP32",
    "bf16": "BF16",
    "fp8": "FP8",
    "fp4": "FP4",
    "fp4_e2m1": "FP4",
    "fp4_e2m2": "FP4",
}
ROUNDING_NAMES = {"nearest": "NR", "stochastic": "SR"}


@cache
def parameter_count(preset: str, vocab_size: int, seq_len: int) -> int:
    """Parameters of a preset at a vocabulary (counted on a model built on the meta device)."""
    from srtrain.models import build_model, count_params

    return count_params(build_model(preset, vocab_size, seq_len))


def vocab_text(vocab_size: int) -> str:
    """``32k`` / ``8k``."""
    return f"{round(vocab_size / 1000)}k"


def model_text(config: dict[str, Any], style: str = "paren") -> str:
    """The preset's name with the size the run had: ``LLaMA-60M (58.1M parameters at a 32k
    vocabulary)``; ``short``: ``LLaMA-60M (58.1M parameters)``; ``comma``: ``LLaMA-60M,
    58.1M parameters at a 32k vocabulary``."""
    preset, vocab = config["model"]["preset"], config["data"]["vocab_size"]
    count = millions(parameter_count(preset, vocab, config["model"]["seq_len"]))
    name = MODEL_NAMES.get(preset, preset)
    vocab_words = vocab_text(vocab)
    article = "an" if vocab_words[0] == "8" or vocab_words.startswith(("11", "18")) else "a"
    size = f"{count} parameters at {article} {vocab_words} vocabulary"
    if style == "short":
        return f"{name} ({count} parameters)"
    if style == "comma":
        return f"{name}, {size}"
    return f"{name} ({size})"


SHAPES_VOCAB = 32000  # the preset table's common vocabulary (LLaMA-1's and Llama 2's)
# The vocabulary of the tokenizer each line of presets ships with (the preset name up to its
# first "-", else the family): the table's last column where it is not SHAPES_VOCAB.
OWN_VOCAB = {"llama": 32000, "llama2": 32000, "llama3": 128256, "gpt-neox": 50304}
OWN_VOCAB_TEXT = "Llama 3's tokenizer: 128256; GPT-NeoX's and Pythia's: 50304"


def own_vocab(preset: str, family: str) -> int:
    """The vocabulary of the published models of a preset's line (:data:`OWN_VOCAB`)."""
    line = family if family != "llama" else preset.split("-", 1)[0]
    if line not in OWN_VOCAB:
        raise FigureError(f"model-shapes: no vocabulary is known for preset {preset!r}")
    return OWN_VOCAB[line]


def _exponent(value: float) -> str:
    """``1e-6`` for 1e-06."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:g}").replace("e+", "e")


@figure("model-shapes")
def model_shapes() -> str:
    """docs/training.md Model shapes: every preset of ``srtrain.models.PRESETS``, its shape
    and its parameters (counted on a model built on the meta device) at a 32000 vocabulary
    and at the vocabulary of its published models."""
    from srtrain.models import PRESETS, preset_shape

    lines = [
        "| preset | family | hidden | intermediate | layers | heads | KV heads | RoPE θ | norm ε "
        f"| parameters at vocab {SHAPES_VOCAB} | at its own vocab |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        s = preset_shape(preset)
        own = own_vocab(preset, s.family)
        at_own = (
            "–"
            if own == SHAPES_VOCAB
            else f"{millions(parameter_count(preset, own, 2048))} (vocab {own})"
        )
        lines.append(
            f"| `{preset}` | {s.family} | {s.hidden} | {s.intermediate} | {s.layers} | "
            f"{s.heads} | {s.key_value_heads} | {s.rope_theta:g} | {_exponent(s.norm_eps)} | "
            f"{millions(parameter_count(preset, SHAPES_VOCAB, 2048))} | {at_own} |"
        )
    tied = [p for p in PRESETS if PRESETS[p].tied]
    tied_text = (
        "the input embedding shared with the output head in " + ", ".join(f"`{p}`" for p in tied)
        if tied
        else "no preset shares its input embedding with the output head"
    )
    lines += [
        "",
        "Every preset of `srtrain.models.PRESETS`, with the parameters of the model "
        f"`srtrain.models` builds for it (counted on the meta device; {tied_text}). Own "
        "vocab: the vocabulary of the tokenizer the published models of that line use "
        f"({OWN_VOCAB_TEXT}); – where it is {SHAPES_VOCAB}.",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------- study: stall model

STALL_BAND = 0.02  # README's claim: the model is within this of a measured stall fraction
FIRST_STUDY = ("ablation", "neox")  # the grids the README's first table comes from
HELD_OUT = ("lean", "resets", "resets-2", "health")  # grids recorded after λ_m was fitted
# the cells λ_m was fitted to (minimax), as srtrain.theory.blocks states
SPREAD_FIT = {("ablation", "fp4-nr", "m"), ("ablation", "fp4-sr", "m"), ("neox", "fp4-sr", "m")}


@dataclass(frozen=True)
class Cell:
    """One run's state: measured dense-weight stall fraction against the block model at age
    (both as the study summary records them), over the last 20% of the run's logged steps."""

    grid: str
    run: str
    state: str
    fmt: str
    rounding: str
    resets: str
    measured: float
    predicted: float
    window: tuple[int, int]
    model: str

    @property
    def miss(self) -> float:
        """Measured minus predicted."""
        return self.measured - self.predicted

    @property
    def kind(self) -> str:
        """``FP4 m SR``."""
        return f"{FORMAT_NAMES[self.fmt]} {self.state} {ROUNDING_NAMES[self.rounding]}"


def stall_cells(grids: Sequence[str], with_resets: bool = True) -> list[Cell]:
    """The cells of the recorded grids whose states are in a low-precision format (FP32
    states stall only where a gradient is zero, which the model does not cover)."""
    cells = []
    for grid in grids:
        for entry in summary(grid)["runs"]:
            if not with_resets and entry["reset_mode"] != "none":
                continue
            model = MODEL_NAMES[run_config(grid, entry["name"])["model"]["preset"]]
            for state in ("m", "v"):
                s = entry["stall"][state]
                if s["format"] == "fp32" or s["measured_dense"] is None:
                    continue
                cells.append(
                    Cell(
                        grid,
                        entry["name"],
                        state,
                        s["format"],
                        s["rounding"],
                        entry["reset_mode"],
                        s["measured_dense"],
                        s["predicted_at_age"],
                        tuple(s["window_steps"]),
                        model,
                    )
                )
    return cells


def first_study_cells() -> list[Cell]:
    """The 22 cells of the README's first stall table (no resets)."""
    return stall_cells(FIRST_STUDY, with_resets=False)


def held_out_cells() -> list[Cell]:
    """Every cell of the grids recorded after λ_m was fitted (with and without resets)."""
    return stall_cells(HELD_OUT)


def _misses(cells: Sequence[Cell]) -> list[Cell]:
    return [c for c in cells if abs(c.miss) > STALL_BAND]


def _miss_groups(cells: Sequence[Cell]) -> str:
    """``It overpredicts FP4 m under SR in the other 9, by 0.025–0.034 (...).``, per kind."""
    groups: dict[tuple[str, str, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((FORMAT_NAMES[cell.fmt], cell.state, cell.rounding), []).append(cell)
    sentences = []
    for (fmt, state, rounding), members in groups.items():
        over = all(c.miss < 0 for c in members)
        under = all(c.miss > 0 for c in members)
        verb = "overpredicts" if over else "underpredicts" if under else "misses"
        which = f"the other {len(members)}" if len(groups) == 1 else f"{len(members)} of them"
        sentences.append(
            f"It {verb} {fmt} {state} under {ROUNDING_NAMES[rounding]} in {which}, by "
            f"{dash_span(abs(c.miss) for c in members)} (predicted "
            f"{dash_span(c.predicted for c in members)}, measured "
            f"{dash_span(c.measured for c in members)})."
        )
    return " ".join(sentences)


@figure("stall-model")
def stall_model() -> str:
    """README Results: the stall model against the first study and the held-out grids."""
    from srtrain.theory import DEFAULT_SPREAD

    first, held = first_study_cells(), held_out_cells()
    fit = [c for c in first if (c.grid, c.run, c.state) in SPREAD_FIT]
    first_miss, held_miss = _misses(first), _misses(held)
    models = sorted({c.model for c in first})
    formats = "/".join(dict.fromkeys(FORMAT_NAMES[c.fmt] for c in first))
    missed = " and ".join(
        f"{c.kind} on {c.model} by {plain(abs(c.miss))}"
        for c in sorted(first_miss, key=lambda c: abs(c.miss))
    )
    held_models = "; ".join(sorted({model_text(run_config(c.grid, c.run), "comma") for c in held}))
    v = [c for c in first if c.state == "v"]
    m = [c for c in first if c.state == "m"]
    v_lo, v_hi = min(v, key=lambda c: c.measured), max(v, key=lambda c: c.measured)
    text = [
        "**Stall fractions against the theory.** The stall model the trainer and the study "
        "use (`srtrain.theory.blocks`: each FP8/FP4 element on its block's grid, v under "
        "nearest rounding on its biased drift) has one fitted parameter: "
        f"λ_m = {DEFAULT_SPREAD['m']:g}, the spread of gradient scales within a block of m, "
        f"chosen to minimise the largest miss over the {len(fit)} FP4 m cells of the first "
        f"study. In that study's {len(first)} cells ({' and '.join(models)}, {formats}, NR "
        "and SR, no resets, last 20% of each run), it is within "
        f"{STALL_BAND:g} of the measured dense-weight stall fraction in "
        f"{len(first) - len(first_miss)}."
    ]
    if first_miss:
        text.append(f"It misses {missed}.")
    text.append(
        f"On the {len(held)} cells of later grids that the fit never saw ({held_models}; "
        f"another corpus; with and without resets), it is within {STALL_BAND:g} in "
        f"{len(held) - len(held_miss)}."
    )
    if held_miss:
        text.append(_miss_groups(held_miss))
    text.append(
        f"v stalls far more than m: {plain(v_lo.measured, 2)} "
        f"({v_lo.kind.replace(' v', '')}) to {plain(v_hi.measured)} "
        f"({v_hi.kind.replace(' v', '')}) against m's {dash_span(c.measured for c in m)}."
    )
    return " ".join(text)


FORMAT_ORDER = {"bf16": 0, "fp8": 1, "fp4_e2m1": 2, "fp4_e2m2": 2, "fp4": 2}


@figure("stall-first-study")
def stall_first_study() -> str:
    """docs/study.md: the first study's stall table, measured against both models."""
    rows = [
        "| model | states | v measured | v block | v plain (at age / steady) | m measured | "
        "m block | m plain (at age / steady) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    entries = []
    for grid in FIRST_STUDY:
        for entry in summary(grid)["runs"]:
            v = entry["stall"]["v"]
            if entry["reset_mode"] != "none" or v["format"] == "fp32":
                continue
            model = MODEL_NAMES[run_config(grid, entry["name"])["model"]["preset"]]
            key = (FIRST_STUDY.index(grid), FORMAT_ORDER[v["format"]], v["rounding"])
            entries.append((key, model, entry))
    for _, model, entry in sorted(entries, key=lambda e: e[0]):
        m, v = entry["stall"]["m"], entry["stall"]["v"]
        cells = []
        for st in (v, m):
            cells += [
                f"{st['measured_dense']:.3f}",
                f"{st['predicted_at_age']:.3f}",
                f"{st['predicted_plain_at_age']:.3f} / {st['predicted_plain_steady']:.3f}",
            ]
        states = f"{FORMAT_NAMES[v['format']]} {ROUNDING_NAMES[v['rounding']]}"
        rows.append(f"| {model} | {states} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# The first study's notes under its stall table (docs/study.md): v's drift under NR, the
# block grid of m, the cells the model misses, and what "all weights" adds.
SPREAD_SHOWN_V = 0.5  # a v spread to show how v's prediction rises with λ
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _first_study_entries() -> list[tuple[str, str, dict[str, Any]]]:
    """(grid, model, entry) of the first study's runs without resets, FP32 states included."""
    out = []
    for grid in FIRST_STUDY:
        for entry in summary(grid)["runs"]:
            if entry["reset_mode"] == "none":
                out.append(
                    (grid, MODEL_NAMES[run_config(grid, entry["name"])["model"]["preset"]], entry)
                )
    return out


def grid_values(fmt_name: str) -> list[float]:
    """The non-negative values of a format's grid, before any block scale."""
    from srtrain.numerics.formats import get_format

    fmt = get_format(fmt_name)
    steps = 2**fmt.fraction_bits
    values = [k * fmt.min_subnormal for k in range(steps)]
    for e in range(fmt.min_exp, fmt.max_exp + 1):
        top = fmt.max_fraction if e == fmt.max_exp else steps - 1
        values += [(1 + f / steps) * 2.0**e for f in range(top + 1)]
    return values


@cache
def _m_block_at(fmt: str, rounding: str, spread: float) -> float:
    """Steady block-model stall of m (β₁ of the first study) at a spread λ."""
    from srtrain.theory import DEFAULT_BLOCK_SIZE, block_stall_probability

    return block_stall_probability(fmt, None, rounding, "m", DEFAULT_BLOCK_SIZE, spread)


@figure("stall-first-study-notes")
def stall_first_study_notes() -> str:
    """docs/study.md Stall fractions against the theory: the notes under the first study's
    table, from the same runs, with the block model at other spreads λ."""
    from srtrain.numerics.formats import get_format
    from srtrain.theory import DEFAULT_BLOCK_SIZE, DEFAULT_SPREAD, block_stall_probability

    entries = _first_study_entries()
    low = [(g, model, e) for g, model, e in entries if e["stall"]["v"]["format"] != "fp32"]

    def cells(state: str, fmt: str | None = None, rounding: str | None = None) -> list:
        return [
            (model, e, e["stall"][state])
            for _, model, e in low
            if (fmt is None or FORMAT_NAMES[e["stall"][state]["format"]] == fmt)
            and (rounding is None or e["stall"][state]["rounding"] == rounding)
        ]

    models = list(dict.fromkeys(model for _, model, _ in low))
    items = []

    # v under SR: the measured value against both models at age
    v_sr = cells("v", rounding="stochastic")
    worst = max(abs(s["measured_dense"] - s["predicted_at_age"]) for _, _, s in v_sr)
    moved = max(abs(s["predicted_at_age"] - s["predicted_plain_at_age"]) for _, _, s in v_sr)
    same = all(
        f"{s['predicted_at_age']:.3f}" == f"{s['predicted_plain_at_age']:.3f}" for _, _, s in v_sr
    )
    v_formats = "/".join(dict.fromkeys(FORMAT_NAMES[s["format"]] for _, _, s in v_sr))
    items.append(
        f"**v under SR matches the theory within {plain(worst)} in every format** ({v_formats}), "
        f"on {' and '.join(models)} ("
        + (
            "the block model gives the plain model's values there, to three decimals)."
            if same
            else f"the block model moves the plain model's values by at most {plain(moved)})."
        )
    )

    # BF16 v under NR: the mean-field drift against the measured and the plain model
    nr = cells("v", "BF16", "nearest")
    bf16 = get_format(nr[0][2]["format"])
    betas = {s["beta"] for _, _, s in nr}
    if len(betas) != 1:
        raise FigureError("stall-first-study-notes: the BF16 NR runs differ in β₂")
    (beta2,) = betas
    half_step = bf16.fraction_bits + 2  # half a grid step is at least 2**-(P+2) of the value
    if 1 - beta2 >= 2.0**-half_step:
        raise FigureError("stall-first-study-notes: BF16 NR v can decrease at the runs' β₂")
    windows = " and ".join(
        f"{model} steps {s['window_steps'][0]}–{s['window_steps'][1]}" for model, _, s in nr
    )
    rest = " and ".join(
        f"{plain(s['measured_dense'] - s['predicted_at_age'])} ({model})" for model, _, s in nr
    )
    items.append(
        f"**BF16 with nearest rounding: v's drift.** Under NR in BF16 at β₂ > 1 − "
        f"2{str(-half_step).translate(SUPERSCRIPT)} ({1 - 2.0**-half_step:.5f}; these runs: "
        f"{beta2:g}), v can never decrease: a decrease is at most (1 − β₂)·v, and half a grid "
        f"step is at least 2{str(-half_step).translate(SUPERSCRIPT)}·v. Its mean therefore "
        "climbs past E[g²] with age, even at a constant gradient scale, and more updates "
        "stall. Following that drift (mean field: w_{j+1} = w_j + (1-β)·E[(z-w_j)·1{|z-w_j| ≥ "
        "ρ̂w_j}]) predicts "
        + " and ".join(plain(s["predicted_at_age"]) for _, _, s in nr)
        + " against the measured "
        + " and ".join(plain(s["measured_dense"]) for _, _, s in nr)
        + " (plain model at age: "
        + " and ".join(plain(s["predicted_plain_at_age"]) for _, _, s in nr)
        + f"; {windows}). The mean field ignores v's spread across elements. Whether that "
        f"spread, at a constant gradient scale, accounts for the remaining {rest} would take a "
        "simulation of the rounded recursion; its numbers are not recorded."
    )

    # runs the grid's deadline stopped after their last step
    for grid, model, e in entries:
        if e["status"] == "complete":
            continue
        v = e["stall"]["v"]
        states = f"{FORMAT_NAMES[v['format']]} {ROUNDING_NAMES[v['rounding']]}"
        stopped = summary(grid).get("stopped_by") or "runner"
        if e["steps_reached"] == e["steps_total"]:
            what = (
                f"was stopped by the {stopped} after its last step and before it exited; its "
                f"numbers cover all {e['steps_total']} steps."
            )
        else:
            what = (
                f"was stopped by the {stopped} at step {e['steps_reached']} of "
                f"{e['steps_total']}; its numbers cover the steps it reached."
            )
        items.append(f"**The {model} {states} run** {what}")

    # m in block-scaled formats: the block grid, λ = 0 and the fitted λ
    fp4_m = cells("m", "FP4")
    fp4_v = cells("v", "FP4", "stochastic")
    fp8_m = cells("m", "FP8")
    m_fmt = fp4_m[0][2]["format"]
    block = {s["block_size"] for _, _, s in fp4_m + fp8_m}
    if block != {DEFAULT_BLOCK_SIZE}:
        raise FigureError("stall-first-study-notes: the runs' block size is not the model's")
    lam_m, lam_v = DEFAULT_SPREAD["m"], DEFAULT_SPREAD["v"]
    by_rounding = ("nearest", "stochastic")
    iid = [_m_block_at(m_fmt, r, 0.0) for r in by_rounding]
    fitted = [_m_block_at(m_fmt, r, lam_m) for r in by_rounding]
    plain_m = [
        next(s["predicted_plain_steady"] for _, _, s in fp4_m if s["rounding"] == r)
        for r in by_rounding
    ]
    v_fmt = fp4_v[0][2]["format"]
    v_rises = [
        block_stall_probability(v_fmt, None, "stochastic", "v", DEFAULT_BLOCK_SIZE, lam)
        for lam in (lam_v, SPREAD_SHOWN_V)
    ]
    grid_text = ", ".join(f"{x:g}" for x in grid_values(m_fmt))
    items.append(
        "**m in block-scaled formats: the block's grid.** In FP8/FP4 the block's largest "
        "element sets the grid, and smaller elements sit on a coarse absolute grid "
        f"({m_fmt.split('_')[-1].upper()}: {grid_text} times the scale). The block model "
        "integrates each element's stall probability over its position relative to its block "
        f"scale. That scale is set by the largest of {DEFAULT_BLOCK_SIZE} elements, and the "
        "block's overall size is log-uniform against powers of two. With identically "
        f"distributed elements (λ = 0), FP4 m comes out at {plain(iid[0])} (NR) and "
        f"{plain(iid[1])} (SR): above the plain {plain(plain_m[0])} and {plain(plain_m[1])}, "
        f"but still short of the measured {dash_span(s['measured_dense'] for _, _, s in fp4_m)}. "
        f"A log-normal spread of gradient scales within a block, λ = {lam_m:g}, gives "
        f"{plain(fitted[0])} and {plain(fitted[1])}. **λ was fitted** (minimax over the FP4 m "
        f"cells) after seeing that shortfall; it is not derived. For v, λ = {lam_v:g}: the "
        f"measured FP4 v stall under SR ({dash_span(s['measured_dense'] for _, _, s in fp4_v)}) "
        f"sits at that value ({dash_span(s['predicted_at_age'] for _, _, s in fp4_v)} at the "
        f"runs' ages), which rises with λ (steady state: {plain(v_rises[0])} at λ = {lam_v:g}, "
        f"{plain(v_rises[1])} at λ = {SPREAD_SHOWN_V:g}). FP8's wide range makes the block "
        f"scale nearly irrelevant: {dash_span(s['predicted_at_age'] for _, _, s in fp8_m)} "
        f"(plain {dash_span(s['predicted_plain_at_age'] for _, _, s in fp8_m)}), against "
        f"{dash_span(s['measured_dense'] for _, _, s in fp8_m)} measured."
    )

    # where the block model misses: an NR/SR pair whose measured gap the model does not have
    missed = [
        (model, e, state, e["stall"][state])
        for _, model, e in low
        for state in ("m", "v")
        if abs(e["stall"][state]["measured_dense"] - e["stall"][state]["predicted_at_age"])
        > STALL_BAND
    ]
    pair = {
        (s["rounding"], model, state, FORMAT_NAMES[s["format"]]) for model, _, state, s in missed
    }
    kinds = {(model, state, fmt) for _, model, state, fmt in pair}
    if len(missed) != 2 or len(kinds) != 1 or {r for r, *_ in pair} != set(by_rounding):
        raise FigureError("stall-first-study-notes: the misses are no longer one NR/SR pair")
    ((miss_model, miss_state, miss_fmt),) = kinds
    by = {s["rounding"]: (e, s) for _, e, _, s in missed}
    (e_nr, s_nr), (e_sr, s_sr) = by["nearest"], by["stochastic"]
    if not (
        s_nr["measured_dense"] > s_nr["predicted_at_age"]
        and s_sr["measured_dense"] < s_sr["predicted_at_age"]
    ):
        raise FigureError("stall-first-study-notes: the misses are not NR under, SR over")
    gap = s_nr["measured_dense"] - s_sr["measured_dense"]
    model_gap = s_nr["predicted_at_age"] - s_sr["predicted_at_age"]
    times = round(gap / model_gap)
    # the misses at the fitted λ lie either side of the model, and both predictions rise with
    # λ (checked between 0 and the fitted λ): moving λ widens one miss or the other
    rises = all(
        _m_block_at(s["format"], s["rounding"], 0.0) < s["predicted_at_age"] for s in (s_nr, s_sr)
    )
    if not rises:
        raise FigureError("stall-first-study-notes: the model of m does not rise with λ")
    others = [(model, e, s) for model, e, s in cells(miss_state, miss_fmt) if model != miss_model]
    other_text = " ".join(
        f"{model} {miss_fmt} {miss_state} {ROUNDING_NAMES[s['rounding']]} "
        f"({plain(s['measured_dense'])} against {plain(s['predicted_at_age'])}) is within "
        f"{STALL_BAND:g}."
        for model, _, s in others
    )
    items.append(
        f"**Where it still misses: {miss_fmt} {miss_state} on {miss_model}**, "
        f"{plain(s_nr['measured_dense'])} measured against {plain(s_nr['predicted_at_age'])} "
        f"(NR) and {plain(s_sr['measured_dense'])} against {plain(s_sr['predicted_at_age'])} "
        f"(SR). The measured gap between NR and SR ({plain(gap)}) is {count_word(times)} times "
        f"the model's ({plain(model_gap)}). At λ = {lam_m:g} the model is already above the SR "
        "cell and below the NR one, and both predictions rise with λ, so moving λ either way "
        f"widens one of the misses: no single λ fits both. The {miss_fmt} NR run also trains "
        "much worse (validation loss "
        f"{e_nr['final_val_loss']:.2f} against {e_sr['final_val_loss']:.2f}), so its gradients "
        f"are not the SR run's. {other_text}"
    )

    # "all weights": embedding rows of tokens absent from a batch get a zero gradient
    diffs = {
        state: [s["measured"] - s["measured_dense"] for _, _, s in cells(state)]
        for state in ("m", "v")
    }
    higher = [state for state in ("m", "v") if min(diffs[state]) > 0]
    fp32 = [(model, e) for _, model, e in entries if e["stall"]["v"]["format"] == "fp32"]
    if not higher or not fp32:
        raise FigureError("stall-first-study-notes: the all-weights note has no basis")
    mixed = [state for state in ("m", "v") if state not in higher]
    lead = " and ".join(higher)
    text = (
        f'**"All weights" stall fractions of {lead} run higher than the dense-weight ones** '
        f"(by {dash_span(d for state in higher for d in diffs[state])} in the first study's "
        "cells"
    )
    if mixed:
        state = mixed[0]
        text += (
            f"; {state}'s sit from {plain(-min(diffs[state]))} below to "
            f"{plain(max(diffs[state]))} above them"
        )
    fp32_model, fp32_entry = fp32[0]
    fv, fm = fp32_entry["stall"]["v"], fp32_entry["stall"]["m"]
    text += (
        "). They include embedding rows of tokens absent from a batch, which get a zero "
        f"gradient. FP32 states ({fp32_model}) show {plain(fv['measured'])} (v) and "
        f"{plain(fm['measured'])} (m) stalled for that reason alone, against "
        f"{dash_span((fv['measured_dense'], fm['measured_dense']))} in the dense weights. "
        "Per-group fractions are logged as `stall/<m|v>/<group>`."
    )
    items.append(text)
    return "\n".join(list_item(item) for item in items)


@figure("health-setup")
def health_setup() -> str:
    """docs/training.md Watching a run: what the health grid trained (its figure's caption)."""
    config = run_config("health", "fp8-sr")
    return (
        f"**Healthy and unhealthy states.** {model_text(config)} over "
        f"{config['train']['steps']} steps with FP4 and FP8 states, stochastic (solid) and "
        f"nearest (dashed) rounding, one seed, {study_provenance('health')} "
        "(`python -m experiments.study run --grid health`, [commands](study.md#reproduce); "
        "[table](results/results.md#grid-health-state-health-against-the-fp32-shadow)):"
    )


# The health grid's reading in docs/training.md: the log steps its ranges start from
HEALTH_GRID = "health"
HEALTH_HELD_FROM = 300  # update cosine: past the NR runs' early fall, the levels it held from
HEALTH_UNDERFLOW_FROM = 500  # FP4 m's underflow: the level NR raised it to, from this step on
HEALTH_CLIMB_AFTER = 1000  # rel_err: where the NR runs' climb is read from
HEALTH_TABLE_LINK = "results/results.md#grid-health-state-health-against-the-fp32-shadow"


@cache
def health_grid_data() -> Any:
    """The recorded ``health`` grid as the study report reads it (runs with their records)."""
    from experiments.study.report import load_study

    return load_study([STUDY / HEALTH_GRID]).grids[HEALTH_GRID]


def health_series(run: str, key: str) -> dict[int, float]:
    """One metrics.jsonl key of a health run at each of its shadow (log) steps, finite
    values only."""
    import math

    from experiments.study.health import shadow_records

    records = shadow_records(health_grid_data().runs[run])
    return {r["step"]: r[key] for r in records if math.isfinite(r.get(key, math.nan))}


def _health_window(
    series: dict[int, float], start: int = 0, after: int | None = None
) -> list[float]:
    """The values from step ``start`` on (or after step ``after``)."""
    return [v for s, v in series.items() if s >= start and (after is None or s > after)]


def _health_loss(run: str) -> float:
    return health_grid_data().runs[run].entry["final_val_loss"]


def _health_cell(value: float | None, spec: str) -> str:
    """A table number with a true minus sign; one that rounds to zero reads unsigned."""
    if value is None:
        return "–"
    text = format(value, spec)
    if float(text) == 0:
        text = format(0.0, spec.lstrip("+"))
    return text.replace("-", "−")


def list_item(text: str) -> str:
    """A list item wrapped to the pages' width."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent="- ",
        subsequent_indent="  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _health_formats() -> str:
    """``FP4 (E2M1 m / E2M2 v) and FP8``: the state formats of the health grid's runs."""
    seen: dict[tuple[str, str], None] = {}
    for run in health_grid_data().runs.values():
        seen[(run.config["optim"]["m_format"], run.config["optim"]["v_format"])] = None
    names = []
    for m, v in seen:
        name = FORMAT_NAMES[m]
        if m != v:
            name += f" ({m.split('_')[-1].upper()} m / {v.split('_')[-1].upper()} v)"
        names.append(name)
    return " and ".join(names)


@figure("health-runs")
def health_runs() -> str:
    """docs/training.md Watching a run: what the health grid trained and its state health at
    each run's last shadow step (the study report's health table, in the page's columns)."""
    from experiments.study.health import HEALTH_COLUMNS, RANGE_KEY, health_rows
    from srtrain.config import OptimConfig

    grid = health_grid_data()
    config = run_config(HEALTH_GRID, "fp8-sr")
    o, t = config["optim"], config["train"]
    gpus = len(summary(HEALTH_GRID)["gpus"])
    shadow = (
        "the default shadow"
        if o["shadow_sample"] == OptimConfig().shadow_sample
        else f"`optim.shadow_sample={o['shadow_sample']}`"
    )
    rows = health_rows(grid)
    steps = sorted({row.step for row in rows})
    when = f"At step {steps[0]}" if len(steps) == 1 else "At each run's last log step"
    header = ["states", "val loss"]
    for key, (name, _) in HEALTH_COLUMNS.items():
        header.append(name)
        if key == RANGE_KEY:
            header.append(f"{name} min / max")
    lines = [
        f"**Healthy and unhealthy runs.** The study grid `{HEALTH_GRID}` trained "
        f"{model_text(config)} for {t['steps']} steps (seq_len {config['model']['seq_len']}, "
        f"batch {t['global_batch_size']}, lr {o['lr']:g} with {o['warmup_steps']} warmup "
        f"steps, β₂ {o['beta2']:g}, the `{config['data']['dir']}` corpus; {count_word(gpus)} "
        f"GPU{'s' if gpus > 1 else ''}, {study_provenance(HEALTH_GRID)}) with "
        f"{_health_formats()} states, each rounded to nearest (NR) or stochastically (SR), "
        f"and {shadow}, one seed. {when} ([all tables]({HEALTH_TABLE_LINK})):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        config = health_grid_data().runs[row.name].config
        cells = [_states_label(config), f"{_health_loss(row.name):.3f}"]
        for key, (_, spec) in HEALTH_COLUMNS.items():
            cells.append(_health_cell(row.values[key], spec))
            if key == RANGE_KEY:
                cells.append(f"{_health_cell(row.low, spec)} / {_health_cell(row.high, spec)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _health_positive_from(series: dict[int, float]) -> int:
    """The first step from which the series stays above 0 to its end."""
    steps = sorted(series)
    start = steps[-1]
    for step in reversed(steps):
        if series[step] <= 0:
            break
        start = step
    return start


@figure("health-signals")
def health_signals() -> str:
    """docs/training.md Watching a run: how each health metric moved in the health grid."""
    cos = {n: health_series(n, "shadow_update_cosine") for n in health_grid_data().runs}
    rel_m = {n: health_series(n, "shadow_rel_err_m") for n in cos}
    rel_v = {n: health_series(n, "shadow_rel_err_v") for n in cos}
    bias = {n: health_series(n, "shadow_bias_v") for n in cos}
    stall_v = {n: health_series(n, "stall_v") for n in cos}
    under = {n: health_series(n, "underflow_m") for n in cos}
    sat = {n: health_series(n, "saturated_m") for n in cos}
    first, last = min(cos["fp4-nr"]), max(cos["fp4-nr"])
    loss = {n: _health_loss(n) for n in cos}
    block = run_config(HEALTH_GRID, "fp4-sr")["optim"]["block_size"]

    def two(x: float) -> str:
        return plain(x, 2)

    def four(x: float) -> str:
        return plain(x, 4)

    held = {n: _health_window(c, HEALTH_HELD_FROM) for n, c in cos.items()}
    if not (cos["fp8-nr"][last] > cos["fp4-sr"][last] and loss["fp8-nr"] > loss["fp4-sr"]):
        raise ValueError("FP8 NR's cosine no longer sits above FP4 SR's with a worse loss")
    if not (min(rel_m["fp8-sr"].values()) > min(rel_m["fp8-nr"].values())):
        raise ValueError("FP8 SR's rel_err m is no longer above FP8 NR's")
    if max(v for n in sat for v in sat[n].values()) >= 1 / block:
        raise ValueError("saturated/m reached 1/block_size")
    fp4, fp8 = ("fp4-nr", "fp4-sr"), ("fp8-nr", "fp8-sr")
    low = {n: min(bias[n], key=bias[n].get) for n in ("fp4-nr", "fp8-nr")}
    positive = {n: _health_positive_from(bias[n]) for n in ("fp4-nr", "fp8-nr")}
    climbed = _health_window(rel_m["fp4-nr"], after=HEALTH_CLIMB_AFTER)
    under_late = {n: _health_window(under[n], HEALTH_UNDERFLOW_FROM) for n in fp4}
    start = [under[n][first] for n in fp4]
    return "\n".join(
        [
            list_item(
                f"`shadow/update_cosine`: FP4 NR fell from {plain(cos['fp4-nr'][first])} at step "
                f"{first} to {dash_span(held['fp4-nr'], two)} from step {HEALTH_HELD_FROM} on, "
                f"where FP4 SR held {dash_span(held['fp4-sr'], two)} and FP8 SR "
                f"{dash_span(held['fp8-sr'])}. FP8 NR slid steadily from "
                f"{plain(cos['fp8-nr'][first])} at step {first} to {plain(cos['fp8-nr'][last])} "
                f"at step {last}. Compare a run with the SR value of its format and watch the "
                "trend: the level does not order runs of different formats (FP8 NR's "
                f"{plain(cos['fp8-nr'][last])} is above FP4 "
                f"SR's {plain(cos['fp4-sr'][last])}, yet its loss is "
                f"{plain(loss['fp8-nr'] - loss['fp4-sr'], 2)} worse). A cosine that keeps "
                "falling, or sits well below its format's SR value, means the stored states no "
                "longer carry the update the FP32 ones would apply."
            ),
            list_item(
                "`shadow/rel_err`: read the trend, not the level. Stochastic rounding adds "
                f"noise, so FP8 SR's rel_err m ({dash_span(rel_m['fp8-sr'].values(), two)} over "
                f"the run) is above FP8 NR's ({dash_span(rel_m['fp8-nr'].values(), two)}), but "
                "it stays flat. The unhealthy runs climb: FP4 NR's rel_err m from "
                f"{two(rel_m['fp4-nr'][first])} to {dash_span(climbed, two)} after step "
                f"{HEALTH_CLIMB_AFTER} (both its states drift: rel_err v "
                f"{two(rel_v['fp4-nr'][first])} → {two(rel_v['fp4-nr'][last])}), FP8 NR's "
                f"rel_err v from {two(rel_v['fp8-nr'][HEALTH_CLIMB_AFTER])} at step "
                f"{HEALTH_CLIMB_AFTER} to {two(rel_v['fp8-nr'][last])} while its m stays at "
                f"{dash_span(rel_m['fp8-nr'].values(), two)}. The state whose error climbs is "
                "the one to fix."
            ),
            list_item(
                "`shadow/bias/v` under NR: v stalls (stall v "
                f"{dash_span([stall_v['fp4-nr'][last], stall_v['fp8-nr'][last]])} at step "
                f"{last}) and lags its FP32 copy: below it early in the run (FP4 NR "
                f"{signed(bias['fp4-nr'][low['fp4-nr']])} at step {low['fp4-nr']}, FP8 NR "
                f"{signed(bias['fp8-nr'][low['fp8-nr']])} at step {low['fp8-nr']}), then "
                f"through 0 (above it from step {positive['fp4-nr']} on in FP4 NR, from "
                f"{positive['fp8-nr']} on in FP8 NR; {signed(bias['fp4-nr'][last])} and "
                f"{signed(bias['fp8-nr'][last])} at step "
                f"{last}). The sign at one step can mislead: a bias far from 0 for hundreds of "
                "steps, of either sign, is the signal. FP8 SR stays within "
                f"{signed(min(bias['fp8-sr'].values()))} / {signed(max(bias['fp8-sr'].values()))}"
                f". FP4 SR drifts slowly upward ({signed(bias['fp4-sr'][last])} at step {last}, "
                f"rel_err v {two(rel_v['fp4-sr'][first])} → {two(rel_v['fp4-sr'][last])}) with "
                f"no cost in loss at this horizon ({loss['fp4-sr']:.3f} against FP8 SR's "
                f"{loss['fp8-sr']:.3f}); over longer runs, watch it."
            ),
            list_item(
                "`underflow/m`: block-scaled FP4 m rounds about "
                f"{statistics.mean(start) * 100:.0f}% of its elements to 0 from the start "
                f"({dash_span(start)} at step {first}) with either rounding; NR raises that to "
                f"{dash_span(under_late['fp4-nr'], two)} from step {HEALTH_UNDERFLOW_FROM} on, "
                f"SR holds {dash_span(under_late['fp4-sr'], two)}. FP8 m: at most "
                f"{four(max(v for n in fp8 for v in under[n].values()))}."
            ),
            list_item(
                f"`saturated/m` stayed below 1/`optim.block_size` = {plain(1 / block)} in every "
                f"run (FP4 {dash_span(v for n in fp4 for v in sat[n].values())}, FP8 "
                f"{dash_span((v for n in fp8 for v in sat[n].values()), four)}) and did not "
                "separate them here."
            ),
        ]
    )


@figure("health-remedies")
def health_remedies() -> str:
    """docs/training.md Watching a run: what to do when a health metric drifts, with what
    stochastic rounding did in the health grid."""
    loss = {n: _health_loss(n) for n in health_grid_data().runs}
    rel_m = health_series("fp8-nr", "shadow_rel_err_m").values()
    fixed = ", ".join(
        f"{FORMAT_NAMES[f]} {loss[f'{f}-nr']:.3f} → {loss[f'{f}-sr']:.3f}" for f in ("fp4", "fp8")
    )
    return "\n".join(
        [
            "What to do when a number drifts:",
            "",
            list_item(
                "cosine falling, or rel_err of a state climbing steadily: round that state "
                "stochastically (`optim.m_rounding` / `optim.v_rounding: stochastic`; both "
                f"states in the `{HEALTH_GRID}` grid: {fixed}). Where m drifts, a wider format "
                f"for m is the other way out (FP8 NR's rel_err m stayed at "
                f"{dash_span(rel_m, lambda x: plain(x, 2))} where FP4 NR's climbed);"
            ),
            list_item(
                "bias v away from 0 for hundreds of steps: nearest rounding on v; use "
                "`optim.v_rounding: stochastic`;"
            ),
            list_item(
                "underflow m rising: m too small for its format; a format with more range for m "
                "(FP8 over FP4, BF16 over FP8);"
            ),
            list_item(
                "saturated well above 1/`optim.block_size` (FP8/FP4) or above 0 (BF16/FP32): "
                "moments outgrowing the format; check the learning rate and `optim.grad_clip`. "
                f"The `{HEALTH_GRID}` grid did not exercise it."
            ),
        ]
    )


def _health_schedule_text(grid: str, run: str) -> str:
    """``every 2000 steps with re-warmup`` / ``at the theory's periods``, from its config."""
    r = run_config(grid, run)["resets"]
    when = "at the theory's periods" if r["mode"] == "theory" else f"every {r['v_period']} steps"
    return when + (" with re-warmup" if r.get("rewarmup") else "")


@figure("shadow-resets")
def shadow_resets() -> str:
    """docs/training.md Watching a run: why resets do not trigger on the shadow's error (what
    resets cost on top of SR in the ablation and the 8000-step grid, what they did for NR)."""
    from experiments.study.bursts import twin_name

    ablation = runs("ablation")
    short = []  # every SR run of the ablation resetting both states, against SR alone
    for name, entry in ablation.items():
        twin = twin_name(name)
        if twin is None or "-sr" not in name or not entry["resets"]["m"]:
            continue
        first = min(entry["resets"]["v"])
        a, b = entry["val_loss"], ablation[twin]["val_loss"]
        short += [a[s] - b[s] for s in a if s in b and int(s) > first]
    long_costs = reset_costs()
    reached: dict[str, int] = {}
    for name, at, _ in long_costs:
        reached[name] = max(reached.get(name, 0), at)
    step = min(reached.values())  # the last validation step every reset run reached
    by_schedule: dict[str, list[tuple[str, float]]] = {}
    for name, at, cost in long_costs:
        if at == step:
            key = name.split("-sr-", 1)[1].removesuffix(_seed(name))
            by_schedule.setdefault(key, []).append((name, cost))
    cheapest = min(by_schedule.values(), key=lambda c: statistics.mean(d for _, d in c))
    grid_of = {n: g for g in ("resets", "resets-2") for n in runs(g)}
    name0 = cheapest[0][0]
    schedule = _health_schedule_text(grid_of[name0], name0)
    seeds = {_seed(n) for n, _ in cheapest}
    fmts = " and ".join(dict.fromkeys(FORMAT_NAMES[n.split("-")[0]] for n, _ in sorted(cheapest)))
    if not all(d > 0 for d in short) or not all(d > 0 for _, _, d in long_costs):
        raise ValueError("a reset schedule no longer costs loss against SR alone")
    nr = ablation["fp4-nr"]["final_val_loss"], ablation["fp4-nr-resets"]["final_val_loss"]
    sr = ablation["fp4-sr"]["final_val_loss"]
    if not sr < nr[1]:
        raise ValueError("FP4 SR no longer ends below FP4 NR with resets")
    steps = run_config("ablation", "fp4-nr")["train"]["steps"]
    return (
        "**Why no reset fires on shadow error.** An adaptive reset could trigger on a falling "
        "cosine or a climbing rel_err as well as on the stall fraction; the evidence says it "
        "would not pay. In stochastically rounded runs the shadow's error is rounding noise "
        "that returns the step after a reset, and resets cost loss on top of SR at every "
        f"horizon measured: {span(short)} over {steps} steps (the first study's SR runs that "
        "reset both states, against SR alone, at every validation step after the first "
        f"reset), and no schedule beat SR alone in the "
        f"{run_config('resets', 'fp32')['train']['steps']}-step study (the cheapest at step "
        f"{step}, {schedule}, cost {span(d for _, d in cheapest)} there in {fmts} over "
        f"{count_word(len(seeds))} seeds; "
        "[resets study](study.md#resets-over-8000-steps)). The runs whose error drifts are "
        f"nearest-rounding runs; there resets help (FP4 NR {nr[0]:.3f} → {nr[1]:.3f} at "
        f"{steps} steps) but SR fixes the cause and ends lower ({sr:.3f}; "
        "[ablation](study.md#ablation-precision-rounding-and-resets)), at the same cost. So "
        "the shadow tells you to change the rounding or the format, and "
        "`resets.mode=adaptive` keeps its one trigger, the stall fraction."
    )


def _stall_rows(cells: Sequence[Cell]) -> list[str]:
    rows = [
        "| grid | run | state | resets | steps | measured | block model | miss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        mark = " ✗" if abs(c.miss) > STALL_BAND else ""
        rows.append(
            f"| {c.grid} | {c.run} | {c.kind} | {c.resets} | {c.window[0]}–{c.window[1]} | "
            f"{c.measured:.3f} | {c.predicted:.3f} | {signed(c.miss)}{mark} |"
        )
    return rows


@figure("stall-held-out")
def stall_held_out() -> str:
    """docs/study.md: every held-out cell, measured against the block model."""
    from srtrain.theory import DEFAULT_SPREAD

    held = held_out_cells()
    misses = _misses(held)
    first = runs("lean")
    config = run_config("lean", next(iter(first)))
    return "\n".join(
        [
            f"Cells the fit of λ_m = {DEFAULT_SPREAD['m']:g} never saw: every run of the grids "
            f"{', '.join(f'`{g}`' for g in HELD_OUT)} ({model_text(config)}, sequence "
            f"{config['model']['seq_len']}, batch {config['train']['global_batch_size']}; "
            "recorded after λ_m was fitted), FP32 states left out. Measured: the dense "
            "weights' stalled fraction over the steps shown; block model: its prediction at "
            "each step's state age, averaged over the same steps (both from the grid's "
            f"`summary.json`). ✗: a miss over {STALL_BAND:g}. Within {STALL_BAND:g}: "
            f"{len(held) - len(misses)} of {len(held)}.",
            "",
            *_stall_rows(held),
        ]
    )


# ---------------------------------------------------------------------- study: losses


def val(entry: dict[str, Any], step: int) -> float | None:
    """A run's validation loss at ``step`` (None where it did not reach it)."""
    return (entry.get("val_loss") or {}).get(str(step))


def _final(grid_dir: str, name: str) -> float:
    return runs(grid_dir)[name]["final_val_loss"]


def _period_text(entry: dict[str, Any]) -> str:
    """``every 409`` where m and v reset together, else ``v every 223``."""
    resets = entry["resets"]
    period = resets["v"][0] if resets["v"] else None
    return f"every {period}" if resets["m"] == resets["v"] else f"v every {period}"


@figure("results-setup")
def results_setup() -> str:
    """README Results: what the first study trained, on what, when."""
    ablation, neox = run_config("ablation", "fp32"), run_config("neox", "bf16-sr")
    steps_a, steps_n = ablation["train"]["steps"], neox["train"]["steps"]
    return (
        f"{model_text(ablation)} for {steps_a} steps and {model_text(neox, 'short')} for "
        f"{steps_n} steps, on {ablation['data']['max_bytes'] / 1e6:.0f} MB of Python package "
        f"sources ({vocab_text(ablation['data']['vocab_size'])} BPE), sequence "
        f"{ablation['model']['seq_len']}, batch {ablation['train']['global_batch_size']}, "
        f"β₂ {ablation['optim']['beta2']:g}, one seed each; {len(summary('ablation')['gpus'])} "
        f"GPUs, {study_provenance('ablation')}."
    )


@figure("loss-ablation")
def loss_ablation() -> str:
    """README Results: final validation loss of the ablation grid."""
    r = runs("ablation")
    config = run_config("ablation", "fp32")
    steps = config["train"]["steps"]
    rows = [
        f"**Final validation loss** ({model_text(config, 'short')}, step {steps}, one "
        "seed: every run sees the same data and batches):",
        "",
        "| states | NR | SR | SR + resets (theory) |",
        "|---|---|---|---|",
        f"| FP32 | {_final('ablation', 'fp32'):.3f} | – | – |",
    ]
    for fmt in ("bf16", "fp8", "fp4"):
        reset = r[f"{fmt}-sr-resets"]
        rows.append(
            f"| {FORMAT_NAMES[fmt]} | {r[f'{fmt}-nr']['final_val_loss']:.3f} | "
            f"**{r[f'{fmt}-sr']['final_val_loss']:.3f}** | {reset['final_val_loss']:.3f} "
            f"({_period_text(reset)}) |"
        )
    ref = _final("ablation", "fp32")
    sr = {f: r[f"{f}-sr"]["final_val_loss"] - ref for f in ("bf16", "fp8", "fp4")}
    nr = {f: r[f"{f}-nr"]["final_val_loss"] - ref for f in ("bf16", "fp8", "fp4")}
    worst = max(nr, key=nr.get)
    rows += [
        "",
        f"Against FP32 states, stochastic rounding alone is {span(sr.values())} in every "
        f"format; nearest rounding is worst ({FORMAT_NAMES[worst]} {signed(nr[worst], 2)}).",
    ]
    return "\n".join(rows)


@figure("study-ablation")
def study_ablation() -> str:
    """docs/study.md Ablation: the ablation grid's final validation losses, every reset
    variant, and what they say (differences of final validation losses, one seed)."""
    r = runs("ablation")
    config = run_config("ablation", "fp32")
    train = config["train"]

    def loss(name: str) -> str:
        return f"{r[name]['final_val_loss']:.3f}"

    def reset(name: str) -> str:
        return f"{loss(name)} ({_period_text(r[name])})"

    fmts = ("bf16", "fp8", "fp4")

    def gap(name: str, base: str = "fp32") -> float:
        return r[name]["final_val_loss"] - r[base]["final_val_loss"]

    rows = [
        f"{MODEL_NAMES.get(config['model']['preset'], config['model']['preset'])}, "
        f"{train['steps']} steps, same data, seed and batches; final validation loss over "
        f"{train['val_batches']} fixed batches, one seed each:",
        "",
        "| states | NR | SR | NR + resets (theory) | SR + resets (theory) | SR + resets "
        "(published periods) |",
        "|---|---|---|---|---|---|",
        f"| FP32 | {loss('fp32')} | – | – | – | {reset('fp32-resets')} |",
    ]
    for f in fmts:
        rows.append(
            f"| {FORMAT_NAMES[f]} | {loss(f + '-nr')} | **{loss(f + '-sr')}** | "
            f"{reset(f + '-nr-resets')} | {reset(f + '-sr-resets')} | "
            f"{reset(f + '-sr-resets-sym')} |"
        )
    rows.append(
        "| BF16, v-only resets (`resets.v_resets_m=false`) | – | – | – | "
        f"{reset('bf16-sr-resets-vonly')} | – |"
    )
    nr = {f: gap(f"{f}-nr") for f in fmts}
    sr = {f: gap(f"{f}-sr") for f in fmts}
    on_sr = [gap(f"{f}-sr-resets{kind}", f"{f}-sr") for f in fmts for kind in ("", "-sym")]
    if min(on_sr) <= 0 or max(nr.values()) <= max(sr.values()):
        raise FigureError("study-ablation: the prose no longer matches the grid")
    periods = [
        int(_period_text(r[f"{f}-sr-resets{kind}"]).split()[-1])
        for f in ("fp8", "fp4")
        for kind in ("", "-sym")
    ]
    worst = sorted(nr, key=nr.get, reverse=True)
    fp4_nr, fp4_nr_resets = r["fp4-nr"]["final_val_loss"], r["fp4-nr-resets"]["final_val_loss"]
    rows += [
        "",
        list_item(
            f"**As expected:** nearest rounding is worst, badly so in {FORMAT_NAMES[worst[0]]} "
            f"({signed(nr[worst[0]], 2)}) and {FORMAT_NAMES[worst[1]]} "
            f"({signed(nr[worst[1]], 2)}). Resets of FP32 states do not help "
            f"({signed(gap('fp32-resets'))})."
        ),
        list_item(
            "**Not as expected:** stochastic rounding alone lands within "
            f"{max(abs(x) for x in sr.values()):.3f} of FP32 states in every format, and in "
            f"this {train['steps']}-step run resets cost loss on top of SR ({span(on_sr)} at "
            "the last step, every schedule above against SR alone of its format), so SR + "
            "resets is not the closest to FP32 here; SR alone is."
        ),
        list_item(
            "**Why resets cost loss here:** a reset restarts Adam's bias correction, so the "
            "first updates after it are close to ±lr for every element (m̂/√v̂ = g/|g|). That "
            "is a burst of large steps, visible as a bump in the training loss after each reset "
            f"(figure). Over {train['steps']} steps the staleness a reset removes is worth less "
            "than the burst, and frequent resets (FP8/FP4 periods of "
            f"{min(periods)}–{max(periods)} steps) cost the most."
        ),
        list_item(
            "**Where resets do help:** where nearest rounding has frozen the states. FP4 NR "
            f"goes from {fp4_nr:.3f} to {fp4_nr_resets:.3f} with resets."
        ),
    ]
    return "\n".join(rows)


LATE_FROM = 3000  # the 8000-step ranges: from this validation step on, and before it
SR_RUNS = {"BF16": "bf16-sr", "FP8": "fp8-sr", "FP4": "fp4-sr"}


LONG_GRIDS = ("resets", "resets-2")  # the 8000-step grid's two recorded pieces


def _long_runs() -> dict[str, dict[str, Any]]:
    """The 8000-step grid's runs from both of its recorded pieces (the further one wins)."""
    merged: dict[str, dict[str, Any]] = {}
    for grid in LONG_GRIDS:
        for name, entry in runs(grid).items():
            old = merged.get(name)
            if old is None or entry["steps_reached"] > old["steps_reached"]:
                merged[name] = entry
    return merged


def _seed(name: str) -> str:
    match = re.search(r"-seed\d+$", name)
    return match.group(0) if match else ""


def _against(entries: dict[str, dict[str, Any]], name: str, base: str) -> dict[int, float]:
    """Validation loss of ``name`` minus that of ``base`` (same seed), per common step."""
    a, b = entries[name]["val_loss"], entries[base + _seed(name)]["val_loss"]
    return {int(s): a[s] - b[s] for s in a if s in b}


def sr_against_fp32() -> dict[str, dict[str, dict[int, float]]]:
    """Per format, per seed suffix: SR alone minus FP32 states at each validation step."""
    entries = _long_runs()
    out: dict[str, dict[str, dict[int, float]]] = {}
    for fmt, base in SR_RUNS.items():
        for name in entries:
            if name == base or (name.startswith(base + "-seed")):
                out.setdefault(fmt, {})[_seed(name)] = _against(entries, name, "fp32")
    return out


def _steps_reached(entries: dict[str, dict[str, Any]], seed: str) -> list[int]:
    return [
        max(map(int, e["val_loss"]))
        for n, e in entries.items()
        if _seed(n) == seed and e["reset_mode"] == "none"
    ]


def _seed_spread(values: Sequence[float], digits: int = 3, sign: bool = True) -> str:
    """``+0.010 ± 0.003``: the mean over seeds ± half their range (``sign=False``: the mean
    without its sign, for a loss rather than a difference)."""
    mean = sum(values) / len(values)
    text = signed(mean, digits) if sign else plain(mean, digits)
    return f"{text} ± {(max(values) - min(values)) / 2:.{digits}f}"


@figure("sr-vs-fp32-8000")
def sr_vs_fp32_8000() -> str:
    """README Results and docs/study.md: SR alone against FP32 states over 8000 steps."""
    entries = _long_runs()
    config = run_config("resets", "fp32")
    deltas = sr_against_fp32()
    seeds = sorted({s for per in deltas.values() for s in per})
    reach = {s: _steps_reached(entries, s) for s in seeds}
    seed_text = " and ".join(
        f"{dash_span(reach[s], lambda x: f'{x:.0f}')} (seed {s[5:] or 0})" for s in seeds
    )
    tokens = config["train"]["steps"] * config["train"]["global_batch_size"]
    tokens *= config["model"]["seq_len"]

    def points(fmts: Sequence[str], late: bool) -> list[float]:
        return [
            d
            for f in fmts
            for per in deltas[f].values()
            for step, d in per.items()
            if (step >= LATE_FROM) == late
        ]

    early_steps = sorted({s for per in deltas["FP8"].values() for s in per if s < LATE_FROM})
    common = max(set.intersection(*(set(per) for per in deltas["FP8"].values())))
    spread = ", ".join(
        f"{f} {_seed_spread([per[common] for per in deltas[f].values()])}" for f in SR_RUNS
    )
    fp4_0 = deltas["FP4"][""]
    last = max(fp4_0)
    return (
        f"Over {config['train']['steps']} steps ({model_text(config, 'comma')}; "
        f"{tokens / 1e6:.1f}M tokens of another corpus; validation to step {seed_text}; "
        f"{study_provenance('resets')}), SR alone against FP32 states of the same seed, at "
        f"every validation step from {LATE_FROM} on: BF16 and FP8 "
        f"{span(points(['BF16', 'FP8'], True))}, FP4 {span(points(['FP4'], True))}. At steps "
        f"{' and '.join(map(str, early_steps))}: BF16 and FP8 "
        f"{span(points(['BF16', 'FP8'], False))}, FP4 {span(points(['FP4'], False))}. "
        f"{count_word(len(seeds)).capitalize()} seeds at step {common} (mean ± half the range): "
        f"{spread}. The FP4 gap "
        f"{'does not grow' if fp4_0[last] <= fp4_0[common] else 'grows'} (seed 0: "
        f"{signed(fp4_0[common])} at step {common}, "
        f"{signed(fp4_0[last])} at step {last})."
    )


def reset_costs() -> list[tuple[str, int, float]]:
    """Every SR reset run of the 8000-step grid against its SR twin without resets (same
    seed), at each validation step after its first reset: (run, step, difference)."""
    from experiments.study.bursts import twin_name

    entries = _long_runs()
    out = []
    for name, entry in entries.items():
        twin = twin_name(name)
        if twin is None or "-sr" not in name or twin not in entries:
            continue
        first = min(entry["resets"]["v"] or [0])
        a, b = entry["val_loss"], entries[twin]["val_loss"]
        out += [(name, int(s), a[s] - b[s]) for s in a if s in b and int(s) > first]
    return out


@figure("resets-8000")
def resets_8000() -> str:
    """README Results and docs/study.md: what every reset schedule costs against SR alone."""
    entries = _long_runs()
    costs = reset_costs()
    by = {(name, step): d for name, step, d in costs}
    step = 5000
    two = [by[(n, 4000)] for n in entries if n.startswith("fp8-sr-resets-2000-rewarm")]
    theory = by[("fp8-sr-resets", step)]
    rewarm = by[("fp8-sr-resets-rewarm", step)]
    ablation = runs("ablation")
    froze = ablation["fp4-nr"]["final_val_loss"], ablation["fp4-nr-resets"]["final_val_loss"]
    verdict = (
        "Every reset schedule costs loss against SR alone of the same seed"
        if all(d > 0 for _, _, d in costs)
        else "Not every reset schedule costs loss against SR alone of the same seed"
    )
    return (
        f"{verdict}, at every validation step after its first reset "
        f"({span(d for _, _, d in costs)}). FP8 at step {step}, seed 0: {signed(theory)} at the "
        f"theory's periods, {signed(rewarm)} with the default re-warmup; every 2000 steps with "
        f"re-warmup, {count_word(len(two))} seeds at step 4000: {_seed_spread(two)}. The "
        "recipes therefore train without resets. Resets help where nearest rounding froze the "
        f"states (FP4 NR at step {run_config('ablation', 'fp4-nr')['train']['steps']} of the "
        f"first study: {froze[0]:.3f} → {froze[1]:.3f})."
    )


@figure("rewarmup-cost")
def rewarmup_cost() -> str:
    """docs/study.md: what re-warmup does to the cost of theory-period resets."""
    by = {(name, step): d for name, step, d in reset_costs()}
    entries = _long_runs()
    parts = []
    for fmt in ("fp8", "fp4"):
        plain_, warm = f"{fmt}-sr-resets", f"{fmt}-sr-resets-rewarm"
        step = min(max(map(int, entries[n]["val_loss"])) for n in (plain_, warm))
        parts.append(
            f"{signed(by[(plain_, step)])} to {signed(by[(warm, step)])} in "
            f"{FORMAT_NAMES[fmt]} (step {step})"
        )
    return (
        "Against SR alone of the same seed, re-warmup takes what resets at the theory's "
        f"periods cost from {' and from '.join(parts)}."
    )


@cache
def long_grid() -> Any:
    """The 8000-step grid with every run's config and per-step records, from both recorded
    pieces, read as the study report reads them (the run that got further wins)."""
    from experiments.study.report import load_study

    return load_study([STUDY / grid for grid in LONG_GRIDS]).grids["resets"]


@cache
def long_bursts() -> dict[str, Any]:
    """The reset burst of every reset run of the 8000-step grid by run name, as the study
    report's burst table computes it (:mod:`experiments.study.bursts`)."""
    from experiments.study.bursts import reset_bursts

    return {burst.name: burst for burst in reset_bursts(long_grid())}


MODE_ORDER = {"none": 0, "theory": 1, "periodic": 2}


def _long_order(name: str) -> tuple[int, int, int, int]:
    """Rows of the 8000-step tables: FP32, BF16, FP8, FP4; in each, no resets, the theory's
    periods, fixed periods; without re-warmup first."""
    config = long_grid().runs[name].config
    r = config["resets"]
    return (
        FORMAT_ORDER.get(config["optim"]["m_format"], -1),
        MODE_ORDER[r["mode"]],
        int(r.get("rewarmup") or 0),
        int(r.get("v_period") or 0),
    )


def _states_label(config: dict[str, Any]) -> str:
    """``FP32`` / ``FP8 SR``."""
    o = config["optim"]
    name = FORMAT_NAMES[o["m_format"]]
    return name if o["m_format"] == "fp32" else f"{name} {ROUNDING_NAMES[o['m_rounding']]}"


def _resets_label(name: str) -> str:
    """``none`` / ``theory (v every 239)`` / ``every 2000, re-warmup 20``: the schedule a run
    of the 8000-step grid reset its states by (periods as the run recorded them)."""
    from experiments.study.bursts import period_of

    run = long_grid().runs[name]
    r = run.config["resets"]
    if r["mode"] == "none":
        return "none"
    period = period_of(run.entry["resets"]["v"])
    text = f"theory (v every {period})" if r["mode"] == "theory" else f"every {period}"
    return text + (f", re-warmup {r['rewarmup']}" if r.get("rewarmup") else "")


def _last_val(entry: dict[str, Any]) -> int:
    return max(map(int, entry["val_loss"]))


@figure("resets-8000-seed0")
def resets_8000_seed0() -> str:
    """docs/study.md: validation loss of every seed-0 run of the 8000-step grid against FP32
    states of seed 0, at every validation step from the last one that all of them reached."""
    entries = {n: e for n, e in _long_runs().items() if not _seed(n)}
    names = sorted(entries, key=_long_order)
    common = min(_last_val(e) for e in entries.values())
    steps = sorted({int(s) for e in entries.values() for s in e["val_loss"] if int(s) >= common})
    rows = [
        "Validation loss against FP32 states of the same seed at the same step (seed 0, one "
        f"run each; FP32 itself: its loss; from step {common}, the last validation step every "
        "run reached; a blank: not reached):",
        "",
        "| states | resets | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for name in names:
        if name == "fp32":
            cells = [plain(val(entries[name], s), 4) for s in steps]
        else:
            deltas = _against(entries, name, "fp32")
            cells = [signed(deltas[s], 4) if s in deltas else "" for s in steps]
        config = long_grid().runs[name].config
        rows.append(
            f"| {_states_label(config)} | {_resets_label(name)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


def _seed_groups() -> dict[str, list[str]]:
    """Runs of the 8000-step grid recorded with more than one seed: base name → its runs."""
    groups: dict[str, list[str]] = {}
    for name in _long_runs():
        groups.setdefault(name.removesuffix(_seed(name)), []).append(name)
    return {base: names for base, names in groups.items() if len(names) > 1}


@figure("resets-8000-seeds")
def resets_8000_seeds() -> str:
    """docs/study.md: the 8000-step runs recorded with two seeds, at every validation step
    from :data:`LATE_FROM` that every one of them reached: mean ± half the range over seeds
    of the difference to FP32 states of the same seed (FP32: its loss)."""
    entries = _long_runs()
    groups = _seed_groups()
    members = [n for names in groups.values() for n in names]
    seeds = {_seed(n) for n in members}
    common = min(_last_val(entries[n]) for n in members)
    steps = sorted(
        {int(s) for n in members for s in entries[n]["val_loss"] if LATE_FROM <= int(s) <= common}
    )
    rows = [
        f"{count_word(len(seeds)).capitalize()} seeds, steps {' and '.join(map(str, steps))} "
        f"(step {common}: the last validation step every run of every seed reached): mean ± "
        "half the range over the seeds of the difference to FP32 states of the same seed "
        "(FP32 itself: its loss):",
        "",
        "| states | resets | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for base in sorted(groups, key=_long_order):
        cells = []
        for step in steps:
            if base == "fp32":
                losses = [val(entries[n], step) for n in groups[base]]
                cells.append(_seed_spread(losses, 4, sign=False))
            else:
                deltas = [_against(entries, n, "fp32")[step] for n in groups[base]]
                cells.append(_seed_spread(deltas, 4))
        config = long_grid().runs[base].config
        rows.append(
            f"| {_states_label(config)} | {_resets_label(base)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


BURST_RUNS = ("fp4-sr-resets", "fp8-sr-resets")  # theory's periods, no re-warmup, seed 0
REWARM_RUNS = ("fp4-sr-resets-rewarm", "fp8-sr-resets-rewarm")  # the same with re-warmup
RECOVERED = 0.01  # a loss gap within this of its pre-reset value has come back
RECOVERY_WINDOW = 10  # steps a loss gap is averaged over to tell it has come back
DRIFT = (30, 150)  # steps since a reset over which re-warmup's remaining cost is averaged


def recovery_step(burst: Any) -> int | None:
    """The first ``k`` (steps since a reset) from which the loss gap to the twin, averaged
    over :data:`RECOVERY_WINDOW` steps (``k .. k + 9``, each the mean over the resets), stays
    within :data:`RECOVERED` of its mean over the 20 steps before a reset to the end of the
    period; looked for after the gap's peak (11–30 steps). None: it does not come back."""
    from experiments.study.bursts import GAP_PEAK

    found = None
    for k in range(burst.period - RECOVERY_WINDOW + 1, GAP_PEAK[1] - 1, -1):
        if burst.gap_mean(k, k + RECOVERY_WINDOW - 1) > burst.gap_before + RECOVERED:
            break
        found = k
    return found


def _twin_window(burst: Any) -> str:
    """``mean over its log steps 230–4990``: where a twin's steady update RMS is taken (its
    log steps after the reset run's first reset, up to the step that run reached)."""
    entry = long_grid().runs[burst.name].entry
    twin = long_grid().runs[burst.twin]
    steps = [
        r["step"]
        for r in twin.logged
        if burst.resets[0] < r["step"] <= entry["steps_reached"] and "update_rms" in r
    ]
    return f"mean over its log steps {steps[0]}–{steps[-1]}"


@figure("reset-burst")
def reset_burst() -> str:
    """docs/study.md: the burst a reset of v causes, without re-warmup, at the theory's
    periods (seed 0, one run each): update RMS (``update_rms``: the RMS of the applied update
    over lr on every :data:`~srtrain.optim.update_size.SAMPLE_EVERY`-th row) 1, 10 and 50
    steps after a reset, against the twin's steady value; the train-loss gap to the twin
    before a reset, at its peak and how long it takes to come back (:func:`recovery_step`).
    Every number is a mean over the run's resets, as in the study report's burst table."""
    from experiments.study.bursts import GAP_BEFORE, GAP_PEAK
    from srtrain.optim.update_size import SAMPLE_EVERY

    bursts = long_bursts()
    fp4, fp8 = (bursts[n] for n in BURST_RUNS)
    back = {b.name: recovery_step(b) for b in (fp4, fp8)}

    def back_text(b: Any) -> str:
        k = back[b.name]
        return "not within the period" if k is None else f"only from step {k} after it on"

    def recovering(b: Any) -> str:
        k = back[b.name]
        return "most of its time" if k is None or k > b.period / 2 else "under half its time"

    peak = f"{GAP_PEAK[0]}–{GAP_PEAK[1]}"
    bf16 = [
        n
        for n, run in long_grid().runs.items()
        if n in bursts and n.startswith("bf16") and not run.config["resets"].get("rewarmup")
    ]
    bf16_text = (
        ""
        if bf16
        else " BF16 without re-warmup was not run over 8000 steps, so its burst is not recorded."
    )
    return (
        f"**The mechanism, measured.** `update_rms` (the applied update over lr, RMS over every "
        f"{SAMPLE_EVERY}th row) is {plain(fp4.twin_rms)} in steady training (FP4 states "
        f"without resets, seed 0, {_twin_window(fp4)}). In the FP4 run with resets at the "
        f"theory's period ({fp4.period} steps; seed 0, one run, means over its "
        f"{len(fp4.resets)} resets), the first update after a reset moves it to "
        f"{plain(fp4.rms_at(1), 2)} (m̂/√v̂ = ±1 for every element), the tenth to "
        f"{plain(fp4.rms_at(10), 2)} and the fiftieth to {plain(fp4.rms_at(50), 2)}: a burst "
        f"of {fp4.rms_at(1) / fp4.twin_rms:.1f}× the usual update. The training loss, already "
        f"{plain(fp4.gap_before)} above the run without resets over the {GAP_BEFORE} steps "
        f"before a reset, climbs to {plain(fp4.gap_peak)} above it {peak} steps after and is "
        f"back within {RECOVERED:g} of its pre-reset gap (means over {RECOVERY_WINDOW} steps) "
        f"{back_text(fp4)}, so with a period of {fp4.period} steps the run spends "
        f"{recovering(fp4)} recovering. FP8 (one run, period {fp8.period}) follows the same "
        f"curve: {plain(fp8.rms_at(1), 2)}, "
        f"{plain(fp8.rms_at(10), 2)} and {plain(fp8.rms_at(50), 2)} against a steady "
        f"{plain(fp8.twin_rms)} ({fp8.rms_at(1) / fp8.twin_rms:.1f}×), a loss gap of "
        f"{plain(fp8.gap_before)} before a reset and {plain(fp8.gap_peak)} at {peak} steps "
        f"after, back within {RECOVERED:g} {back_text(fp8)}.{bf16_text}"
    )


@figure("rewarmup-burst")
def rewarmup_burst() -> str:
    """docs/study.md: what re-warmup does to the burst (the runs of :func:`reset_burst` with
    ``resets.rewarmup``; seed 0, one run each, means over the resets): the first update,
    the first step whose update reaches the twin's steady size and the largest over the 50
    steps recorded every step; the loss gap over the 10 steps after a reset against the 20
    before; and over :data:`DRIFT` steps since a reset, the mean loss gap above the
    pre-reset one and the mean update RMS (at log steps) over the twin's steady value."""
    from experiments.study.bursts import GAP_BEFORE, WATCH_STEPS, rms_after_reset

    bursts = long_bursts()
    parts = []
    for name in REWARM_RUNS:
        b = bursts[name]
        reached = next(k for k in range(1, WATCH_STEPS + 1) if b.rms_at(k) >= b.twin_rms)
        top = max(range(1, WATCH_STEPS + 1), key=b.rms_at)
        rms = rms_after_reset(long_grid().runs[name], range(DRIFT[0], DRIFT[1] + 1))
        parts.append(
            {
                "burst": b,
                "fmt": FORMAT_NAMES[long_grid().runs[name].config["optim"]["m_format"]],
                "warmup": long_grid().runs[name].config["resets"]["rewarmup"],
                "reached": reached,
                "top": top,
                "drift": b.gap_mean(*DRIFT) - b.gap_before,
                "over": sum(rms.values()) / len(rms) / b.twin_rms - 1,
            }
        )
    fp4, fp8 = parts
    b = fp4["burst"]
    return (
        f"**Re-warmup removes the burst, not the whole cost.** With `resets.rewarmup="
        f"{fp4['warmup']}` ({fp4['fmt']}, seed 0, one run, means over its {len(b.resets)} "
        f"resets) the first update is {plain(b.rms_at(1))} and first reaches the steady size "
        f"({plain(b.twin_rms)}) {fp4['reached']} steps after a reset and peaks "
        f"{b.rms_at(fp4['top']) / b.twin_rms - 1:.0%} above it {fp4['top']} steps after; the "
        f"loss no longer jumps ({signed(b.gap_mean(1, 10))} over the 10 steps after a reset "
        "against "
        f"{signed(b.gap_before)} over the {GAP_BEFORE} before it), but {DRIFT[0]}–{DRIFT[1]} "
        f"steps later it runs {plain(fp4['drift'])} above its pre-reset gap ({fp8['fmt']}, one "
        f"run: {plain(fp8['drift'])}), while the young v̂ (an average of few g² samples) "
        f"lets the update run {fp4['over']:.0%} ({fp8['fmt']}: {fp8['over']:.0%}) above its "
        "steady size and the states' history is gone."
    )


@figure("resets-2000")
def resets_2000() -> str:
    """docs/study.md: resets every 2000 steps with re-warmup against SR alone of the same
    seed, two seeds (mean ± half the range), at the last validation step both seeds
    reached and at the steps from :data:`LATE_FROM` before it. The resets a run loses its
    states' history to are those after a step before its last (the schedule's steps below
    ``train.steps``), counted for the whole run from its config."""
    from experiments.study.summary import scheduled_resets

    entries = _long_runs()
    costs = reset_costs()
    fmts = ("fp8", "fp4")
    runs_of = {f: [n for n in entries if n.startswith(f"{f}-sr-resets-2000-rewarm")] for f in fmts}
    names = [n for f in fmts for n in runs_of[f]]
    common = min(_last_val(entries[n]) for n in names)
    by = {(name, step): d for name, step, d in costs}
    earlier = sorted({s for n, s, _ in costs if n in names and LATE_FROM <= s < common})

    def lost(name: str) -> int:
        config = long_grid().runs[name].config
        total = config["train"]["steps"]
        return len([s for s in scheduled_resets(config, total)["v"] if s < total])

    theory = [lost(n) for n in entries if entries[n]["reset_mode"] == "theory"]
    config = long_grid().runs[names[0]].config
    first = min(entries[names[0]]["resets"]["v"])
    seeds = {_seed(n) for n in names}
    cost = " and ".join(
        f"{_seed_spread([by[(n, common)] for n in runs_of[f]], 4)} ({FORMAT_NAMES[f]})"
        for f in fmts
    )
    at_earlier = "; ".join(
        f"{span(by[(n, s)] for n in names)} at step {s}, {s - first} steps after it"
        for s in earlier
    )
    return (
        f"**Longer periods cost less and still do not pay.** Resets every "
        f"{config['resets']['v_period']} steps with re-warmup (the states' history lost "
        f"{count_word(lost(names[0]))} times in {config['train']['steps']} steps instead of "
        f"{dash_span(theory, str)} at the theory's periods) cost {cost} against SR alone of "
        f"the same seed at step {common}, {count_word(len(seeds))} seeds (mean ± half the "
        f"range), {common - first} steps after their first reset at step {first} "
        f"({at_earlier})."
    )


FP32_RESETS = "fp32-resets-rewarm"  # the 8000-step grid's resets of FP32 states


@figure("fp32-resets-8000")
def fp32_resets_8000() -> str:
    """docs/study.md: resets of FP32 states with re-warmup against none (seed 0, one run),
    at every validation step it reached."""
    from experiments.study.bursts import period_of

    entries = _long_runs()
    deltas = _against(entries, FP32_RESETS, "fp32")
    last = max(deltas)
    return (
        "Resets of FP32 states with re-warmup (every "
        f"{period_of(entries[FP32_RESETS]['resets']['v'])} steps; seed 0, one run) are "
        f"{span(deltas.values())} against none at every validation step "
        f"({signed(deltas[last])} at step {last}, the last it reached)."
    )


@figure("bf16-weights")
def bf16_weights() -> str:
    """README Results: BF16 weights without a master copy (lean grid) and frozen weights."""
    r = runs("lean")
    config = run_config("lean", "fp32")
    cost = {
        f: r[f"{f}-sr-bf16w"]["final_val_loss"] - r[f"{f}-sr"]["final_val_loss"]
        for f in ("fp8", "fp4")
    }
    frozen = result("docs/results/data/frozen/frozen.json")
    return (
        "BF16 weights without an FP32 master copy, rounded stochastically, change the final "
        "validation loss by "
        + " and ".join(f"{signed(d)} ({FORMAT_NAMES[f]} states)" for f, d in cost.items())
        + f" against FP32 master weights ({model_text(config)}, "
        f"{config['train']['steps']} steps, one seed, {study_provenance('lean')}); with "
        "nearest rounding, half the weights at |w| = "
        f"{frozen['threshold']['measured_over_lr']:.0f}·lr stop changing."
    )


@figure("lean-table")
def lean_table() -> str:
    """docs/study.md BF16 weights: the lean grid's final validation losses with FP32 master
    weights and with BF16 weights, and what FP4 states cost here against the ablation."""
    r = runs("lean")
    ablation = runs("ablation")

    def val(name: str) -> float:
        return r[name]["final_val_loss"]

    ref = val("fp32")
    cost = {f: val(f"{f}-sr-bf16w") - val(f"{f}-sr") for f in ("fp8", "fp4")}
    weights_gaps = [*cost.values(), val("bf16-sr-bf16w") - ref]
    fp4_here = val("fp4-sr") - ref
    fp4_ablation = ablation["fp4-sr"]["final_val_loss"] - ablation["fp32"]["final_val_loss"]
    bound = 0.01
    if max(abs(x) for x in weights_gaps) >= bound or fp4_here <= max(map(abs, weights_gaps)):
        raise FigureError("lean-table: the prose no longer matches the grid")
    rows = [
        "| states | FP32 master weights: val loss | BF16 weights (SR): val loss | BF16 weights "
        "cost |",
        "|---|---|---|---|",
        f"| FP32 (reference) | {ref:.4f} | | |",
        f"| BF16 SR | | {val('bf16-sr-bf16w'):.4f} ({signed(val('bf16-sr-bf16w') - ref, 4)} vs "
        "FP32) | |",
    ]
    for f in ("fp8", "fp4"):
        rows.append(
            f"| {FORMAT_NAMES[f]} SR | {val(f + '-sr'):.4f} | {val(f + '-sr-bf16w'):.4f} | "
            f"{signed(cost[f], 4)} |"
        )
    rows += [
        "",
        f"At this horizon BF16 weights with stochastic rounding cost under {bound:g} against an "
        "FP32 master copy at the same state format (one seed each; the spread between seeds is "
        f"not measured: read differences under ~{bound:g} as noise). What costs loss here is "
        f"FP4 *states* ({signed(fp4_here, 2)} on this corpus against {signed(fp4_ablation)} on "
        "the 32k-vocabulary ablation above), not BF16 weights.",
    ]
    return "\n".join(rows)


@figure("loss-summary")
def loss_summary() -> str:
    """README What it does: SR against FP32 states over every recorded grid."""
    bf16_fp8, fp4 = [], []
    for grid, name_of in (("ablation", "{}-sr"), ("lean", "{}-sr")):
        ref = runs(grid)["fp32"]["final_val_loss"]
        for fmt in ("bf16", "fp8", "fp4"):
            entry = runs(grid).get(name_of.format(fmt))
            if entry is not None:
                (fp4 if fmt == "fp4" else bf16_fp8).append(entry["final_val_loss"] - ref)
    deltas = sr_against_fp32()
    for fmt, per in deltas.items():
        for values in per.values():
            late = [d for step, d in values.items() if step >= 2000]
            (fp4 if fmt == "FP4" else bf16_fp8).extend(late)
    return (
        "Why: Adam's states are half the memory of FP32 training (8 of 16 bytes a parameter). "
        "With FP4 states, BF16 weights and the step inside backward one "
        f"{_capacity_device().removeprefix('NVIDIA ')} "
        f"trains a {_capacity_largest('fp4-bf16w-inbwd')} "
        f"model where torch's AdamW trains {_capacity_largest('torch')} "
        "([Capacity](#capacity)), and stochastic rounding keeps the validation loss within "
        f"{_ceil(max(map(abs, bf16_fp8)))} of FP32 states in BF16 and FP8 and within "
        f"{_ceil(max(map(abs, fp4)))} in FP4, from step 2000 on in every recorded run "
        "([Results](#results))."
    )


def _ceil(value: float, step: float = 0.01) -> str:
    """The value rounded up to a multiple of ``step``: ``0.02``."""
    import math

    return f"{math.ceil(value / step - 1e-9) * step:.2f}"


# --------------------------------------------------------------------------- capacity

VARIANT_NAMES = {
    "torch": "torch AdamW (FP32 weights and states)",
    "fp8": "SRAdamW FP8 states, FP32 weights",
    "fp8-bf16w": "SRAdamW FP8 states, BF16 weights",
    "fp4-bf16w": "SRAdamW FP4 states, BF16 weights",
    "fp4-bf16w-inbwd": "SRAdamW FP4 states, BF16 weights, step inside backward",
}
# README's claims for the planner, in percent of a measured peak (tests/test_plan_capacity.py
# holds every recorded trial to them, and the figure refuses to render a claim that fails):
# per search, the planner's total over the allocated peak and against the reserved peak
PLANNER_BANDS = {
    "ladder": {"allocated": (0.0, 5.0), "reserved": (-2.5, 2.5)},
    "throughput": {"allocated": (0.0, 55.0), "reserved": (-3.0, 10.0)},
}
SEARCH_TEXT = {
    "ladder": "on the ladder's trials (micro-batch 1, activation checkpointing)",
    "throughput": "on the 7B throughput trials (micro-batches 2–16)",
}


@figure("init-time")
def init_time() -> str:
    """docs/training.md: how long the sharded init takes on one GPU and the memory it leaves
    beyond the weights, from every capacity trial's record."""
    by_size: dict[int, list[float]] = {}
    above, envs = [], []
    for path in CAPACITY_FILES:
        data = result(path)
        envs.append(data["environment"])
        for row in data["rows"]:
            if "init_s" not in row:
                continue
            weight_bytes = 2 if "bf16w" in row["variant"] else 4
            by_size.setdefault(row["params"], []).append(row["init_s"])
            above.append(row["init_allocated_gib"] - row["params"] * weight_bytes / 2**30)
    device = {env["device"] for env in envs}
    if len(device) != 1:
        raise ValueError(f"capacity records from several devices: {sorted(device)}")
    dates = sorted({short_date(env["date"]) for env in envs})
    commits = sorted({env["commit"] for env in envs})
    sizes = ", ".join(
        f"{params / 1e9:.1f}B {dash_span(times, lambda t: f'{t:.2f}')} s"
        + (f" ({len(times)} trials)" if len(times) > 1 else "")
        for params, times in sorted(by_size.items())
    )
    rates = [t / (params / 1e9) for params, times in by_size.items() for t in times]
    count = sum(len(times) for times in by_size.values())
    return wrap(
        f"Initialising a whole model on one {device.pop()} ({count} trials of the capacity "
        f"ladder, FP32 and BF16 weights; {', '.join(dates)}, commits "
        f"{', '.join(f'`{c}`' for c in commits)}; `benchmarks/results/*-h200-capacity-*.json`): "
        f"{sizes}, that is {min(rates):.2f}–{max(rates):.2f} s per billion parameters. After "
        f"init the memory allocated is at most {max(above):.2f} GiB above the weights' own "
        "bytes."
    )


def capacity_rows() -> list[dict[str, Any]]:
    """Every recorded capacity trial, with ``planned_gib``: the planner of this tree
    (``srtrain.plan.plan_run``) for the trial's config."""
    from srtrain.bench.capacity import predicted_bytes
    from srtrain.bench.capacity_trial import TrialSpec
    from srtrain.plan import GIB

    out = []
    for path in CAPACITY_FILES:
        data = result(path)
        shapes = data["settings"]["shapes"]
        for row in data["rows"]:
            spec = TrialSpec.from_row(row, shapes)
            out.append({**row, "file": path, "planned_gib": predicted_bytes(spec) / GIB})
    return out


def planner_error(row: dict[str, Any], column: str) -> float:
    """The planner's total over a measured peak (``allocated`` or ``reserved``), in percent."""
    return 100.0 * (row["planned_gib"] / row[f"peak_{column}_gib"] - 1.0)


def _capacity_largest(variant: str) -> str:
    summaries = {v: e for path in LADDER_FILES for v, e in result(path)["summary"].items()}
    return summaries[variant]["largest"].upper()


def _capacity_device() -> str:
    return "/".join(sorted({result(p)["environment"]["device"] for p in CAPACITY_FILES}))


def _capacity_env() -> str:
    envs = [result(p)["environment"] for p in CAPACITY_FILES]
    commits = sorted({e.get("commit", "unknown") for e in envs})
    dates = sorted({short_date(e["date"]) for e in envs})
    versions = sorted({f"torch {e['torch']}, Triton {e['triton']}" for e in envs})
    return (
        f"{', '.join(dates)}, commit {', '.join(f'`{c}`' for c in commits)}, {'; '.join(versions)}"
    )


def _pct(lo: float, hi: float) -> str:
    return f"{signed(lo, 1)}% to {signed(hi, 1)}%"


def planner_ranges() -> dict[str, dict[str, tuple[float, float]]]:
    """Per search and measured column: the lowest and highest planner error (percent) over
    the trials that trained."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for search in PLANNER_BANDS:
        sel = [r for r in capacity_rows() if r["fit"] and r["search"] == search]
        out[search] = {}
        for column in ("allocated", "reserved"):
            errors = [planner_error(r, column) for r in sel]
            out[search][column] = (min(errors), max(errors))
    return out


def _band(lo: float, hi: float) -> str:
    if lo == 0.0:
        return f"at most {hi:g}% above"
    if -lo == hi:
        return f"within {hi:g}% of"
    return f"between {plain(lo, 0) if lo == int(lo) else plain(lo, 1)}% and +{hi:g}% of"


def planner_claim() -> str:
    """The planner's error on the recorded trials, against the bands README claims."""
    parts = []
    for search, ranges in planner_ranges().items():
        for column, (lo, hi) in ranges.items():
            band = PLANNER_BANDS[search][column]
            if not band[0] <= lo <= hi <= band[1]:
                raise FigureError(
                    f"planner {search} trials: {lo:+.1f}% to {hi:+.1f}% of the {column} peak, "
                    f"outside the claimed band {band}"
                )
        (a_lo, a_hi), (r_lo, r_hi) = ranges["allocated"], ranges["reserved"]
        a_band, r_band = PLANNER_BANDS[search]["allocated"], PLANNER_BANDS[search]["reserved"]
        parts.append(
            f"{SEARCH_TEXT[search]} it is {_band(*a_band)} the allocated peak "
            f"({_pct(a_lo, a_hi)}) and {_band(*r_band)} the reserved one ({_pct(r_lo, r_hi)})"
        )
    trials = capacity_rows()
    wrong = [r for r in trials if (r["planned_gib"] <= r["device_total_gib"]) != bool(r["fit"])]
    calls = "; ".join(
        f"{r['variant']} {r['rung'].upper()} at micro-batch {r['micro_batch']}"
        f"{'' if r['activation_checkpointing'] else ' without checkpointing'} "
        f"{'trained' if r['fit'] else 'ran out of memory'} with {r['planned_gib']:.1f} GiB "
        "planned"
        for r in wrong
    )
    verdict = (
        f"Its fits / does-not-fit call was right in {len(trials) - len(wrong)} of {len(trials)} "
        f"trials{'; ' + calls if calls else ''}"
    )
    return "The planner of this tree (`srtrain.plan`): " + "; ".join(parts) + f". {verdict}."


HEADLINE_FILE = "benchmarks/results/2026-12-04-h200-headline-f7e444e.json"


@figure("performance")
def performance() -> str:
    """README Performance: the headline table (``bench --headline``) without its capacity
    rows, which the Capacity section shows in full."""
    return _headline_table(HEADLINE_FILE)


def _headline_table(path: str) -> str:
    """A recorded headline's table as ``bench --headline`` renders it, capacity rows left out."""
    from srtrain.bench.headline import render_markdown

    return render_markdown(result(path), capacity=False).rstrip()


HEADLINE_H100_FILE = "benchmarks/results/2026-12-05-h100-headline-1472c67.json"


@figure("performance-h100")
def performance_h100() -> str:
    """docs/performance.md: the headline table at a later tree, measured on an H100 (rows
    do not compare with the H200's; ratios within the table do)."""
    return _headline_table(HEADLINE_H100_FILE)


GUARD_FILE = "benchmarks/results/2026-12-04-h200-guard-optimizer-2b57fcf.json"
GATE_GUARD_FILE = "benchmarks/results/2026-12-05-h200-guard-optimizer-b1f2ce1.json"


@figure("guard")
def guard() -> str:
    """docs/performance.md: the guard's comparison of the trees before and after the default
    step lost its health counts."""
    return guard_table(GUARD_FILE)


@figure("guard-gate")
def guard_gate() -> str:
    """docs/performance.md: the guard when the gated launch and the step inside backward
    landed."""
    return guard_table(GATE_GUARD_FILE)


SHADOW_STEP_FILE = "benchmarks/results/2026-12-04-h200-llama1b-model-step-shadow-read-e5c601d.json"
SHADOW_TRAIN_FILE = "benchmarks/results/2026-12-04-h200-llama1b-end-to-end-shadow-e5c601d.json"


@figure("shadow-cost")
def shadow_cost() -> str:
    """docs/performance.md and docs/training.md: the FP32 shadow's share of LLaMA-1B's
    training step, from its update's and its log-step sums' measured times against the
    training step of the shadow-off runs."""
    step_data, train_data = result(SHADOW_STEP_FILE), result(SHADOW_TRAIN_FILE)
    prefix = "llama-1b W=1 (219 shards) m fp8 v fp8 SR, "
    times = {r["name"]: r["after.median_us"][0] for r in step_data["rows"]}
    without = times[prefix + "SRAdamW.step"]
    with_shadow = times[prefix + "SRAdamW.step with shadow 1/1024"]
    sums = times[prefix + "shadow sums of a log step 1/1024"]
    update = with_shadow - without
    command = train_data["environment"]["command"]
    batch = int(re.search(r"train\.global_batch_size=(\d+)", command).group(1))
    seq = int(re.search(r"model\.seq_len=(\d+)", command).group(1))
    tree = step_data["environment"]["commit"]
    rows = [r for r in train_data["rows"] if r["tree"] == tree]
    off = [r["tokens_per_s"] for r in rows if r["optim.shadow_sample"] == 0]
    rate = statistics.median(off)
    step_us = batch * seq / rate * 1e6
    pairs = []
    for r in rows:
        if r["optim.shadow_sample"]:
            (twin,) = (
                o
                for o in rows
                if o["optim.shadow_sample"] == 0
                and (o["pair"], o["train.log_interval"]) == (r["pair"], r["train.log_interval"])
            )
            pairs.append(r["tokens_per_s"] / twin["tokens_per_s"] - 1)
    share = {interval: (update + sums / interval) / step_us for interval in (10, 1)}
    return (
        f"The FP32 shadow (`optim.shadow_sample=1024`, on by default) costs LLaMA-1B "
        f"{share[10]:.2%} of its training step at `train.log_interval=10` and {share[1]:.2%} "
        f"at `train.log_interval=1`: its update, {update / 1000:.2f} ms a step "
        f"(`SRAdamW.step` with the shadow {with_shadow / 1000:.2f} ms against "
        f"{without / 1000:.2f} without, FP8 SR states, one GPU), plus the log step's sums, "
        f"{sums / 1000:.2f} ms once per log interval, against a training step of "
        f"{step_us / 1000:.0f} ms ({batch} × {seq} tokens at {rate:,.0f} tokens/s, the median "
        f"of the {len(off)} shadow-off runs). Step times: the medians of one bench run, "
        f"{provenance(step_data['environment'])} "
        f"(`{Path(SHADOW_STEP_FILE).name}`, `{Path(SHADOW_TRAIN_FILE).name}`). Trained end to "
        f"end with the shadow and without, in pairs, the runs cannot resolve it: the pairs "
        f"differ by {min(pairs):+.1%} to {max(pairs):+.1%}."
    )


HOST_GUARD_FILE = "benchmarks/results/2026-12-05-h100-guard-optimizer-0181e2e.json"


@figure("guard-host")
def guard_host() -> str:
    """docs/performance.md: the guard when the step's host work was cut and the update sizes
    batched, against the tree before the headline existed, with each tree's ratios to torch's
    fused AdamW round by round."""
    return "\n\n".join([guard_table(HOST_GUARD_FILE), *_torch_ratio_lines(HOST_GUARD_FILE)])


def _torch_ratio_lines(path: str) -> list[str]:
    """A guard's optimizer rows as ratios to torch's fused AdamW of the same round, a line
    per world size: each tree's range over the rounds."""
    data = result(path)
    trees = data["trees"]
    lines = []
    for world in (1, 8):
        parts = []
        for name in (data["guard"]["before"], data["guard"]["after"]):
            values = data["values"][name]
            torch_us = values[f"llama-1b W={world}: torch AdamW fused, FP32 states"]["step_us"]
            ratios = []
            for row, measures in values.items():
                if row.startswith(f"llama-1b W={world}: SRAdamW"):
                    r = [t / s for s, t in zip(measures["step_us"], torch_us, strict=True)]
                    label = row.split(": SRAdamW ", 1)[1]
                    label = label.replace(" states, shadow", " with shadow").replace(" states", "")
                    ratios.append(f"{label} {dash_span(r, lambda x: f'{x:.2f}')}×")
            parts.append(f"`{trees[name]['commit']}` " + ", ".join(ratios))
        where = "one GPU" if world == 1 else "rank 0 of 8"
        lines.append(
            f"Against torch's fused AdamW of the same round, {where}: " + "; ".join(parts) + "."
        )
    return lines


FINAL_GUARD_FILE = "benchmarks/results/2026-12-05-h100-guard-optimizer-373b462.json"
FINAL_TRAIN_GUARD_FILE = "benchmarks/results/2026-12-05-h100-guard-train-373b462.json"


@figure("guard-final")
def guard_final() -> str:
    """docs/performance.md: the guard of a late tree against the tree before the headline
    existed: the optimizer rows (judged against torch's row of the same round), their ratios,
    and the LLaMA-1B FP8 recipe end to end with each tree's own defaults."""
    train = result(FINAL_TRAIN_GUARD_FILE)
    guard = train["guard"]
    trees = train["trees"]
    by_measure = {v["measure"]: v for v in guard["verdicts"]}

    def side(measure: str, key: str, fmt: str) -> str:
        return dash_span(by_measure[measure][key], lambda x: format(x, fmt))

    (row,) = {v["row"] for v in guard["verdicts"]}
    verdicts = "; ".join(
        f"{MEASURE_NAMES[m]} {v['verdict']} ({v['change']:+.0%})" for m, v in by_measure.items()
    )
    sentence = (
        f"The {row} end to end in the same way ({train['settings']['rounds']} rounds, each tree "
        f"with its own recipe and defaults; {provenance(train['environment'])}, "
        f"`{Path(FINAL_TRAIN_GUARD_FILE).name}`): `{trees[guard['before']]['commit']}` "
        f"{side('tokens_per_s', 'before', ',.0f')} tokens/s, "
        f"{side('mfu', 'before', '.1%')} MFU, {side('peak_gib', 'before', '.1f')} GiB peak; "
        f"`{trees[guard['after']]['commit']}` {side('tokens_per_s', 'after', ',.0f')} tokens/s, "
        f"{side('mfu', 'after', '.1%')} MFU, {side('peak_gib', 'after', '.1f')} GiB peak. "
        f"Verdicts: {verdicts}."
    )
    return "\n\n".join(
        [guard_table(FINAL_GUARD_FILE), *_torch_ratio_lines(FINAL_GUARD_FILE), sentence]
    )


def guard_table(path: str) -> str:
    """A guard's comparison of two trees: every measure with its rounds, change, noise band
    and verdict (where the guard judged optimizer rows against torch's row of the same round,
    the change of that ratio too, which the band and verdict then speak of)."""
    data = result(path)
    trees = data["trees"]
    before, after = data["guard"]["before"], data["guard"]["after"]
    env = data["environment"]
    verdicts = data["guard"]["verdicts"]
    relative = any("relative_to" in v for v in verdicts)
    changes_head = "change | ÷ torch, change" if relative else "change"
    lines = [
        f"One {env['device']} (torch {env['torch']}, Triton {env['triton']}), "
        f"{env['date'][:10]}, `{before}` = `{trees[before]['commit']}`, `{after}` = "
        f"`{trees[after]['commit']}`, {data['settings']['rounds']} rounds: "
        f"`{env['command']}`",
        "",
        f"| step time, ms (each round) | `{trees[before]['commit']}` | "
        f"`{trees[after]['commit']}` | {changes_head} | noise band | verdict |",
        "|---" * (7 if relative else 6) + "|",
    ]
    for v in verdicts:
        times = [data["values"][tree][v["row"]][v["measure"]] for tree in (before, after)]
        b, a = (", ".join(f"{x / 1000:.2f}" for x in side) for side in times)
        changes = f"{v.get('raw_change', v['change']):+.1%}"
        if relative:
            changes += " | " + (f"{v['change']:+.1%}" if "relative_to" in v else "(the control)")
        lines.append(f"| {v['row']} | {b} | {a} | {changes} | ±{v['band']:.1%} | {v['verdict']} |")
    return "\n".join(lines)


TRAIN_FILE = "benchmarks/results/2026-12-04-h200-headline-train-2b57fcf.json"
MEASURE_NAMES = {"tokens_per_s": "tokens/s", "mfu": "MFU", "peak_gib": "peak memory"}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@figure("headline-train")
def headline_train() -> str:
    """docs/performance.md: the LLaMA-1B training run recorded in the call of the guard
    (``guard``) on its ``after`` tree, against the recorded headline (``--compare``)."""
    data, guard_data = result(TRAIN_FILE), result(GUARD_FILE)
    env, guard_env = data["environment"], guard_data["environment"]
    measured = data["measured_tree"]
    tree = data["trees"][measured]
    after = guard_data["trees"][guard_data["guard"]["after"]]
    if tree["digest"] != after["digest"] or short_date(env["date"]) != short_date(
        guard_env["date"]
    ):
        raise FigureError(f"headline-train: {TRAIN_FILE} is not the guard's after tree")
    (row,) = data["rows"][measured]
    values = data["values"][measured][row["name"]]
    tokens, mfu = values["tokens_per_s"], values["mfu"]
    baseline = data["baseline"]
    base = result(baseline["file"])
    (base_tree,) = base["trees"].values()
    verdicts = baseline["verdicts"]
    before = {v["measure"]: _mean(v["before"]) for v in verdicts}
    moved = [v for v in verdicts if v["verdict"] != "within noise"]
    bands = sorted({v["band"] for v in verdicts})
    names = [MEASURE_NAMES[v["measure"]] for v in verdicts]
    names_text = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    if moved:
        verdict = f"{len(moved)} of {len(verdicts)} measures moved (" + "; ".join(
            f"{MEASURE_NAMES[v['measure']]} {v['verdict']}, {v['change']:+.1%} against a band "
            f"of ±{v['band']:.1%}"
            for v in moved
        )
    else:
        band = "/".join(f"±{b:.0%}" for b in bands)
        verdict = f"no measure moved ({names_text} each within noise, band {band}"
    recipe = row["name"].replace(" recipe, ", " recipe with ")
    config = "configs/" + Path(row["config"]).name
    return (
        f"In the same call ({short_date(env['date'])}, {env['device']}, the guard's `after` "
        f"tree `{tree['commit']}`), the {recipe} (`{config}`) trained at "
        f"{_mean(tokens):,.0f} tokens/s ({dash_span(tokens, lambda x: f'{x:,.0f}')} over "
        f"{count_word(len(tokens))} rounds), {_mean(mfu):.1%} MFU, against "
        f"{before['tokens_per_s']:,.0f} in the recorded headline (tree `{base_tree['commit']}`, "
        f"`{Path(baseline['file']).name}`, the `--compare` baseline): {verdict}; "
        f"`{Path(TRAIN_FILE).name}`)."
    )


SMALL_FILE = "benchmarks/results/2026-12-04-h200-study-llama60m-compile-2b57fcf.json"
SMALL_FROM = 50  # the small models' rates: the logged intervals from this step on


def _intervals(row: dict[str, Any]) -> list[tuple[int, int, float]]:
    """A recorded training row's logged rates as (first step, last step, tokens/s), the
    first interval left out as the bench leaves it out."""
    train = row["resolved"]["train"]
    every, rates = train["log_interval"], row["tokens_per_s_intervals"]
    if train["steps"] // every != len(rates) + 1:
        raise FigureError(f"small-models: {row['name']}: the rates are not one per log interval")
    return [(every * (k + 1), every * (k + 2), rate) for k, rate in enumerate(rates)]


def _window_rates(row: dict[str, Any]) -> list[float]:
    """A recorded training row's logged tokens/s from step :data:`SMALL_FROM` on."""
    return [rate for start, _, rate in _intervals(row) if start >= SMALL_FROM]


def _window_mfus(row: dict[str, Any]) -> list[float]:
    """MFU (%) of each of :func:`_window_rates`: MFU is tokens/s times a constant of the
    run, the row's MFU over its tokens/s."""
    return [100 * rate * row["mfu"] / row["tokens_per_s"] for rate in _window_rates(row)]


@figure("small-models")
def small_models() -> str:
    """docs/performance.md: the study's LLaMA-60M settings compiled and eager, one run each."""
    data = result(SMALL_FILE)
    rows = {str(r["resolved"]["parallel"]["compile"]).lower(): r for r in data["rows"]}
    compiled, eager = rows["auto"], rows["false"]
    resolved = compiled["resolved"]
    train, data_cfg = resolved["train"], resolved["data"]
    seq, batch = resolved["model"]["seq_len"], train["global_batch_size"]

    def rates(row: dict[str, Any]) -> str:
        return dash_span(_window_rates(row), lambda x: f"{x:,.0f}")

    def mfus(row: dict[str, Any]) -> str:
        return dash_span(_window_mfus(row), lambda x: f"{x:.1f}")

    ms = [1000 * batch * seq / rate for rate in _window_rates(compiled)]
    corpus = "the built-in corpus" if data_cfg["source"] == "builtin" else data_cfg["source"]
    return (
        f"**Small models.** The study's LLaMA-60M settings (`{compiled['config']}`: {batch} "
        f"sequences of {seq} tokens a step, one GPU, on {corpus} at "
        f"{vocab_text(data_cfg['vocab_size'])}) train at {rates(compiled)} tokens/s compiled "
        f"(`parallel.compile=auto`) against {rates(eager)} eager (`false`) over steps "
        f"{SMALL_FROM}–{train['steps']}, {mfus(compiled)}% and {mfus(eager)}% MFU (one run "
        f"each, one rate per {train['log_interval']} steps, MFU the run's recorded median "
        f"scaled to each rate; {provenance(data['environment'])}; "
        f"`{Path(SMALL_FILE).name}`). A step of {batch * seq:,} tokens takes "
        f"{dash_span(ms, lambda x: f'{x:.1f}')} ms compiled."
    )


UNITS_FILE = "benchmarks/results/2026-12-05-h100-study-llama60m-units-9781cd0.json"
PROFILE_FILES = {  # label → a recorded ``experiments.step_profile`` result
    "LLaMA-60M study settings, one FSDP2 unit (`auto`)": (
        "benchmarks/results/2026-12-05-h100-profile-llama60m-one-unit-661652a.json"
    ),
    "LLaMA-60M study settings, a unit a block (`blocks`)": (
        "benchmarks/results/2026-12-05-h100-profile-llama60m-blocks-661652a.json"
    ),
    "LLaMA-1B FP8 recipe, 64 × 1024 tokens a step": (
        "benchmarks/results/2026-12-05-h100-profile-llama1b-fp8-661652a.json"
    ),
}
PROFILE_REGIONS = ("FSDP2 hooks and collectives", "compiled code", "optimizer step")


def _profiled_steps(data: dict) -> list[dict]:
    """A profile's steps. Records without ``start_us`` (before the tool dropped it at the
    source, by its timestamps) also hold the profiler's span around the window: a row over
    :data:`ENCLOSING_SPAN` times the median step, dropped here."""
    rows = data["steps"]
    if rows and "start_us" not in rows[0]:
        middle = statistics.median(r["wall_us"] for r in rows)
        rows = [r for r in rows if r["wall_us"] <= ENCLOSING_SPAN * middle]
    return rows


ENCLOSING_SPAN = 5


@figure("step-profile")
def step_profile() -> str:
    """docs/performance.md: where a step's time goes, small model against the recipe: the
    GPU's busy time and the host's named regions, medians over the profiled steps."""
    lines = [
        "| run | step | GPU busy | FSDP2 hooks and collectives | compiled code | optimizer step |",
        "|---|---|---|---|---|---|",
    ]
    envs, windows, busy = [], [], {}
    for label, path in PROFILE_FILES.items():
        data = result(path)
        rows = _profiled_steps(data)
        wall = statistics.median(r["wall_us"] for r in rows)
        cells = [f"{wall / 1000:,.1f} ms"]
        for key in ("gpu_busy_us", *PROFILE_REGIONS):
            value = statistics.median(r[key] for r in rows)
            cells.append(f"{value / 1000:,.1f} ms ({value / wall:.0%})")
        busy[label] = statistics.median(r["gpu_busy_us"] for r in rows) / wall
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        envs.append(data["environment"])
        steps = re.search(r"train\.steps=(\d+)", data["environment"]["command"]).group(1)
        windows.append(f"the last {len(rows)} of {steps}")
    if len({(e["device"], e["commit"], e["date"][:10]) for e in envs}) != 1:
        raise FigureError("step-profile: the profiles come from different calls")
    names = ", ".join(f"`{Path(p).name}`" for p in PROFILE_FILES.values())
    small, blocks, large = busy.values()
    head = (
        f"Under `torch.profiler` (`python -m experiments.step_profile`; {provenance(envs[0])}; "
        f"steps profiled: {', '.join(dict.fromkeys(windows))}; {names}), medians over the "
        f"steps (one span in each record over {ENCLOSING_SPAN}× the median step, the "
        "profiler's own around the window, dropped), each with its share of the step "
        "(regions are host spans and overlap the GPU's "
        "work; the profiler records every operation the host runs, which lengthens the "
        "host-bound steps of the small model):"
    )
    tail = (
        f"The small model's GPU is busy for {small:.0%} of its step with one FSDP2 unit and "
        f"{blocks:.0%} with a unit a block: the host's work (FSDP2's hooks, the dispatch of "
        "the compiled blocks, autograd) sets its pace. The LLaMA-1B recipe keeps its GPU busy "
        f"for {large:.0%} of the step: there the kernels' own speed, not the host, limits MFU."
    )
    return "\n\n".join([head, "\n".join(lines), tail])


UNITS_GUARD_FILE = "benchmarks/results/2026-12-05-h200-guard-train-7f8abab.json"


@figure("small-models-units")
def small_models_units() -> str:
    """docs/performance.md: the study's LLaMA-60M with the whole model one FSDP2 unit
    against a unit a block, and the LLaMA-1B recipe's rows of the guard that measured it."""
    data = result(UNITS_FILE)
    by_units: dict[str, list[dict[str, Any]]] = {}
    for row in data["rows"]:
        by_units.setdefault(row["resolved"]["parallel"]["fsdp_units"], []).append(row)
    model, blocks = by_units["model"], by_units["blocks"]
    if len(model) != len(blocks):
        raise FigureError("small-models-units: unequal rounds of model and blocks")
    every = model[0]["resolved"]["train"]["log_interval"]

    def rates(rows: list[dict[str, Any]]) -> list[float]:
        return [rate for r in rows for rate in _window_rates(r)]

    def mfus(rows: list[dict[str, Any]]) -> list[float]:
        return [mfu for r in rows for mfu in _window_mfus(r)]

    def peaks(rows: list[dict[str, Any]]) -> str:
        return dash_span([r["peak_gib"] for r in rows], lambda x: f"{x:.2f}")

    guard = result(UNITS_GUARD_FILE)
    row = next(iter(guard["values"][guard["measured_tree"]]))
    # the tree measured just before the last one differs from it only by the units
    first, last = list(guard["trees"])[-2], guard["measured_tree"]
    trees = guard["trees"]
    one_b = {name: guard["values"][name][row] for name in (first, last)}

    def tok(name: str) -> str:
        return dash_span(one_b[name]["tokens_per_s"], lambda x: f"{x:,.0f}")

    def peak(name: str) -> str:
        return dash_span(one_b[name]["peak_gib"], lambda x: f"{x:.1f}")

    steps = model[0]["resolved"]["train"]["steps"]
    return (
        f"With the whole model one FSDP2 unit (`parallel.fsdp_units=model`, what `auto` picks "
        f"on one GPU) the same settings train on one {data['environment']['device']} at "
        f"{dash_span(rates(model), lambda x: f'{x:,.0f}')} "
        f"tokens/s against {dash_span(rates(blocks), lambda x: f'{x:,.0f}')} with a unit a "
        f"block (`blocks`), {dash_span(mfus(model), lambda x: f'{x:.1f}')}% against "
        f"{dash_span(mfus(blocks), lambda x: f'{x:.1f}')}% MFU, peak {peaks(model)} against "
        f"{peaks(blocks)} GiB (compiled; {count_word(len(model))} runs each, interleaved, one "
        f"rate per {every} steps over steps {SMALL_FROM}–{steps}; "
        f"{provenance(data['environment'])}; `{Path(UNITS_FILE).name}`). At the LLaMA-1B "
        f"recipe's size the gain is small and costs memory: {tok(last)} tokens/s and "
        f"{peak(last)} GiB peak with one unit (tree `{trees[last]['commit']}`) against "
        f"{tok(first)} and {peak(first)} GiB with a unit a block (tree "
        f"`{trees[first]['commit']}`; {count_word(len(one_b[last]['tokens_per_s']))} rounds "
        f"each, interleaved in one call, {provenance(guard['environment'])}; "
        f"`{Path(UNITS_GUARD_FILE).name}`)."
    )


def _capacity_table() -> list[str]:
    """The largest shape per optimizer on one GPU: the caption and the table."""
    settings = result(LADDER_FILES[0])["settings"]
    rows = {(r["variant"], r["rung"]): r for r in capacity_rows() if r["search"] == "ladder"}
    device_total = next(iter(rows.values()))["device_total_gib"]
    summaries = {v: e for path in LADDER_FILES for v, e in result(path)["summary"].items()}
    torch_params = summaries["torch"]["params"]
    lines = [
        f"The largest LLaMA shape each optimizer trains on one {_capacity_device()} "
        f"({device_total:.1f} GiB; sequence {settings['seq_len']}, micro-batch 1, activation "
        f"checkpointing; {_capacity_env()}; "
        "`benchmarks/results/*-h200-capacity-*.json`):",
        "",
        "| optimizer | largest that trains | parameters | peak allocated GiB | peak reserved "
        "GiB | planner GiB | × torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, s in summaries.items():
        row = rows[(variant, s["largest"])]
        times = f"{s['params'] / torch_params:.2f}"
        if variant == "fp4-bf16w-inbwd":
            times = f"**{times}**"
        lines.append(
            f"| {VARIANT_NAMES[variant]} | {s['largest'].upper()} | {millions(s['params'])} | "
            f"{s['peak_allocated_gib']:.1f} | {s['peak_reserved_gib']:.1f} | "
            f"{row['planned_gib']:.1f} | {times} |"
        )
    return lines


@figure("capacity-table")
def capacity_table() -> str:
    """README Capacity: the largest shape per optimizer on one GPU."""
    return "\n".join(_capacity_table())


@figure("capacity")
def capacity() -> str:
    """docs/training.md Capacity: the largest shape per optimizer, the planner, 7B
    throughput."""
    lines = _capacity_table()
    speed = result(CAPACITY_FILES[1])["summary"]
    fp4, torch_ = speed["fp4-bf16w"], speed["torch"]
    lines += [
        "",
        planner_claim(),
        "",
        "At 7B the memory also buys speed through a larger micro-batch: "
        f"{fp4['tokens_per_s']:,.0f} tokens/s with FP4 states and BF16 weights (micro-batch "
        f"{fp4['micro_batch']}) against torch's best {torch_['tokens_per_s']:,.0f} (micro-batch "
        f"{torch_['micro_batch']}), {fp4['tokens_per_s_vs_torch']:.2f}×.",
        "",
        *_inside_backward_at_7b(),
    ]
    return "\n".join(lines)


def _inside_backward_at_7b() -> list[str]:
    """The 7B trials of the ordinary step and the step inside backward, recorded in one
    call: tokens/s and peaks at each micro-batch both ran."""
    path = CAPACITY_FILES[3]
    rows = [r for r in result(path)["rows"] if r["search"] == "throughput"]
    by = {(r["variant"], r["micro_batch"], r["activation_checkpointing"]): r for r in rows}
    lines = [
        f"The step inside backward at 7B, in one call ({provenance(result(path)['environment'])}; "
        "FP4 states, BF16 weights; two measured steps a trial):",
        "",
        "| micro-batch | activation checkpointing | ordinary step: tokens/s | inside backward: "
        "tokens/s | ordinary: peak allocated / reserved GiB | inside: peak allocated / "
        "reserved GiB |",
        "|---|---|---|---|---|---|",
    ]
    for (variant, mb, ac), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if variant != "fp4-bf16w":
            continue
        inside = by.get(("fp4-bf16w-inbwd", mb, ac))

        def cell(row: dict | None, key: str) -> str:
            if row is None:
                return "not run"
            if not row["fit"]:
                return "out of memory"
            if key == "tokens_per_s":
                return f"{row['tokens_per_s']:,.0f}"
            return f"{row['peak_allocated_gib']:.1f} / {row['peak_reserved_gib']:.1f}"

        lines.append(
            f"| {mb} | {'on' if ac else 'off'} | {cell(r, 'tokens_per_s')} | "
            f"{cell(inside, 'tokens_per_s')} | {cell(r, 'peak')} | {cell(inside, 'peak')} |"
        )
    return lines


@figure("capacity-trials")
def capacity_trials() -> str:
    """docs/training.md: every recorded capacity trial beside the planner."""
    lines = [
        "Every recorded trial, beside the planner of this tree: its total over the "
        "allocated and over the reserved peak.",
        "",
        "| optimizer | shape | micro-batch | activation checkpointing | trains | peak "
        "allocated GiB | peak reserved GiB | planner GiB | vs allocated | vs reserved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in capacity_rows():
        if r["fit"]:
            measured = (
                f"{r['peak_allocated_gib']:.1f} | {r['peak_reserved_gib']:.1f} | "
                f"{r['planned_gib']:.1f} | {signed(planner_error(r, 'allocated'), 1)}% | "
                f"{signed(planner_error(r, 'reserved'), 1)}%"
            )
        else:
            measured = f"– | – | {r['planned_gib']:.1f} | – | –"
        lines.append(
            f"| {r['variant']} | {r['rung'].upper()} | {r['micro_batch']} | "
            f"{'yes' if r['activation_checkpointing'] else 'no'} | "
            f"{'yes' if r['fit'] else 'out of memory'} | {measured} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------- one node, as planned

NODE_PROJECTION = (
    "--ladder",
    "--gpus",
    "8",
    "--gpu-memory",
    "139.8",
    "train.global_batch_size=8",
    "model.seq_len=2048",
    "parallel.activation_checkpointing=true",
    "parallel.bf16_params=true",
    "optim.m_format=fp4",
    "optim.v_format=fp4",
    "optim.step_in_backward=true",
)
"""The planner's command line of README's one-node projection (``srtrain plan ...``)."""
NODE_GPT3 = "gpt3-175b"  # the ladder's GPT-3-like shape, named in the sentence


@figure("capacity-node")
def capacity_node() -> str:
    """README Capacity: the planner's projection for one node of 8 H200s, FP4 states with
    BF16 weights stepped inside backward beside torch's AdamW: for each, the ladder's largest
    shape that fits and the next that does not, and the GPT-3-like shape."""
    from srtrain.config import load_config
    from srtrain.plan import GIB, LADDER_VOCAB_SIZE, largest_fitting, parser, plan_ladder

    args = parser().parse_args(NODE_PROJECTION)
    cfg = load_config(args.config, args.overrides)
    ladder = plan_ladder(cfg, args.gpus, int(args.gpu_memory * GIB))
    names = list(ladder)
    ours, torch_ = (largest_fitting(ladder, baseline) for baseline in (False, True))
    if ours is None or torch_ is None:
        raise FigureError("capacity-node: no shape of the ladder fits one of the optimizers")
    shown = {ours, torch_, NODE_GPT3}
    shown |= {names[names.index(n) + 1] for n in (ours, torch_) if n != names[-1]}
    families = {"LlamaConfig": "LLaMA", "GPTNeoXConfig": "GPT-NeoX"}

    def cell(plan, best: bool) -> str:
        text = f"{plan.total / GIB:.1f}"
        return f"**{text}**" if best else text

    lines = [
        f"One node of {args.gpus} H200s ({args.gpu_memory:g} GiB each) as the planner "
        "projects it (`srtrain.plan`; projections, not measurements), at sequence "
        f"{cfg.model.seq_len}, micro-batch 1, activation checkpointing, vocabulary "
        f"{LADDER_VOCAB_SIZE}: GiB per GPU of the largest shape of the planner's ladder that "
        "fits each optimizer, of the next that does not, and of GPT-3 175B's dimensions:",
        "",
        "```bash",
        "srtrain plan " + " ".join(NODE_PROJECTION[:7]) + " \\",
        "    " + " ".join(NODE_PROJECTION[7:9]) + " \\",
        "    " + " ".join(NODE_PROJECTION[9:]),
        "```",
        "",
        "| shape | blocks | parameters | FP4 states, BF16 weights, step inside backward | fits "
        "| torch AdamW (FP32 weights and states) | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (n for n in names if n in shown):
        plans = ladder[name]
        p, b = plans.plan, plans.baseline
        lines.append(
            f"| {name.upper()} | {families[type(plans.config).__name__]} | "
            f"{millions(plans.parameters)} | {cell(p, name == ours)} | "
            f"{'yes' if p.fits(plans.gpu_bytes) else 'no'} | {cell(b, name == torch_)} | "
            f"{'yes' if b.fits(plans.gpu_bytes) else 'no'} |"
        )
    best, base, gpt3 = ladder[ours], ladder[torch_], ladder[NODE_GPT3]
    c = gpt3.config
    verdict = "fits" if gpt3.plan.fits(gpt3.gpu_bytes) else "does not fit"
    lines += [
        "",
        f"{ours.upper()} with FP4 states, BF16 weights and the step inside backward against "
        f"{torch_.upper()} with torch's AdamW: {best.parameters / base.parameters:.2f}× the "
        f"parameters. {NODE_GPT3.upper()} is GPT-3 175B's dimensions ({c.num_hidden_layers} "
        f"layers, d_model {c.hidden_size}, {c.num_attention_heads} heads, an MLP of "
        f"{c.intermediate_size // c.hidden_size}× d_model) in GPT-NeoX blocks, whose GELU MLP "
        f"is GPT-3's: it {verdict} in {gpt3.plan.total / GIB:.1f} GiB per GPU; torch's AdamW "
        f"is planned at {gpt3.baseline.total / GIB:.1f}. The gradients in flight with the step "
        "inside backward and the activations are the planner's estimates; no run of these "
        "sizes has been measured.",
    ]
    return "\n".join(lines)


PLAN_70B = (
    "--gpus",
    "8",
    "model.preset=llama3-70b",
    "model.seq_len=4096",
    "data.dir=data/llama3",
    "data.vocab_size=128256",
    "train.global_batch_size=8",
    "parallel.bf16_params=true",
    "parallel.activation_checkpointing=true",
    "optim.m_format=fp4",
    "optim.v_format=fp4",
)
"""The planner's command line of docs/training.md's Llama-3-70B table (``python -m
srtrain.plan ...``)."""


@figure("plan-llama3-70b")
def plan_llama3_70b() -> str:
    """docs/training.md Memory planner: Llama-3-70B on one node of 8 H200s, per GPU, FP4
    states with BF16 weights beside torch's AdamW, as the planner of this tree plans it."""
    from srtrain.config import load_config
    from srtrain.plan import GIB, model_config_of, parser, plan_run

    args = parser().parse_args(PLAN_70B)
    cfg = load_config(args.config, args.overrides)
    gpu_bytes = int(args.gpu_memory * GIB)
    # the vocabulary of data.vocab_size, whatever a local data.dir holds
    plans = plan_run(cfg, args.gpus, model_config_of(cfg, cfg.data.vocab_size), gpu_bytes)
    if plans.checkpointing != (True, True):
        raise FigureError("plan-llama3-70b: the plan is not the checkpointed one the text says")

    def gib(value: int) -> str:
        return f"{value / GIB:.1f}"

    def rows(p) -> tuple[int, int, int]:
        weights = p.params + p.grads
        states = p.optimizer_states + p.shadow
        return weights, states, p.total - weights - states

    ours, torch_ = rows(plans.plan), rows(plans.baseline)
    rest = "gathered units, activations, logits, context"
    if plans.plan.accumulated_grads or plans.baseline.accumulated_grads:
        rest += ", accumulated gradients"

    def total(p) -> str:
        return f"{gib(p.total)} ({'fits' if p.fits(gpu_bytes) else 'does not fit'})"

    c, o = plans.config, cfg.optim
    states = "/".join(dict.fromkeys(FORMAT_NAMES[f] for f in (o.m_format, o.v_format)))
    weights = "BF16" if cfg.parallel.bf16_params else "FP32"
    return "\n".join(
        [
            "```bash",
            "python -m srtrain.plan " + " ".join(PLAN_70B[:4]) + " \\",
            "    " + " ".join(PLAN_70B[4:7]) + " \\",
            "    " + " ".join(PLAN_70B[7:9]) + " \\",
            "    " + " ".join(PLAN_70B[9:]),
            "```",
            "",
            f"For Llama-3-70B ({millions(plans.parameters)} parameters at vocabulary "
            f"{c.vocab_size}) on one {args.gpus}×H200 node (the command above: sequence "
            f"{cfg.model.seq_len}, micro-batch {plans.micro_batch}, activation checkpointing), "
            f"per GPU of {args.gpu_memory:g} GiB, as the planner of this tree plans it "
            "(projections, not measurements):",
            "",
            f"| GiB per GPU | {states} states, {weights} weights | torch AdamW (FP32) |",
            "|---|---|---|",
            f"| parameters + gradients | {gib(ours[0])} | {gib(torch_[0])} |",
            "| optimizer states (with the sampled FP32 shadow) | "
            f"{gib(ours[1])} | {gib(torch_[1])} |",
            f"| {rest} | {gib(ours[2])} | {gib(torch_[2])} |",
            f"| total | {total(plans.plan)} | {total(plans.baseline)} |",
        ]
    )


# ------------------------------------------------------------------------ console line

CONSOLE_RUN = ("resets", "bf16-sr-resets-rewarm")  # a recorded run whose log shows a reset
CONSOLE_STEP = 1640


@figure("console-line")
def console_line() -> str:
    """README and docs/training.md Watching a run: a line a recorded run printed."""
    grid, run = CONSOLE_RUN
    prefix = f"step {CONSOLE_STEP}/"
    line = next(
        line for line in run_file(grid, run, "train.log").splitlines() if line.startswith(prefix)
    )
    config = run_config(grid, run)
    s = summary(grid)
    o = config["optim"]
    states = f"{FORMAT_NAMES[o['m_format']]} m and {FORMAT_NAMES[o['v_format']]} v"
    return "\n".join(
        [
            "```",
            line,
            "```",
            "",
            f"That line is step {CONSOLE_STEP} of the study's run `{run}` "
            f"({model_text(config, 'comma')}; {states} rounded "
            f"{o['v_rounding']}ally, resets at the theory's periods; one of {s['per_gpu']} "
            f"runs sharing one GPU, hence the low tok/s and mfu; {study_provenance(grid)}; "
            f"`docs/results/data/{grid}/results.tar.gz`).",
        ]
    )


# -------------------------------------------------------------------------------- main


@figure("prepare-device")
def prepare_device() -> str:
    """docs/data.md: preparation throughput on the 16-core device host, 1 and 16 workers."""
    path = "benchmarks/results/2026-12-05-h200-prepare.json"
    data = result(path)
    env = data["environment"]
    rows = sorted(data["rows"], key=lambda r: r["workers"])
    lines = [
        f"On the GPU machine's host (16 cores; {env['date']}, commit `{env['commit']}`; "
        f"`{path}`), SentencePiece with the 32,000-token tokenizer given:",
        "",
        "| workers | text | tokens | prepare | text MB/s | peak RSS, all processes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['text_bytes'] / 1e6:.0f} MB | {r['tokens']:,} | "
            f"{r['prepare_s']:.1f} s | {r['text_mb_per_s']:.1f} | {r['peak_rss_gib']:.2f} GiB |"
        )
    one, many = rows[0], rows[-1]
    lines += [
        "",
        f"{many['workers']} workers tokenize {many['text_mb_per_s'] / one['text_mb_per_s']:.1f}× "
        f"the text a second of one, their start included (on {many['text_bytes'] / 1e6:.0f} MB "
        f"the {many['prepare_s']:.1f} s hold the workers' start and the tokenizer's load in each), "
        f"in {many['peak_rss_gib']:.2f} GiB; one run each.",
    ]
    return "\n".join(lines)


@figure("clipping")
def clipping() -> str:
    """README Results: global-norm clipping against the step inside backward's clipping by the
    previous step's norm (LLaMA-60M, FP4 states, BF16 weights), per seed."""
    r = runs("clipping")
    config = run_config("clipping", "fp4-bf16w-seed0")
    steps = config["train"]["steps"]
    seeds = sorted({name.rsplit("seed", 1)[1] for name in r})
    checkpoints = sorted({int(s) for e in r.values() for s in (e.get("val_loss") or {})})
    rows = [
        f"**Clipping inside backward** ({model_text(config, 'short')}, FP4 states, BF16 "
        f"weights, {steps} steps, clipping at {config['optim']['grad_clip']:g}; "
        f"{count_word(len(seeds))} seeds; {study_provenance('clipping')}): validation loss "
        "with global-norm clipping and with `optim.step_in_backward=true`, which clips each "
        "step by the previous step's norm:",
        "",
        "| seed | step | global norm | previous norm | difference |",
        "|---|---|---|---|---|",
    ]
    differences = []
    for seed in seeds:
        ordinary, lagged = r[f"fp4-bf16w-seed{seed}"], r[f"fp4-bf16w-inbwd-seed{seed}"]
        for step in checkpoints:
            a, b = val(ordinary, step), val(lagged, step)
            if a is None or b is None:
                continue
            differences.append((step, b - a))
            rows.append(f"| {seed} | {step} | {a:.3f} | {b:.3f} | {signed(b - a)} |")
    final = [d for step, d in differences if step == steps]
    clip = config["optim"]["grad_clip"]
    clipped = {}  # run → the logged steps whose norm exceeded the clip
    for name in r:
        text = run_file("clipping", name, "metrics.jsonl")
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        norms = [(x["step"], x["grad_norm"]) for x in records if "grad_norm" in x]
        clipped[name] = ([step for step, norm in norms if norm > clip], len(norms))
    counts = [len(over) for over, _ in clipped.values()]
    logged = {total for _, total in clipped.values()}
    last = max(max(over) for over, _ in clipped.values())
    spread = abs(val(r["fp4-bf16w-seed0"], steps) - val(r["fp4-bf16w-seed1"], steps))
    rows += [
        "",
        f"At step {steps} the step inside backward is {span(final)} against global-norm "
        f"clipping; seed to seed, the two ordinary runs differ by {plain(spread)}. The norm "
        f"exceeded the clip at {min(counts)}–{max(counts)} of the {'/'.join(map(str, logged))} "
        f"logged steps of each run, the last at step {last}: clipping acts early in a run.",
    ]
    return "\n".join(rows)


FAULTS_DIR = "docs/results/data/faults"


@figure("faults")
def faults() -> str:
    """docs/faults.md: the fault-injection suite's counted cases, from its newest record."""
    sys.path.insert(0, str(ROOT / "tools"))
    from faults_table import render, rows

    files = [str(f.relative_to(ROOT)) for f in (ROOT / FAULTS_DIR).glob("*.json")]
    if not files:
        raise ValueError(f"no recorded fault cases in {FAULTS_DIR}")
    newest, data = max(((f, result(f)) for f in files), key=lambda r: r[1]["environment"]["date"])
    env = data["environment"]
    return (
        f"{render(rows(data['cases']))}\n\n"
        f"Recorded {short_date(env['date'])} on {env['device']} (torch {env['torch']}), commit "
        f"`{env['commit']}`, {len(data['cases'])} cases (`{newest}`):"
        f"\n\n```\n{env['command']}\n```"
    )


DEFAULT_JOB_DIR = "docs/results/data/default-job"


def default_jobs() -> list[tuple[str, dict[str, Any]]]:
    """Every recorded default job (path in the checkout, data), oldest first by the time it
    was recorded."""
    files = [str(f.relative_to(ROOT)) for f in (ROOT / DEFAULT_JOB_DIR).glob("*.json")]
    jobs = [(path, result(path)) for path in files]
    return sorted(jobs, key=lambda job: job[1]["environment"]["date"])


@figure("default-job")
def default_job() -> str:
    """README: what ``./train`` does and how long it took, from the newest recorded default
    job (``python tools/default_job.py --record ...``)."""
    from srtrain.config import Config

    plain = [path for path, data in default_jobs() if not data.get("overrides")]
    if not plain:
        raise ValueError(f"no recorded default job without overrides in {DEFAULT_JOB_DIR}")
    data = result(plain[-1])
    env, cfg = data["environment"], Config()
    params = millions(parameter_count(cfg.model.preset, data["vocab_size"], cfg.model.seq_len))
    minutes, seconds = divmod(round(data["wall_s"]), 60)
    val = data.get("last_val_loss")
    return (
        "`./train` needs no network: it tokenizes the Python standard library into "
        f"`{cfg.data.dir}` and trains a {params}-parameter LLaMA for {data['steps']} steps "
        f"({minutes} min {seconds} s on {env['device']}, data preparation included, "
        f"{short_date(env['date'])}, commit `{env['commit']}`; loss {data['first_loss']:.2f} → "
        f"{data['last_loss']:.2f}"
        + (f", validation {val:.2f}" if val is not None else "")
        + f"), logging stall fractions every {cfg.train.log_interval} steps to the console and "
        f"`{cfg.train.run_dir}/tb`."
    )


@figure("cpu-compute-dtype")
def cpu_compute_dtype() -> str:
    """docs/training.md: the default job on a CPU computing in BF16 against FP32, from the
    newest recorded default job with each ``parallel.compute_dtype``."""
    newest: dict[str, tuple[list[str], dict[str, Any]]] = {}
    for _, data in default_jobs():
        overrides = data.get("overrides") or []
        dtypes = [o.split("=", 1)[1] for o in overrides if o.startswith("parallel.compute_dtype=")]
        if dtypes:
            newest[dtypes[0]] = (overrides, data)
    if not {"bf16", "fp32"} <= set(newest):
        raise ValueError(f"{DEFAULT_JOB_DIR} needs a record with each compute dtype, bf16 and fp32")
    (bf16_args, bf16), (_, fp32) = newest["bf16"], newest["fp32"]
    env = bf16["environment"]

    def rate(data: dict[str, Any]) -> str:
        rates = data["tokens_per_s"][1:] or data["tokens_per_s"]  # the first holds start-up
        return f"{round(sorted(rates)[len(rates) // 2], -1):,.0f}"

    return (
        f"On {env['device']} on {short_date(env['date'])} (commit `{env['commit']}`), "
        f"`./train {' '.join(bf16_args)}` took {bf16['wall_s']:.0f} s (data preparation "
        f"included) at about {rate(bf16)} tokens/s and the same with `fp32` "
        f"{fp32['wall_s']:.0f} s at about {rate(fp32)} tokens/s (median of the log lines after "
        f"the first), with losses {bf16['last_loss']:.4f} and {fp32['last_loss']:.4f} at step "
        f"{bf16['steps']} (one run each)."
    )


PREPARE_DIR = "docs/results/data/prepare"


def _prepare_record(pattern: str) -> tuple[dict[str, Any], str]:
    """The newest record in PREPARE_DIR matching ``pattern`` and where it was measured:
    ``a 2-core ... (date, commit, load average before and after; path)``."""
    files = sorted((ROOT / PREPARE_DIR).glob(pattern))
    if not files:
        raise ValueError(f"no {pattern} record in {PREPARE_DIR}")
    path = str(files[-1].relative_to(ROOT))
    data = result(path)
    env = data["environment"]
    return data, (
        f"{env['device']} ({short_date(env['date'])}, commit `{env['commit']}`, load average "
        f"{env['load_average_before'][0]:.1f} before the runs and "
        f"{env['load_average_after'][0]:.1f} after; `{path}`)"
    )


@figure("prepare-cpu")
def prepare_cpu() -> str:
    """docs/data.md: preparation throughput and memory on a CPU host, per tokenizer and worker
    count, from the newest ``tools/prepare_bench.py`` record."""
    data, where = _prepare_record("*-cpu.json")
    env, rows = data["environment"], data["rows"]
    first = rows[0]
    lines = [
        f"On {where}: {first['text_bytes'] / 1e6:.0f} MB of the `packages` source "
        f"({first['documents']:,} documents), with tokenizers of 32,000 tokens trained on "
        f"{data['tokenizer_bytes'] / 1e6:.0f} MB of it given; one run each.",
        "",
        "| tokenizer | workers | tokens | prepare | text MB/s | peak RSS, all processes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokenizer']} | {r['workers']} | {r['tokens']:,} | {r['prepare_s']:.1f} s | "
            f"{r['text_bytes'] / 1e6 / r['prepare_s']:.1f} | {r['peak_rss_gib']:.2f} GiB |"
        )
    notes = []
    for name, same in data["same_shards_across_workers"].items():
        mine = sorted((r for r in rows if r["tokenizer"] == name), key=lambda r: r["workers"])
        one, most = mine[0], mine[-1]
        speedup = one["prepare_s"] / most["prepare_s"]
        per_worker = (most["peak_rss_gib"] - one["peak_rss_gib"]) / (
            most["workers"] - one["workers"]
        )
        notes.append(
            f"{name}: {most['workers']} workers prepare {speedup:.2f}× as fast as "
            f"{one['workers']}, each further worker adds {per_worker:.2f} GiB, and the shards "
            + ("are the same bytes" if same else "DIFFER")
        )
    lines += ["", "; ".join(notes) + ".", "", "```text", env["command"], "```"]
    return "\n".join(lines)


@figure("prepare-scale")
def prepare_scale() -> str:
    """docs/data.md: preparation rate and memory as the corpus grows, and the time before
    step 1 on the largest, from the newest ``tools/corpus_scale.py`` record."""
    data, where = _prepare_record("*-cpu-scale.json")
    env, rows, trains = data["environment"], data["prepare"], data["train"]
    largest = max(rows, key=lambda r: r["text_bytes"])
    workers = sorted({r["workers"] for r in rows})
    rates = [r["text_bytes"] / 1e6 / r["prepare_s"] for r in rows]
    peaks = [r["peak_rss_gib"] for r in rows]
    lines = [
        f"On {where}: {data['corpus']} to "
        f"{largest['text_bytes'] / 1e9:g} GB, its first "
        + ", ".join(f"{r['text_bytes'] / 1e6:,.0f} MB" for r in rows)
        + f" prepared with {workers[0] if len(workers) == 1 else workers} workers and a "
        "32,000-token SentencePiece tokenizer given; one run each.",
        "",
        "| text | documents | tokens | shards on disk | prepare | text MB/s "
        "| peak RSS, all processes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, rate in zip(rows, rates, strict=True):
        lines.append(
            f"| {r['text_bytes'] / 1e6:,.0f} MB | {r['documents']:,} | {r['tokens']:,} | "
            f"{r['shard_bytes'] / 2**30:.2f} GiB in {r['shards']} | {r['prepare_s']:.1f} s | "
            f"{rate:.1f} | {r['peak_rss_gib']:.2f} GiB |"
        )
    lines += [
        "",
        f"From {rows[0]['text_bytes'] / 1e6:,.0f} MB to {largest['text_bytes'] / 1e6:,.0f} MB "
        f"({largest['text_bytes'] / rows[0]['text_bytes']:.0f}× the text) the rate reads "
        f"{min(rates):.1f}–{max(rates):.1f} MB/s and the peak memory "
        f"{min(peaks):.2f}–{max(peaks):.2f} GiB. The default job on the "
        f"{largest['tokens'] / 1e6:,.0f}M-token directory (`./train data.dir=DIR "
        f"train.steps={trains[0]['steps']}`, each from a fresh run dir):",
        "",
        "| run | console's first-step line after | wall | peak RSS |",
        "| --- | --- | --- | --- |",
    ]
    for t in trains:
        lines.append(
            f"| {t['run']} | {t['first_step_line_s']:.1f} s | {t['wall_s']:.1f} s | "
            f"{t['peak_rss_gib']:.2f} GiB |"
        )
    shard_gib = largest["shard_bytes"] / 2**30
    reads = ", ".join(
        f"{v['seconds']:.1f} s on {count_word(v['threads'])} thread{'s' * (v['threads'] > 1)} "
        f"({shard_gib / v['seconds']:.2f} GiB/s)"
        for v in data["verify"]
    )
    lines += [
        "",
        f"Verifying the {shard_gib:.2f} GiB of shards (`verify_data`: each shard's sha256 and "
        f"largest token id, in a fresh process, nothing remembered, the shards in the page "
        f"cache) took {reads}; the threads read different shards at once.",
        "",
        "```text",
        env["command"],
        "```",
    ]
    return "\n".join(lines)


@figure("tokenizer-training")
def tokenizer_training() -> str:
    """docs/data.md: a new tokenizer's training time and memory against the text it samples,
    per tokenizer kind, from the newest ``tools/tokenizer_bench.py`` record, with the memory's
    least-squares slope per 100 MB of sample (a fitted parameter, named as such)."""
    data, where = _prepare_record("*-cpu-tokenizer.json")
    rows = data["rows"]
    lines = [
        f"On {where}: a new {data['vocab_size']:,}-token tokenizer trained by `prepare` on "
        "samples of the `packages` source (`--tokenizer-sample-bytes`, `--workers 1`); one run "
        "each.",
        "",
        "| tokenizer | sample | sampling | training | peak RSS until trained | peak RSS, the "
        "whole command |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokenizer']} | {r['sampled_mb']:,.0f} MB | {r['sample_s']:.1f} s | "
            f"{r['train_s']:.1f} s | {r['training_peak_rss_gib']:.2f} GiB | "
            f"{r['command_peak_rss_gib']:.2f} GiB |"
        )
    summaries = []
    for name in dict.fromkeys(r["tokenizer"] for r in rows):
        own = [r for r in rows if r["tokenizer"] == name]
        xs = [r["sampled_mb"] for r in own]
        ys = [r["training_peak_rss_gib"] for r in own]
        slope = statistics.linear_regression(xs, ys).slope
        summaries.append(
            f"{name}: {min(xs):,.0f} to {max(xs):,.0f} MB trains in "
            f"{dash_span([r['train_s'] for r in own], lambda v: f'{v:.1f}')} s with "
            f"{dash_span(ys, lambda v: f'{v:.2f}')} GiB at its peak, "
            f"{slope * 100:.2f} GiB more per 100 MB of sample (least-squares slope over the "
            f"{len(own)} runs)"
        )
    lines += ["", "; ".join(summaries) + ".", "", "```text", data["environment"]["command"], "```"]
    return "\n".join(lines)


SHADOW_STATES = {"bf16": "BF16", "fp8": "FP8", "fp4_e2m1": "FP4 (E2M1 m / E2M2 v)"}


@figure("shadow-typical")
def shadow_typical() -> str:
    """docs/training.md: the FP32 shadow's values on the tiny model, per state format, from
    the newest recorded default job that sets each ``optim.m_format``."""
    import math

    newest: dict[str, dict[str, Any]] = {}
    for _, data in default_jobs():
        for o in data.get("overrides") or []:
            if o.startswith("optim.m_format=") and data.get("shadow"):
                newest[o.split("=", 1)[1]] = data
    missing = set(SHADOW_STATES) - set(newest)
    if missing:
        raise ValueError(f"{DEFAULT_JOB_DIR} has no shadow record of {sorted(missing)}")

    def pct(values: list[float]) -> str:
        lo, hi = min(values) * 100, max(values) * 100
        return f"{lo:.2g}–{hi:.2g}%"

    def cosine(values: list[float]) -> str:
        decimals = max(3, math.ceil(-math.log10(1 - min(values))) + 1)
        return f"{min(values):.{decimals}f}–{max(values):.{decimals}f}"

    first = newest["bf16"]
    env = first["environment"]
    lines = [
        f"Values at the log steps of the tiny model's first {first['steps']} steps on a CPU "
        f"(`./train train.steps={first['steps']}` with each state format; "
        f"{short_date(env['date'])}, commit `{env['commit']}`, one run each; "
        f"`{DEFAULT_JOB_DIR}`):",
        "",
        "| states | `rel_err` m | `rel_err` v | largest `\\|bias\\|` m, v | `update_cosine` |",
        "|---|---|---|---|---|",
    ]
    for fmt, name in SHADOW_STATES.items():
        sh = newest[fmt]["shadow"]
        bias = ", ".join(
            f"{max(abs(x) for x in sh[f'shadow_bias_{s}']) * 100:.2g}%" for s in ("m", "v")
        )
        lines.append(
            f"| {name} | {pct(sh['shadow_rel_err_m'])} | {pct(sh['shadow_rel_err_v'])} | "
            f"{bias} | {cosine(sh['shadow_update_cosine'])} |"
        )
    return "\n".join(lines)


@figure("frozen-weights")
def frozen_weights() -> str:
    """docs/study.md: BF16 weights without a master copy under nearest and stochastic
    rounding, from the recorded frozen-weights run."""
    data = result("docs/results/data/frozen/frozen.json")
    setup, threshold = data["setup"], data["threshold"]
    near, sto = data["variants"]["nearest"], data["variants"]["stochastic"]
    edges, counts = data["bins"]["edges"], data["bins"]["count"]
    above = [i for i in range(len(counts)) if edges[i] >= threshold["measured_abs_w"]]
    share_above = sum(counts[i] * near["ever_changed_by_bin"][i] for i in above) / sum(
        counts[i] for i in above
    )
    never = min(
        edges[i]
        for i in range(len(counts))
        if all(near["ever_changed_by_bin"][j] == 0 for j in range(i, len(counts)))
    )
    env = data["environment"]
    recorded = (
        "date, device and commit not recorded"
        if env.get("commit", "unknown") == "unknown"
        else provenance(env)
    )

    def item(text: str, indent: str = "") -> str:
        return textwrap.fill(
            text,
            WIDTH,
            initial_indent=indent + "- ",
            subsequent_indent=indent + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )

    return "\n".join(
        [
            f"No FP32 master copy: {MODEL_NAMES.get(setup['preset'], setup['preset'])} with BF16 "
            f"weights and {setup['states']} states, {setup['lr_schedule']} lr {data['lr']:g}, "
            f"{setup['steps']} steps, weight decay {setup['weight_decay']:g}, once with nearest "
            f"and once with stochastic rounding of the weights (one seed, {recorded}; "
            "`docs/results/data/frozen/frozen.json`).",
            "",
            item(
                f"**Nearest:** {near['ever_changed'] * 100:.1f}% of the weight-matrix elements "
                f"ever changed, {near['changed_last_step'] * 100:.1f}% in the last step; final "
                f"loss {near['losses'][-1]:.2f}."
            ),
            item(
                f"**Stochastic:** {sto['ever_changed'] * 100:.3g}% ever changed, "
                f"{sto['changed_last_step'] * 100:.1f}% in the last step; final loss "
                f"{sto['losses'][-1]:.2f}."
            ),
            item(
                "**Where the weights freeze:** under nearest rounding, half of the weights stop "
                f"changing at |w| = {threshold['measured_abs_w']:.3f} = "
                f"{threshold['measured_over_lr']:.0f}·lr. That lies between the predicted "
                "256·lr and 512·lr: an update of about lr is dropped once it is under half a "
                "BF16 step of w."
            ),
            item(
                f"Above |w| = {edges[above[0]]:.3f} only {share_above * 100:.0f}% of the weights "
                f"ever changed under nearest rounding, and none above {never:.3f}. Under "
                "stochastic rounding, "
                f"{'all' if min(sto['ever_changed_by_bin']) == 1 else 'not all'} of them changed.",
                "  ",
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Check the blocks (exit 1 with a diff where one differs) or ``--write`` them."""
    parser = argparse.ArgumentParser(prog="python tools/figures.py", description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the blocks in place")
    parser.add_argument("--list", action="store_true", help="print every registered name")
    args = parser.parse_args(argv)
    try:
        if args.list:
            print("\n".join(sorted(REGISTRY)))
            return 0
        if args.write:
            for path in write():
                print(f"rewrote {_where(path)}")
            return 0
        diffs = check()
    except FigureError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if diffs:
        print("".join(diffs), end="")
        print("figures differ from the data; run: python tools/figures.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
