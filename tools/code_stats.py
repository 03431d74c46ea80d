"""Size of the library source (every ``.py`` under ``packages/*/src``), measured one way at both ends of a change.

Prints lines / files, ``raise`` statements, ``isinstance(`` calls, names exported from the packages'
``__init__`` (their ``__all__``) and the functions whose body is longer than ``--long`` lines.

Usage: ``uv run --frozen python tools/code_stats.py [--long 80] [--per-file]``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=80, help="report functions with a longer body")
    parser.add_argument("--per-file", action="store_true", help="lines per package")
    args = parser.parse_args()
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    lines = raises = isinst = exports = 0
    per_pkg: dict[str, int] = {}
    long: list[tuple[int, str]] = []
    for path in files:
        text = path.read_text()
        n = len(text.splitlines())
        lines += n
        pkg = path.relative_to(ROOT).parts[1]
        per_pkg[pkg] = per_pkg.get(pkg, 0) + n
        isinst += text.count("isinstance(")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise):
                raises += 1
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                if body:
                    size = body[-1].end_lineno - body[0].lineno + 1
                    if size > args.long:
                        long.append((size, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
            elif (
                path.name == "__init__.py"
                and isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            ):
                exports += len(node.value.elts)
    print(f"lines / files: {lines} / {len(files)}")
    print(f"raise statements: {raises}")
    print(f"isinstance( calls: {isinst}")
    print(f"exported names (__all__): {exports}")
    print(f"functions with a body over {args.long} lines: {len(long)}")
    for size, where in sorted(long, reverse=True):
        print(f"  {size:4d} {where}")
    if args.per_file:
        for pkg, n in sorted(per_pkg.items()):
            print(f"  {pkg}: {n}")


if __name__ == "__main__":
    main()
