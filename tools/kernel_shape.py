"""The shape of a tree's kernel package: line counts, longest functions, largest argument lists.

Reads every ``.py`` file under ``src/srtrain/kernels`` of a checkout (its source, not the
imported package) and prints each file's line count and total, then the ``--top``
longest functions (lines from ``def`` to their last line, decorators left out) and the
``--top`` largest argument lists (parameters of a function, ``self`` included), each as
``file:function``::

    python tools/kernel_shape.py [ROOT] [--top N]

ROOT is the checkout (default: the one holding this file).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import NamedTuple


class Function(NamedTuple):
    """A function of the kernel package: where, how many lines, how many parameters."""

    where: str
    lines: int
    parameters: int


def functions(path: Path) -> list[Function]:
    """Every function (methods and nested ones too) defined in the file at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            count += (a.vararg is not None) + (a.kwarg is not None)
            out.append(
                Function(f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1, count)
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--top", type=int, default=5, help="functions listed (default 5)")
    args = parser.parse_args(argv)
    package = Path(args.root) / "src" / "srtrain" / "kernels"
    if not package.is_dir():
        print(f"error: {package} is not a directory; pass a srtrain checkout", file=sys.stderr)
        return 2
    files = sorted(package.glob("*.py"))
    total = 0
    print("lines")
    for path in files:
        count = len(path.read_text(encoding="utf-8").splitlines())
        total += count
        print(f"  {count:6d}  {path.name}")
    print(f"  {total:6d}  total")
    found = [f for path in files for f in functions(path)]
    print("longest functions (lines)")
    for f in sorted(found, key=lambda f: -f.lines)[: args.top]:
        print(f"  {f.lines:6d}  {f.where}")
    print("largest argument lists (parameters)")
    for f in sorted(found, key=lambda f: -f.parameters)[: args.top]:
        print(f"  {f.parameters:6d}  {f.where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
