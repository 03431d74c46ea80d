"""Run the per-package benchmarks and write JSON plus the markdown table of ``docs/pages/benchmarks.md``.

Usage::

    uv run --frozen python tools/bench.py                   # every package, full sizes
    uv run --frozen python tools/bench.py --package curvature --quick
    uv run --frozen python tools/bench.py --render bench-results/results.json   # page from a stored run
    nox -s bench                                            # the same, with the peers installed

Each ``packages/<pkg>/benchmarks/bench_*.py`` module is imported and every ``bench_*`` function in it is
called with a :class:`benchharness.Bench`. A benchmark that raises is reported as failed and the run goes on.
Results are written atomically after every benchmark (an interrupted run keeps what it measured); the docs
table is replaced between its markers at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchharness import Bench, markdown_table, rows_to_dicts

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "pages" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
#: The peers' distributions, whose versions a run records (absent ones are left out).
PEERS = ("laplace-torch", "curvlinops-for-pytorch", "ivon-opt", "posteriors", "transformers")


def machine() -> dict[str, str]:
    """Describe where the numbers were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": str(torch.get_num_threads()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for dist in PEERS:
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return info


def discover(packages: list[str] | None) -> list[tuple[str, Path]]:
    """``(package, module path)`` for every benchmark module, in package order."""
    found = []
    for pkg_dir in sorted((ROOT / "packages").iterdir()):
        if packages and pkg_dir.name not in packages:
            continue
        for mod in sorted((pkg_dir / "benchmarks").glob("bench_*.py")):
            found.append((pkg_dir.name, mod))
    return found


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def render_page(results: dict) -> str:
    """The generated part of the benchmarks page."""
    m = results["machine"]
    head = [
        f"Measured {results['date']} on {m['cpu']} ({m['cores']} cores"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + f"), torch {m['torch']}, device `{results['device']}`"
        + (", quick sizes" if results["quick"] else "")
        + ".",
        "",
    ]
    peers = [f"{d} {m[d]}" for d in PEERS if d in m]
    if peers:
        head += ["Peers and libraries: " + ", ".join(peers) + ".", ""]
    if results["failed"]:
        head += ["Failed benchmarks: " + ", ".join(f"`{f}`" for f in results["failed"]), ""]
    return "\n".join(head) + "\n" + markdown_table(results["rows"])


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (1 when a benchmark failed)."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--package", action="append", help="only this package (repeatable)")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS",
        help="run nothing: rewrite docs/pages/benchmarks.md from a stored results JSON",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--only",
        action="append",
        help="only bench_* functions whose name contains this (repeatable)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "results.json")
    parser.add_argument(
        "--no-docs", action="store_true", help="do not rewrite docs/pages/benchmarks.md"
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        try:
            stored = json.loads(args.render.read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--render {args.render}: not a readable results JSON ({err})")
        missing = {"date", "machine", "device", "quick", "failed", "rows"} - set(stored)
        if missing:
            parser.error(
                f"--render {args.render}: not a tools/bench.py results file (no {sorted(missing)})"
            )
        write_page(stored)
        return 0

    modules = discover(args.package)
    if not modules:
        print("no benchmark modules found", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows, failed = [], []

    def snapshot() -> dict:
        results = {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "device": str(device),
            "quick": args.quick,
            "failed": failed,
            "rows": rows_to_dicts(rows),
        }
        atomic_write(args.out, json.dumps(results, indent=2))
        return results

    for pkg, path in modules:
        spec = importlib.util.spec_from_file_location(f"bench_{pkg}_{path.stem}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:
            traceback.print_exc()
            failed.append(f"{pkg}/{path.name}")
            continue
        for name in sorted(
            n
            for n in dir(module)
            if n.startswith("bench_")
            and callable(getattr(module, n))
            and (not args.only or any(o in n for o in args.only))
        ):
            print(f"== {pkg}: {path.name}::{name}")
            bench = Bench(package=pkg, device=device, quick=args.quick, repeat=args.repeat)
            try:
                getattr(module, name)(bench)
            except Exception:
                traceback.print_exc()
                failed.append(f"{pkg}/{path.name}::{name}")
            rows.extend(bench.rows)
            results = snapshot()  # after every benchmark: an interrupted run keeps what it measured
    results = snapshot()
    print(f"wrote {args.out}")
    if not args.no_docs:
        write_page(results)
    return 1 if failed else 0


def write_page(results: dict) -> None:
    """Replace the generated part of the benchmarks page (between its markers) by ``results``."""
    page = DOCS_PAGE.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{DOCS_PAGE} lacks the markers {BEGIN} / {END}")
    pre, rest = page.split(BEGIN, 1)
    post = rest.split(END, 1)[1]
    atomic_write(DOCS_PAGE, f"{pre}{BEGIN}\n{render_page(results)}\n{END}{post}")
    print(f"updated {DOCS_PAGE}")


if __name__ == "__main__":
    raise SystemExit(main())
