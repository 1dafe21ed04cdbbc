"""``srtrain COMMAND ...`` (or ``python -m srtrain COMMAND ...``): every command a user runs.

Each command hands its arguments to the module that owns it, imported only when chosen, so
``srtrain --help`` is instant. Under torchrun: ``torchrun ... -m srtrain train ...``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Command(NamedTuple):
    """A command: the module whose ``main(argv)`` runs it, a fixed argv prefix, a summary."""

    module: str
    prefix: tuple[str, ...]
    summary: str


COMMANDS: dict[str, Command] = {
    "train": Command(
        "srtrain.cli", (), "train or resume a run: [--config FILE] [section.key=value ...]"
    ),
    "prepare": Command(
        "srtrain.data.cli", ("prepare",), "tokenize a text source into a data directory"
    ),
    "merge": Command(
        "srtrain.data.cli", ("merge",), "join the parts prepared with prepare --part i/N"
    ),
    "plan": Command("srtrain.plan", (), "bytes per GPU of a config and mesh, before a run"),
    "export": Command("srtrain.export", (), "write a checkpoint as a Hugging Face model directory"),
    "eval": Command(
        "srtrain.eval", (), "validation loss and perplexity of a checkpoint or an HF model"
    ),
    "theory": Command(
        "srtrain.theory.__main__", (), "stall probabilities and reset periods of each format"
    ),
    "bench": Command(
        "srtrain.bench.__main__", (), "the headline table and guard, the capacity ladder"
    ),
}


def usage() -> str:
    """The help text: one line per command."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: srtrain COMMAND [ARGS ...]   (python -m srtrain COMMAND ...)",
        "",
        "commands:",
        *(f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()),
        "",
        "srtrain COMMAND --help describes each one.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen command with the rest of the arguments; its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(
            f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)} "
            "(srtrain --help lists them)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(command.module)
    return module.main([*command.prefix, *rest])


if __name__ == "__main__":
    sys.exit(main())
