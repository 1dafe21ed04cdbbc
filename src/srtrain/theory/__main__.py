"""``python -m srtrain.theory``: stall probabilities of every format and SR reset periods."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from srtrain.numerics.formats import FORMATS, get_format
from srtrain.theory.blocks import DEFAULT_BLOCK_SIZE, DEFAULT_SPREAD, block_stall_probability
from srtrain.theory.common import DEFAULT_BETAS, ROUNDINGS
from srtrain.theory.plain import DEFAULT_TOLERANCE, reset_period, rho_hat, stall_probability


def _period_text(period: int) -> str:
    return f"{period:d}" if period < 10**7 else f"{period:.1e}"


def _table(
    beta1: float, beta2: float, tolerance: float, selected: str, block_size: int
) -> list[str]:
    head = (
        f"{'format':<10}{'eps':>10}{'rho_v':>9}{'rho_m':>9}{'v NR':>8}{'v SR':>8}"
        f"{'m NR':>8}{'m SR':>8}{'block':>8}{'v NR':>8}{'v SR':>8}{'m NR':>8}{'m SR':>8}"
        f"{'reset v':>10}{'reset m':>10}"
    )
    lines = [f"{'':<44}{'plain model':-^32}{'':8}{'block model':-^32}", head]
    for name, fmt in FORMATS.items():
        plain = [
            stall_probability(fmt, beta, rounding, moment)
            for moment, beta in (("v", beta2), ("m", beta1))
            for rounding in ROUNDINGS
        ]
        block = [
            block_stall_probability(fmt, beta, rounding, moment, block_size)
            for moment, beta in (("v", beta2), ("m", beta1))
            for rounding in ROUNDINGS
        ]
        row = (
            f"{name:<10}{fmt.eps:>10.3g}{rho_hat(fmt.eps, beta2):>9.3g}"
            f"{rho_hat(fmt.eps, beta1):>9.3g}"
            + "".join(f"{p:>8.3f}" for p in plain)
            + (f"{block_size:>8d}" if fmt.scaled else f"{'-':>8}")
            + "".join(f"{p:>8.3f}" for p in block)
            + f"{_period_text(reset_period(fmt, beta2, 'stochastic', 'v', tolerance)):>10}"
            f"{_period_text(reset_period(fmt, beta1, 'stochastic', 'm', tolerance)):>10}"
        )
        lines.append(("* " if name == selected else "  ") + row)
    lines[0] = "  " + lines[0]
    lines[1] = "  " + lines[1]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print stall probabilities (plain and block models) and reset periods of every format."""
    parser = argparse.ArgumentParser(
        prog="python -m srtrain.theory",
        description="Stall probabilities (zero-mean Gaussian gradients) under the plain model "
        "(each element's grid at its own magnitude) and the block model (block-scaled "
        "formats: each element on its block's grid), and SR reset periods.",
    )
    parser.add_argument(
        "--format", default="bf16", help=f"highlighted format: {', '.join(FORMATS)}"
    )
    parser.add_argument("--beta1", type=float, default=DEFAULT_BETAS["m"], help="β of m")
    parser.add_argument("--beta2", type=float, default=DEFAULT_BETAS["v"], help="β of v")
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="elements per block scale (optim.block_size)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="expected stalled updates since a reset that end a reset period",
    )
    args = parser.parse_args(argv)
    try:
        fmt = get_format(args.format)
        lines = _table(args.beta1, args.beta2, args.tolerance, fmt.name, args.block_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"stall probabilities at beta1={args.beta1}, beta2={args.beta2}; block model: block "
        f"size {args.block_size}, within-block spread m {DEFAULT_SPREAD['m']:g} (fitted), "
        f"v {DEFAULT_SPREAD['v']:g}; reset periods: stochastic rounding, "
        f"{args.tolerance:g} expected stalled updates (plain model)"
    )
    print("\n".join(lines))

    def both(beta: float, rounding: str, moment: str) -> str:
        plain = stall_probability(fmt, beta, rounding, moment)
        if not fmt.scaled:
            return f"{plain:.3f}"
        block = block_stall_probability(fmt, beta, rounding, moment, args.block_size)
        return f"{block:.3f} (plain {plain:.3f})"

    print(
        f"{fmt.name}: eps={fmt.eps:.3g}, "
        f"P_stall v NR {both(args.beta2, 'nearest', 'v')} "
        f"SR {both(args.beta2, 'stochastic', 'v')}, "
        f"m NR {both(args.beta1, 'nearest', 'm')} "
        f"SR {both(args.beta1, 'stochastic', 'm')}; reset v every "
        f"{reset_period(fmt, args.beta2, 'stochastic', 'v', args.tolerance)} steps, m every "
        f"{reset_period(fmt, args.beta1, 'stochastic', 'm', args.tolerance)} steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
