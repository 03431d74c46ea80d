"""The import graph of the workspace's sources, read statically (every ``import`` statement, anywhere).

Used by ``test_import_graph.py``; kept apart so that the graph can be printed while refactoring
(``python tests/import_graph.py``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the declared-dependency check is skipped
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


@dataclass(frozen=True)
class Import:
    """One import statement: the module importing, the partialbayes module imported, where and how."""

    source: str
    target: str
    line: int
    type_only: bool  # inside ``if TYPE_CHECKING:``
    in_function: bool


def package_of(module: str) -> str:
    """``partialbayes.linear_sampling._io`` -> ``linear-sampling`` (the distribution's folder name)."""
    return module.split(".")[1].replace("_", "-")


def modules() -> dict[str, Path]:
    """Every module of every package's ``src``: dotted name -> file (``__init__`` as the package itself)."""
    out = {}
    for path in sorted(PACKAGES.glob("*/src/partialbayes/**/*.py")):
        src = PACKAGES / path.relative_to(PACKAGES).parts[0] / "src"
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(known: dict[str, Path]) -> list[Import]:
    """Every import of a partialbayes module by a partialbayes module (module- and function-level)."""
    return [i for name, path in known.items() for i in _module_imports(name, path, known)]


def _module_imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    out: list[Import] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(base: str, attr: str | None, line: int, type_only: bool, in_function: bool) -> None:
        if not base.startswith("partialbayes."):
            return
        target = f"{base}.{attr}" if attr else base
        while target not in known and "." in target:  # `from pkg import name`: a module or not
            target = target.rpartition(".")[0]
        if target in known and target != name:
            out.append(Import(name, target, line, type_only, in_function))

    def visit(node: ast.AST, type_only: bool, in_function: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                visit(child, True, in_function)
            for child in node.orelse:
                visit(child, type_only, in_function)
            return
        in_function = in_function or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, None, node.lineno, type_only, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                add(base, alias.name, node.lineno, type_only, in_function)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only, in_function)

    visit(ast.parse(path.read_text()), False, False)
    return out


def strongly_connected(nodes: list[str], edges: list[tuple[str, str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (the import cycles), Tarjan's way."""
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in nodes:
        if v not in index:
            connect(v)
    return found


def documented_dag(page: Path = ROOT / "docs" / "pages" / "architecture.md") -> dict[str, set[str]]:
    """The package DAG of ``docs/pages/architecture.md``: package -> the sibling packages it may import.

    Read from the first code block after the "Dependency graph" heading, lines ``name <- dep, dep, ...``;
    ``all of the above`` stands for every package listed before.
    """
    text = page.read_text()
    block = text.split("## Dependency graph", 1)[1].split("```", 2)[1]
    names = {p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists()}
    dag: dict[str, set[str]] = {}
    for line in block.splitlines():
        m = re.match(r"^(\S+)\s+<-\s+(.*)$", line)
        if not m or m.group(1) not in names:
            continue
        deps = m.group(2)
        if deps.startswith("all of the above"):
            dag[m.group(1)] = set(dag)
        else:
            dag[m.group(1)] = {d for d in re.split(r"[,\s]+", deps.split("  ")[0]) if d in names}
    return dag


def declared(package: str) -> set[str]:
    """Sibling packages in a package's ``pyproject.toml`` dependencies and extras."""
    assert tomllib is not None
    project = tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    out = set()
    for req in reqs:
        m = re.match(r"partialbayes-([a-z-]+)", req)
        if m:
            out.add(m.group(1).rstrip("-"))
    return out


if __name__ == "__main__":
    known = modules()
    found = imports(known)
    runtime = [(i.source, i.target) for i in found if not i.type_only]
    for cycle in strongly_connected(list(known), runtime):
        print("cycle:", sorted(cycle))
    for i in found:
        if package_of(i.source) != package_of(i.target) and any(
            p.startswith("_") for p in i.target.split(".")[2:]
        ):
            print("private:", i)
    print(documented_dag())
