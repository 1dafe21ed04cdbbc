"""Named experiment grids: each run is a name, a config file and dotted overrides, in launch order.

Built-in grids (``GRIDS``):

- ``ablation`` (LLaMA-60M, ``configs/study/llama-60m.yaml``): state precision × rounding ×
  resets. ``fp32`` and ``fp32-resets`` (periodic resets of both states every 1000 steps);
  for F in bf16, fp8, fp4: ``F-nr`` / ``F-sr`` (nearest / stochastic rounding of m and v, no
  resets), ``F-nr-resets`` / ``F-sr-resets`` (resets at the theory's periods, which differ for
  m and v; a v reset also resets m) and ``F-sr-resets-sym`` (periodic resets of both states
  at the published periods: 1000 bf16, 300 fp8, 200 fp4). Its resets restart at the full
  learning rate (``resets.rewarmup=0``), as when its results were recorded.
- ``stall-neox`` (GPT-NeoX-160M, ``configs/study/neox-160m.yaml``, no resets): measured stall
  fractions of bf16, fp8 and fp4 states with NR and SR.
- ``lean`` (LLaMA-60M, no resets): FP32 master weights against BF16 weights rounded
  stochastically (``parallel.bf16_params=true``, no master copy), with FP8 and FP4 states
  (SR); ``fp32`` states with FP32 master weights and ``bf16-sr-bf16w`` for reference.
- ``resets`` (LLaMA-60M over 8000 steps, ``configs/study/llama-60m-long.yaml``): whether
  resets pay at four times the ablation's horizon, and which semantics. ``fp32`` and, for F
  in fp4, fp8, bf16: ``F-sr`` (no resets), ``F-sr-resets`` (theory periods, both states to
  zero and bias correction restarted, at the full learning rate: ``resets.rewarmup=0``) and
  ``F-sr-resets-rewarm`` (the same with the learning rate warmed up again over
  :data:`REWARMUP_STEPS` steps after each reset);
  ``fp32-resets`` and ``fp32-resets-rewarm`` (both states every 1000 steps);
  ``F-sr-resets-2000-rewarm`` for F in fp4, fp8 (both states every :data:`LONG_RESET_PERIOD`
  steps, with re-warmup); then the headline runs again with a second seed (suffix
  ``-seed1``: ``train.seed`` and ``optim.seed`` 1).
- ``health`` (LLaMA-60M over 2000 steps of the long corpus): FP8 and FP4 states, NR and SR.
- ``clipping`` (LLaMA-60M over 2000 steps, FP4 states and BF16 weights, two seeds):
  global-norm clipping against the step inside backward's clipping by the previous norm.

A grid can also be a YAML or JSON file::

    name: small             # optional; the file name without suffix by default
    config: ../configs/tiny.yaml   # relative to the grid file; a run may name its own
    runs:
      - {name: bf16-sr, overrides: [optim.m_format=bf16, optim.m_rounding=stochastic]}
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from srtrain.config import ConfigError, parse_override
from srtrain.numerics.formats import NAMED_PAIRS

REPO = Path(__file__).resolve().parents[2]
STUDY_CONFIGS = REPO / "configs" / "study"
# low-precision state pairs whose moments share a code family: bf16, fp8, fp4
LOW_PRECISION = tuple(
    name for name, (m, v) in NAMED_PAIRS.items() if m.family == v.family and m.bits < 32
)
PUBLISHED_PERIODS = {"bf16": 1000, "fp8": 300, "fp4": 200}  # steps between resets, β₂ = 0.999
FP32_RESET_PERIOD = 1000
LONG_RESET_PERIOD = 2000  # four resets in 8000 steps: staleness past the theory's periods
REWARMUP_STEPS = 20  # about two of m's time constants, 1/(1-β1) = 10 steps at β1 = 0.9
ROUNDING_SUFFIX = {"nearest": "nr", "stochastic": "sr"}
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
GRID_FILE_SUFFIXES = (".yaml", ".yml", ".json")


class GridError(ValueError):
    """A grid or run selection problem, described in one line."""


@dataclass(frozen=True)
class Run:
    """One training run of a grid: its name (also its directory), config file and overrides."""

    name: str
    config: Path
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Grid:
    """Runs in the order they should start (most important first)."""

    name: str
    runs: tuple[Run, ...]

    @property
    def names(self) -> list[str]:
        """Run names in launch order."""
        return [run.name for run in self.runs]

    def select(self, names: Iterable[str]) -> Grid:
        """The named runs only, still in launch order; unknown names are an error."""
        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in self.names]
        if unknown:
            raise GridError(
                f"unknown run name(s) {', '.join(unknown)} in grid {self.name}; "
                f"runs: {', '.join(self.names)}"
            )
        return replace(self, runs=tuple(r for r in self.runs if r.name in wanted))


def state_overrides(fmt: str, rounding: str) -> tuple[str, ...]:
    """Both moments stored in ``fmt`` and rounded with ``rounding``."""
    return (
        f"optim.m_format={fmt}",
        f"optim.v_format={fmt}",
        f"optim.m_rounding={rounding}",
        f"optim.v_rounding={rounding}",
    )


NO_RESETS = ("resets.mode=none",)
THEORY_RESETS = ("resets.mode=theory", "resets.rewarmup=0")


def periodic_resets(period: int) -> tuple[str, ...]:
    """Both moments reset every ``period`` steps, restarting at the full learning rate."""
    return (
        "resets.mode=periodic",
        f"resets.m_period={period}",
        f"resets.v_period={period}",
        "resets.rewarmup=0",
    )


def _variant(fmt: str, rounding: str, resets: str = "") -> tuple[str, tuple[str, ...]]:
    """(name, overrides) of a low-precision variant; ``resets`` is '', 'theory' or 'sym'."""
    name = f"{fmt}-{ROUNDING_SUFFIX[rounding]}"
    reset = {
        "": NO_RESETS,
        "theory": THEORY_RESETS,
        "sym": periodic_resets(PUBLISHED_PERIODS[fmt]),
    }[resets]
    suffix = {"": "", "theory": "-resets", "sym": "-resets-sym"}[resets]
    return name + suffix, state_overrides(fmt, rounding) + reset


def _runs(config: Path, variants: Iterable[tuple[str, tuple[str, ...]]]) -> tuple[Run, ...]:
    return tuple(Run(name, config, overrides) for name, overrides in variants)


def ablation_grid() -> Grid:
    """LLaMA-60M: state precision × rounding × resets, most important runs first."""
    fp32 = state_overrides("fp32", "nearest")
    variants = [
        ("fp32", fp32 + NO_RESETS),
        _variant("bf16", "nearest"),
        _variant("bf16", "stochastic"),
        _variant("fp8", "stochastic"),
        _variant("fp4", "stochastic"),
        _variant("fp8", "nearest"),
        _variant("fp4", "nearest"),
        *(_variant(f, "stochastic", "theory") for f in LOW_PRECISION),
        *(_variant(f, "stochastic", "sym") for f in LOW_PRECISION),
        *(_variant(f, "nearest", "theory") for f in LOW_PRECISION),
        ("fp32-resets", fp32 + periodic_resets(FP32_RESET_PERIOD)),
    ]
    return Grid("ablation", _runs(STUDY_CONFIGS / "llama-60m.yaml", variants))


def stall_neox_grid() -> Grid:
    """GPT-NeoX-160M without resets: measured stall fractions of NR and SR states."""
    variants = [
        _variant("bf16", "nearest"),
        _variant("bf16", "stochastic"),
        _variant("fp8", "stochastic"),
        _variant("fp4", "stochastic"),
        _variant("fp8", "nearest"),
    ]
    return Grid("stall-neox", _runs(STUDY_CONFIGS / "neox-160m.yaml", variants))


BF16_WEIGHTS = ("parallel.bf16_params=true", "optim.param_rounding=stochastic")


def lean_grid() -> Grid:
    """LLaMA-60M: what BF16 weights without a master copy cost, per state format."""
    fp8, fp4 = _variant("fp8", "stochastic"), _variant("fp4", "stochastic")
    variants = [
        ("fp32", state_overrides("fp32", "nearest") + NO_RESETS),
        fp8,
        (f"{fp8[0]}-bf16w", fp8[1] + BF16_WEIGHTS),
        fp4,
        (f"{fp4[0]}-bf16w", fp4[1] + BF16_WEIGHTS),
        ("bf16-sr-bf16w", _variant("bf16", "stochastic")[1] + BF16_WEIGHTS),
    ]
    return Grid("lean", _runs(STUDY_CONFIGS / "llama-60m.yaml", variants))


def resets_grid() -> Grid:
    """LLaMA-60M over 8000 steps: no resets, today's resets and resets with re-warmup, per
    state format; the headline runs again with a second seed."""
    rewarm = (f"resets.rewarmup={REWARMUP_STEPS}",)
    fp32 = state_overrides("fp32", "nearest")
    variants: list[tuple[str, tuple[str, ...]]] = [("fp32", fp32 + NO_RESETS)]
    for fmt in ("fp4", "fp8", "bf16"):
        name, plain = _variant(fmt, "stochastic")
        reset_name, reset = _variant(fmt, "stochastic", "theory")
        variants += [(name, plain), (f"{reset_name}-rewarm", reset + rewarm), (reset_name, reset)]
    variants += [
        ("fp32-resets-rewarm", fp32 + periodic_resets(FP32_RESET_PERIOD) + rewarm),
        ("fp32-resets", fp32 + periodic_resets(FP32_RESET_PERIOD)),
    ]
    for fmt in ("fp4", "fp8"):
        name, plain = _variant(fmt, "stochastic")
        long_resets = periodic_resets(LONG_RESET_PERIOD) + rewarm
        variants.append((f"{name}-resets-{LONG_RESET_PERIOD}-rewarm", plain[:4] + long_resets))
    headline = (
        "fp32",
        "fp4-sr",
        "fp4-sr-resets-rewarm",
        f"fp4-sr-resets-{LONG_RESET_PERIOD}-rewarm",
        "fp8-sr",
        "fp8-sr-resets-rewarm",
        f"fp8-sr-resets-{LONG_RESET_PERIOD}-rewarm",
        "bf16-sr",
        "bf16-sr-resets-rewarm",
    )
    overrides = dict(variants)
    variants += [
        (f"{name}-seed1", overrides[name] + ("train.seed=1", "optim.seed=1")) for name in headline
    ]
    return Grid("resets", _runs(STUDY_CONFIGS / "llama-60m-long.yaml", variants))


HEALTH_STEPS = ("train.steps=2000", "optim.warmup_steps=200")


def health_grid() -> Grid:
    """LLaMA-60M over 2000 steps of the long corpus, FP8 and FP4 states with nearest and
    stochastic rounding: state health (stalls, FP32 shadow) of healthy and unhealthy runs."""
    variants = [
        (name, overrides + HEALTH_STEPS)
        for name, overrides in (
            _variant(fmt, rounding)
            for fmt in ("fp4", "fp8")
            for rounding in ("nearest", "stochastic")
        )
    ]
    return Grid("health", _runs(STUDY_CONFIGS / "llama-60m-long.yaml", variants))


CLIPPING_DATA = ("data.dir=data/clipping", "data.max_bytes=40000000")


def clipping_grid() -> Grid:
    """LLaMA-60M over 2000 steps, FP4 states and BF16 weights (the capacity configuration):
    global-norm clipping against the step inside backward, which clips by the previous
    step's norm (``optim.step_in_backward``); two seeds each. A 40 MB slice of the long
    corpus (about 12.6M tokens at its 8k vocabulary) covers the 8.2M tokens once."""
    fp4 = _variant("fp4", "stochastic")[1] + BF16_WEIGHTS + HEALTH_STEPS + CLIPPING_DATA
    variants = []
    for seed in (0, 1):
        seeded = (f"train.seed={seed}", f"optim.seed={seed}")
        variants += [
            (f"fp4-bf16w-seed{seed}", fp4 + seeded),
            (f"fp4-bf16w-inbwd-seed{seed}", fp4 + seeded + ("optim.step_in_backward=true",)),
        ]
    return Grid("clipping", _runs(STUDY_CONFIGS / "llama-60m-long.yaml", variants))


GRIDS = {
    "ablation": ablation_grid,
    "stall-neox": stall_neox_grid,
    "lean": lean_grid,
    "resets": resets_grid,
    "health": health_grid,
    "clipping": clipping_grid,
}


def _check_overrides(where: str, overrides: object) -> tuple[str, ...]:
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise GridError(f"{where}: overrides must be a list of section.key=value strings")
    for text in overrides:
        try:
            parse_override(text)
        except ConfigError as err:
            raise GridError(f"{where}: {err}") from None
    return tuple(overrides)


def _config_path(where: str, base: Path, value: object) -> Path:
    if not isinstance(value, str) or not value:
        raise GridError(f"{where}: 'config' must name a config file")
    path = (base / value).resolve()
    if not path.is_file():
        raise GridError(f"{where}: config file not found: {path}")
    return path


def grid_from_file(path: Path) -> Grid:
    """A grid described by a YAML or JSON file (see the module docstring)."""
    try:
        text = path.read_text()
        tree = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise GridError(f"grid file {path} cannot be read: {err}".splitlines()[0]) from None
    if not isinstance(tree, dict) or not isinstance(tree.get("runs"), list) or not tree["runs"]:
        raise GridError(f"grid file {path} must hold a mapping with a non-empty list 'runs'")
    default = tree.get("config")
    runs = []
    for i, entry in enumerate(tree["runs"]):
        where = f"grid file {path}, run {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise GridError(f"{where}: expected a mapping with a 'name'")
        name = entry["name"]
        if not _RUN_NAME.match(name):
            raise GridError(f"{where}: run name {name!r} must be letters, digits, '.', '_', '-'")
        config = _config_path(where, path.parent, entry.get("config", default))
        runs.append(Run(name, config, _check_overrides(where, entry.get("overrides", []))))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise GridError(f"grid file {path}: duplicate run name(s) {', '.join(duplicates)}")
    return Grid(str(tree.get("name") or path.stem), tuple(runs))


def load_grid(spec: str) -> Grid:
    """A built-in grid by name, or a grid file (.yaml, .yml, .json)."""
    if spec in GRIDS:
        return GRIDS[spec]()
    path = Path(spec)
    if path.suffix in GRID_FILE_SUFFIXES:
        if not path.is_file():
            raise GridError(f"grid file not found: {path}")
        return grid_from_file(path)
    raise GridError(
        f"unknown grid {spec!r}; allowed: {', '.join(GRIDS)}, "
        f"or a grid file ({', '.join(GRID_FILE_SUFFIXES)})"
    )
