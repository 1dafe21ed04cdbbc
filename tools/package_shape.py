"""The shape of a checkout's ``srtrain`` package: modules, import cycles, long functions.

Reads every ``.py`` file under ``src/srtrain`` of a checkout (its source, not the imported
package) and prints the number of modules and lines, the import edges between srtrain
modules (lazy imports inside functions included), the groups of modules that import one
another in a circle, and the ``--top`` longest functions and largest argument lists
(``self`` and ``cls`` left out)::

    python tools/package_shape.py [ROOT] [--top N]

ROOT is the checkout (default: the one holding this file).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def modules(src: Path) -> dict[str, Path]:
    """Every module of ``src/srtrain`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((src / "srtrain").rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """For each module, the srtrain modules it imports (not its own parent packages)."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in targets:
                module = owner(target) if target.startswith("srtrain") else None
                if module and module != name and not name.startswith(module + "."):
                    edges[name].add(module)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that reach one another (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def functions(mods: dict[str, Path]) -> list[tuple[int, int, str]]:
    """(lines, parameters, ``module.function``) of every function."""
    out = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
                count -= bool(params) and params[0].arg in ("self", "cls")
                lines = node.end_lineno - node.lineno + 1
                out.append((lines, count, f"{name}.{node.name}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args(argv)
    mods = modules(args.root / "src")
    edges = import_edges(mods)
    lines = sum(len(p.read_text().splitlines()) for p in mods.values())
    print(f"modules {len(mods)}, lines {lines}, import edges {sum(map(len, edges.values()))}")
    groups = cycles(edges)
    print(f"import cycles: {len(groups)}")
    for group in groups:
        print("  " + ", ".join(group))
    funcs = functions(mods)
    longest = sorted(funcs, key=lambda f: (-f[0], f[2]))[: args.top]
    widest = sorted(funcs, key=lambda f: (-f[1], f[2]))[: args.top]
    print("longest functions: " + "; ".join(f"{n} {name}" for n, _, name in longest))
    print("largest argument lists: " + "; ".join(f"{k} {name}" for _, k, name in widest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
