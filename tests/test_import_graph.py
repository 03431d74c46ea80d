"""The import graph of every package (issue #17), read from the sources and checked by importing.

* No import cycles, function-level imports included (a cycle hidden inside a function is still a cycle);
  imports under ``if TYPE_CHECKING:`` are not executed and do not count. The cycles known when this test
  was written are listed in `KNOWN_CYCLES` with the issue that removes them: a listed cycle that is gone
  fails the test until its entry is deleted, so the list only shrinks.
* No package imports another package's private modules (``partialbayes.<pkg>._x``), type-only imports
  included.
* Every package imports only the packages the DAG of ``docs/pages/architecture.md`` allows, and declares
  them in its ``pyproject.toml``.
* Every module of a package imports in a fresh interpreter and pulls in no package outside that package's
  part of the DAG. (A module is never imported without its package's ``__init__``, so one fresh interpreter
  per package is the unit of isolation; nox's ``isolated`` sessions check the installs themselves.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from import_graph import (
    PACKAGES,
    declared,
    documented_dag,
    imports,
    modules,
    package_of,
    strongly_connected,
    tomllib,
)

KNOWN_CYCLES: dict[frozenset[str], str] = {}

MODULES = modules()
IMPORTS = imports(MODULES)
NAMES = sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists())


def _inside(cycle: frozenset[str]) -> list[str]:
    """The import statements that close a cycle, one per line of source."""
    return sorted(
        {
            f"{i.source}:{i.line} imports {i.target}"
            + (" (in a function)" if i.in_function else "")
            for i in IMPORTS
            if not i.type_only and i.source in cycle and i.target in cycle
        }
    )


def test_no_import_cycles_but_the_known_ones():
    runtime = [(i.source, i.target) for i in IMPORTS if not i.type_only]
    cycles = set(strongly_connected(list(MODULES), runtime))
    new = [_inside(c) for c in cycles - set(KNOWN_CYCLES)]
    assert not new, f"import cycles: {new}"
    gone = [KNOWN_CYCLES[c] for c in set(KNOWN_CYCLES) - cycles]
    assert not gone, f"known cycles are gone, delete their KNOWN_CYCLES entries: {gone}"


def test_siblings_are_imported_at_module_level():
    """A package a module needs is imported where the reader sees it, not inside a function (issue #17)."""
    bad = [
        f"{i.source}:{i.line} imports {i.target} in a function"
        for i in IMPORTS
        if i.in_function and not i.type_only and package_of(i.source) != package_of(i.target)
    ]
    assert not bad


def test_no_package_imports_another_packages_private_modules():
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in IMPORTS
        if package_of(i.source) != package_of(i.target)
        and any(part.startswith("_") for part in i.target.split(".")[2:])
    ]
    assert not bad


def test_packages_import_only_what_the_documented_dag_allows():
    dag = documented_dag()
    assert set(dag) == set(NAMES), "architecture.md's dependency graph lists every package once"
    bad = sorted(
        {
            f"{package_of(i.source)} -> {package_of(i.target)} ({i.source}:{i.line})"
            for i in IMPORTS
            if package_of(i.source) != package_of(i.target)
            and package_of(i.target) not in dag[package_of(i.source)]
        }
    )
    assert not bad


@pytest.mark.skipif(tomllib is None, reason="reading pyproject.toml needs tomllib (Python >= 3.11)")
def test_packages_declare_the_siblings_they_import():
    bad = sorted(
        {
            f"{package_of(i.source)} imports {package_of(i.target)} ({i.source}:{i.line})"
            for i in IMPORTS
            if package_of(i.source) != package_of(i.target)
            and package_of(i.target) not in declared(package_of(i.source))
        }
    )
    assert not bad


def _allowed(package: str, dag: dict[str, set[str]]) -> set[str]:
    out, todo = {package}, [package]
    while todo:
        for dep in dag[todo.pop()]:
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


_FORKED_IMPORTS = """
import importlib, json, os, sys, traceback
import torch  # every package needs it: imported once, before any partialbayes module, then forked
result = {}
for package, names in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            for name in names:
                importlib.import_module(name)
            loaded = sorted({m.split(".")[1] for m in sys.modules if m.startswith("partialbayes.")})
            message = {"loaded": loaded}
        except BaseException:
            message = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(message))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as inp:
        result[package] = json.loads(inp.read() or '{"error": "the child died"}')
    os.waitpid(pid, 0)
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, dict[str, object]]:
    """Per package, a process with no partialbayes module imported yet imports every module of it.

    One fresh interpreter imports torch and forks once per package (torch costs seconds to import; the
    packages' own modules do not).
    """
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    plan = {p: [m for m in MODULES if package_of(m) == p] for p in NAMES}
    run = subprocess.run(
        [sys.executable, "-c", _FORKED_IMPORTS, json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", NAMES)
def test_every_module_imports_in_a_fresh_interpreter(package, fresh_imports):
    outcome = fresh_imports[package]
    assert "error" not in outcome, outcome.get("error")
    loaded = {name.replace("_", "-") for name in outcome["loaded"]}
    assert loaded <= _allowed(package, documented_dag()), loaded
