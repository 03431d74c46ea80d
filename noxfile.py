"""Developer sessions for the partialbayes workspace (``nox -l`` lists them).

* ``tests(package='<pkg>')``: a package's tests in the whole-workspace environment (``uv sync --all-packages``).
* ``isolated(package='<pkg>')``: build the package's wheel (and its sibling wheels), install it ALONE with only its
  declared dependencies into a fresh venv, run its tests there: proof that one sub-package installs by itself.
* ``slow``: the tests marked ``slow`` (excluded from the default suite).
* ``graph``: the workspace-wide tests of ``tests/`` (the import graph: no cycles, no private imports across
  packages, the package DAG of ``docs/pages/architecture.md``, every module importable in a fresh process).
* ``torch_matrix(torch='oldest'|'newest')``: the whole suite against the oldest torch we support and the newest on PyPI.
* ``cuda(variant='cu126'|'cu128'|'cu130')``: the suite against torch from PyTorch's per-CUDA wheel index; skips, saying why, on a
  machine without an NVIDIA GPU or without access to that index.
* ``lint``, ``types``, ``docs`` (strict build), ``bench`` (benchmark harness with peers; not part of CI),
  ``release-check`` (version bump + changelog entry since the last tag of each package).
"""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import nox
import tomllib

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "graph", "docs"]

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
OLDEST_TORCH = "2.4.1"
OLDEST_TRANSFORMERS = "4.45.2"
CUDA_VARIANTS = ["cu126", "cu128", "cu130"]
TEST_TOOLS = ["pytest>=8.0", "hypothesis>=6.100", "numpy>=1.26", "scipy>=1.11"]


def _pyproject(pkg: str) -> dict:
    return tomllib.loads((ROOT / "packages" / pkg / "pyproject.toml").read_text())


def _dist_name(pkg: str) -> str:
    return f"partialbayes-{pkg}"


def _sibling_requirements(reqs: list[str]) -> set[str]:
    out = set()
    for req in reqs:
        name = req.split(";")[0].split("[")[0]
        for op in ("<", ">", "=", "!", "~", " "):
            name = name.split(op)[0]
        if name.startswith("partialbayes-"):
            out.add(name.removeprefix("partialbayes-"))
    return out


def _test_group(pkg: str) -> list[str]:
    return [
        r
        for r in _pyproject(pkg).get("dependency-groups", {}).get("test", [])
        if isinstance(r, str)
    ]


def _closure(pkg: str) -> list[str]:
    """The package and every sibling it (or its tests, or its extras) needs, to be built as wheels."""
    todo, seen = [pkg], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        data = _pyproject(cur)["project"]
        reqs = list(data.get("dependencies", []))
        for extra in data.get("optional-dependencies", {}).values():
            reqs += extra
        if cur == pkg:
            reqs += _test_group(cur)
        todo += sorted(_sibling_requirements(reqs) - seen)
    return sorted(seen)


def _build_wheels(session: nox.Session, packages: list[str]) -> Path:
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for pkg in packages:
        session.run(
            "uv",
            "build",
            "--package",
            _dist_name(pkg),
            "--wheel",
            "-o",
            str(dist),
            "--quiet",
            external=True,
        )
    return dist


def _fresh(packages: list[str]) -> list[str]:
    """uv flags that install our freshly built wheels, not cached ones of the same name.

    The wheels keep their version between releases, and uv caches a local wheel by its name: without a
    refresh, a second run of a session installs the code of the first.
    """
    return [f"--refresh-package={_dist_name(p)}" for p in packages]


def _wheel(dist: Path, pkg: str) -> str:
    (wheel,) = dist.glob(f"partialbayes_{pkg.replace('-', '_')}-*.whl")
    return str(wheel)


def _sync_workspace(session: nox.Session, *groups: str) -> None:
    args = ["uv", "sync", "--all-packages", "--all-extras", "--frozen"]
    for group in groups:
        args += ["--group", group]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location})


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's default test suite in the workspace environment."""
    _sync_workspace(session)
    session.run("pytest", f"packages/{package}", *session.posargs)


@nox.session
def graph(session: nox.Session) -> None:
    """The workspace-wide tests of ``tests/``: the import graph of every package."""
    _sync_workspace(session)
    session.run("pytest", "tests", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The tests marked ``slow``."""
    _sync_workspace(session)
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES)
def isolated(session: nox.Session, package: str) -> None:
    """Install one package's wheel alone (siblings from local wheels) and run its tests there."""
    dist = _build_wheels(session, _closure(package))
    extras = _pyproject(package)["project"].get("optional-dependencies", {})
    target = _wheel(dist, package) + (f"[{','.join(sorted(extras))}]" if extras else "")
    session.install(
        "--find-links",
        str(dist),
        *_fresh(_closure(package)),
        target,
        *TEST_TOOLS,
        *_test_group(package),
    )
    # pytest runs with --import-mode=importlib, so packages/*/src is never put on sys.path: the tests import the
    # installed wheel (printed below as proof).
    session.run(
        "python", "-c", f"import partialbayes.{package.replace('-', '_')} as m; print(m.__file__)"
    )
    session.run("pytest", f"packages/{package}/tests", "-p", "no:cacheprovider", *session.posargs)


def _matrix_env(session: nox.Session, torch_req: list[str]) -> None:
    dist = _build_wheels(session, PACKAGES)
    wheels = [_wheel(dist, p) for p in PACKAGES]
    session.install(
        "--find-links",
        str(dist),
        *_fresh(PACKAGES),
        *torch_req,
        *wheels,
        *TEST_TOOLS,
        "safetensors",
        "matplotlib",
    )


@nox.session
@nox.parametrize("torch", ["oldest", "newest"])
def torch_matrix(session: nox.Session, torch: str) -> None:
    """The whole suite against the oldest supported torch and the newest one on PyPI."""
    # The oldest torch pairs with the oldest transformers we declare: recent transformers releases refuse
    # old torch versions (transformers 5 disables PyTorch < 2.6), so the floors must be tested together.
    req = (
        [f"torch=={OLDEST_TORCH}", f"transformers=={OLDEST_TRANSFORMERS}"]
        if torch == "oldest"
        else ["--upgrade", "torch", "transformers"]
    )
    _matrix_env(session, req)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", *session.posargs)


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


@nox.session
@nox.parametrize("variant", CUDA_VARIANTS)
def cuda(session: nox.Session, variant: str) -> None:
    """The suite against a CUDA build of torch from PyTorch's wheel index for ``variant``."""
    if shutil.which("nvidia-smi") is None:
        session.skip(
            f"{variant}: no NVIDIA GPU here (nvidia-smi not found); run this session on a GPU machine"
        )
    index = f"https://download.pytorch.org/whl/{variant}"
    if not _reachable(index + "/torch/"):
        session.skip(
            f"{variant}: the PyTorch wheel index {index} cannot be reached from this machine"
        )
    _matrix_env(
        session, ["--index-url", index, "--extra-index-url", "https://pypi.org/simple", "torch"]
    )
    session.run(
        "python", "-c", "import torch; assert torch.cuda.is_available(), 'CUDA torch sees no GPU'"
    )
    session.run("pytest", *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.run("uv", "run", "--frozen", "ruff", "check", ".")
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _sync_workspace(session)
    paths = [f"packages/{p}/src" for p in PACKAGES]
    session.run("mypy", *paths, env={"MYPYPATH": ":".join(paths)})


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly (any warning fails)."""
    _sync_workspace(session)
    session.run("mkdocs", "build", "--strict", "-f", "docs/mkdocs.yml", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmark harness (peers installed) and rewrite docs/pages/benchmarks.md."""
    _sync_workspace(session, "peers")
    session.run("python", "tools/bench.py", *session.posargs)


@nox.session(venv_backend="none", name="release-check")
def release_check(session: nox.Session) -> None:
    """Fail when a package's src/ changed since its last tag without a version bump and changelog entry."""
    session.run("python3", "tools/release_check.py", *session.posargs)
