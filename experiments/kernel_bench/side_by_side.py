"""Side-by-side timing of one launch option of the fused step: every value in one process,
interleaved over rounds, so that a change is read against the same machine and clocks.

``python -m experiments.kernel_bench --compare l2_every_thread=false,true --rounds 2`` times
each state pair, nearest and stochastic, at each value in turn, round after round, and
reports each value's median share of the copy bandwidth over the rounds next to the first
value's.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict

import torch

from srtrain.kernels.launch_plan import CHOICES, check_choices, check_tile
from srtrain.numerics.formats import NAMED_PAIRS

# the launch's options: its tile and the choices of its plan; they tune the launch and never
# change its results
LAUNCH_OPTIONS = ("tile", *CHOICES)
# low-precision state pairs by name (numerics.formats.NAMED_PAIRS): m format, v format
COMPARE_STATES = {
    name: (NAMED_PAIRS[name][0].name, NAMED_PAIRS[name][1].name)
    for name in ("bf16", "fp8", "fp4", "fp8-fp4")
}


def _value(text: str) -> bool | int | str | None:
    """A launch option's value from the command line: true/false, none, auto or an int."""
    words = {"true": True, "false": False, "none": None, "auto": "auto"}
    if text.lower() in words:
        return words[text.lower()]
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a launch option value: use true, false, none, auto or an integer"
        ) from None


def parse_compare(spec: str) -> tuple[str, list]:
    """``OPTION=V1,V2,...`` → (option, values), checked by building a step with each value."""
    option, sep, values = spec.partition("=")
    if not sep or option not in LAUNCH_OPTIONS:
        raise ValueError(
            f"--compare takes OPTION=V1,V2 with OPTION one of "
            f"{', '.join(LAUNCH_OPTIONS)}; got {spec!r}"
        )
    parsed = [_value(v) for v in values.split(",") if v]
    if len(parsed) < 2 or len(set(map(repr, parsed))) != len(parsed):
        raise ValueError(
            f"--compare needs two or more different values of {option}; got {values!r}"
        )
    for value in parsed:
        _check_option(option, value)
    return option, parsed


def parse_states(names: str) -> list[tuple[str, str]]:
    """Comma-separated names of ``COMPARE_STATES`` → (m format, v format) pairs."""
    pairs = []
    for name in names.split(","):
        if name not in COMPARE_STATES:
            raise ValueError(f"unknown state pair {name!r}: use {', '.join(COMPARE_STATES)}")
        pairs.append(COMPARE_STATES[name])
    return pairs


def _check_option(option: str, value) -> None:
    """Raise the launch plan's own error if it refuses ``option=value`` ("auto": the plan's
    own choice)."""
    if value == "auto":
        return
    if option == "tile":
        check_tile(value)
    else:
        check_choices({option: value})


def compare_launch_option(
    option: str,
    values: list,
    states: list[tuple[str, str]],
    numel: int,
    repeats: int,
    rounds: int,
    cols: int,
    param_dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """Every (state pair, rounding) at each value of ``option`` on rows of ``cols``,
    ``rounds`` times in turn; then one summary row per (state pair, rounding, value): the
    median share of the copy bandwidth over the rounds and its ratio to the first value's."""
    from experiments.kernel_bench.rows import copy_bandwidth, fused_step

    copy = copy_bandwidth(numel, repeats)
    rows = [asdict(copy)]
    shares: dict[tuple, list[float]] = {}
    for round_ in range(1, rounds + 1):
        for m_fmt, v_fmt in states:
            for stochastic in (False, True):
                for value in values:
                    timing = fused_step(
                        numel,
                        m_fmt,
                        v_fmt,
                        stochastic,
                        param_dtype,
                        32,
                        repeats,
                        copy,
                        cols,
                        **{option: value},
                    )
                    rows.append({**asdict(timing), "round": round_})
                    shares.setdefault((m_fmt, v_fmt, stochastic, repr(value)), []).append(
                        timing.fraction_of_copy
                    )
                    torch.cuda.empty_cache()
    for m_fmt, v_fmt in states:
        for stochastic in (False, True):
            first = statistics.median(shares[(m_fmt, v_fmt, stochastic, repr(values[0]))])
            for value in values:
                share = statistics.median(shares[(m_fmt, v_fmt, stochastic, repr(value))])
                rows.append(
                    {
                        "name": f"m {m_fmt} v {v_fmt} {'SR' if stochastic else 'NR'}, "
                        f"{option}={value}, median of {rounds} rounds",
                        "fraction_of_copy": share,
                        "vs_first_value": share / first,
                    }
                )
    return rows
