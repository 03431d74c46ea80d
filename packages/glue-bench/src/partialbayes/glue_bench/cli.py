"""Command-line entry point ``glue-bench``: ``run``, ``report`` and ``quickstart``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from partialbayes.glue_bench import __version__
from partialbayes.glue_bench.data_glue import TASKS, default_glue_dir, glue_missing_message
from partialbayes.glue_bench.data_uci import UCI_DATASETS
from partialbayes.glue_bench.experiment import CURVATURE_PASSES
from partialbayes.glue_bench.methods import FISHERS, METHODS, Settings
from partialbayes.glue_bench.models import DEFAULT_MODEL
from partialbayes.glue_bench.quickstart import (
    QUICKSTART_ARGS,
    QUICKSTART_METHODS,
    QUICKSTART_SETTINGS,
    QUICKSTART_TRAIN,
)
from partialbayes.glue_bench.tables import BUDGET_TOLERANCE
from partialbayes.glue_bench.train import OPTIMIZERS, TrainConfig

# `glue-bench run` without --methods: the two cheap baselines of each task kind (UCI has no temperature
# scaling, a classification method; last-layer Laplace is its cheapest calibrated alternative).
DEFAULT_METHODS = {"glue": ("map", "temperature"), "uci": ("map", "last-layer")}
# `glue-bench run` without --splits: one GLUE split (fine-tuning is the cost; the paper has 5), and the
# paper's 15 train/test splits of each UCI dataset (its appendix B: splits 0-14 of the standard folders,
# which hold 20; fewer when a folder holds fewer).
DEFAULT_SPLITS = {"glue": "0", "uci": "0-14"}
TASK_KINDS = {"glue": "GLUE", "uci": "UCI"}


def parse_splits(text: str) -> list[int]:
    """``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2"`` -> [0, 2]."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--splits: empty (use e.g. 0-4 or 0,2)")
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise argparse.ArgumentTypeError(
                f"--splits: cannot parse {part!r} (use e.g. 0-4 or 0,2)"
            )
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise argparse.ArgumentTypeError(f"--splits: empty range {part!r}")
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def _names(text: str) -> list[str]:
    names = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not names:
        raise argparse.ArgumentTypeError(f"empty list {text!r}: name at least one")
    return names


def _floats(text: str) -> tuple[float, ...]:
    """``"0.01,0.1,1"`` -> (0.01, 0.1, 1.0)."""
    try:
        values = tuple(float(t) for t in _names(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"cannot parse {text!r} as numbers ({err})") from None
    return values


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Hugging Face model name or folder; default: the packaged MiniLM (extra 'minilm')",
    )
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="torch device")
    p.add_argument(
        "--glue-dir",
        type=Path,
        default=None,
        help="folder holding SST-2/, MRPC/, RTE/ (default $PARTIALBAYES_DATA/glue)",
    )
    p.add_argument(
        "--max-train-examples",
        type=int,
        default=None,
        help="cap the training part of each split (default: the paper's sizes)",
    )
    p.add_argument("--max-test-examples", type=int, default=None, help="cap the test set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="fine-tuning optimizer (ivon also yields the 'ivon' posterior)",
    )
    p.add_argument("--epochs", type=int, default=None, help="fine-tuning epochs (default 10)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="max tokens (default: the model's limit, so nothing is truncated, as in the paper)",
    )
    p.add_argument(
        "--prior",
        choices=("val_nll", "marglik"),
        default="val_nll",
        help="how Laplace methods choose the prior precision",
    )
    p.add_argument(
        "--prior-grid",
        type=_floats,
        default=None,
        help="prior precisions to choose from, e.g. 1e-3,1e-2,0.1,1 (default: the paper's "
        "10^-1 ... 10^3 in half decades)",
    )
    p.add_argument(
        "--fisher",
        choices=FISHERS,
        default="empirical",
        help="fisher type of the KFAC / S-KFAC Laplace curvature (default empirical, the paper's)",
    )
    p.add_argument(
        "--curvature-pass",
        choices=CURVATURE_PASSES,
        default="shared",
        help="shared (default): one curvature pass for a whole ramp of a (task, split); per-cell: "
        "each cell its own (same records, slower)",
    )
    p.add_argument("--n-samples", type=int, default=None, help="MC samples (default 50)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def build_parser() -> argparse.ArgumentParser:
    """The ``glue-bench`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="glue-bench",
        description="Stochastic-subset Bayesian transformers on GLUE (Kampen et al., UAI 2024).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="fill (part of) the experiment grid in a results folder")
    run.add_argument(
        "--tasks",
        type=_names,
        default=["sst2"],
        help=f"GLUE tasks {list(TASKS)} and/or UCI datasets {list(UCI_DATASETS)} "
        "(case and hyphens ignored: SST-2, Boston)",
    )
    run.add_argument(
        "--methods",
        type=_names,
        default=None,
        help="methods (see `glue-bench methods`); default: "
        + "; ".join(f"{','.join(v)} for {TASK_KINDS[k]} tasks" for k, v in DEFAULT_METHODS.items()),
    )
    run.add_argument(
        "--splits",
        type=parse_splits,
        default=None,
        help=f"e.g. 0-4 (default: {DEFAULT_SPLITS['glue']} for GLUE tasks, "
        f"{DEFAULT_SPLITS['uci']} for UCI datasets, the paper's 15)",
    )
    run.add_argument(
        "--shard", default=None, help="i/n: run the i-th of n disjoint parts of the grid"
    )
    run.add_argument("--results", type=Path, default=Path("results"), help="results folder")
    run.add_argument(
        "--uci-dir",
        type=Path,
        default=None,
        help="folder holding bostonHousing/, energy/, yacht/ (default $PARTIALBAYES_DATA/uci)",
    )
    _common(run)

    rep = sub.add_parser(
        "report", help="tables (markdown, CSV) and figures (PNG) of a results folder"
    )
    rep.add_argument(
        "results_dir", nargs="?", type=Path, default=None, metavar="RESULTS", help="results folder"
    )
    rep.add_argument("--results", type=Path, default=None, help="results folder (default results)")
    rep.add_argument(
        "--out", type=Path, default=None, help="output folder (default <results>/report)"
    )
    rep.add_argument(
        "--budget",
        type=float,
        default=10.0,
        help="stochastic budget of Table 2 in percent (default 10)",
    )
    rep.add_argument(
        "--budget-tolerance",
        type=float,
        default=BUDGET_TOLERANCE,
        help=f"relative slack of the budget, '≈' (default {BUDGET_TOLERANCE:g}: up to 11.5 %% for 10 %%)",
    )
    rep.add_argument(
        "--calibration-methods",
        type=_names,
        default=None,
        help="methods of the calibration figure (default: map, temperature and the 4 best by NLL)",
    )

    sub.add_parser("methods", help="list the methods")

    quick = sub.add_parser(
        "quickstart",
        help="a CPU demo on one GLUE task: MAP, temperature scaling, last-layer and S-KFAC Laplace "
        "(about 3 min on an idle 2-core CPU: 165 s of CPU time measured; 10+ min on a busy one)",
    )
    quick.add_argument("--task", default=QUICKSTART_ARGS["task"], choices=list(TASKS))
    quick.add_argument(
        "--split", type=int, default=0, help="which split (default 0; the how-to reports 0-2)"
    )
    quick.add_argument("--results", type=Path, default=Path("glue-bench-quickstart"))
    _common(quick)
    quick.set_defaults(**{k: v for k, v in QUICKSTART_ARGS.items() if k != "task"})
    return parser


def _configs(args: argparse.Namespace, quick: bool = False):
    from partialbayes.glue_bench.experiment import RunConfig

    train_kw: dict = {"optimizer": args.optimizer, "seed": args.seed}
    if quick:
        train_kw.update(QUICKSTART_TRAIN)
    if args.epochs is not None:
        train_kw["epochs"] = args.epochs
    if args.max_length is not None:
        train_kw["max_length"] = args.max_length
    settings_kw: dict = {"prior": args.prior, "fisher": args.fisher}
    if quick:
        settings_kw.update(QUICKSTART_SETTINGS)
    if args.prior_grid is not None:
        settings_kw["prior_grid"] = args.prior_grid
    if args.n_samples is not None:
        settings_kw["n_samples"] = args.n_samples
    return RunConfig(
        model=args.model,
        train=TrainConfig(**train_kw),
        settings=Settings(**settings_kw),
        max_train_examples=args.max_train_examples,
        max_test_examples=args.max_test_examples,
        seed=args.seed,
        curvature_pass=args.curvature_pass,
    )


def resolve_task(name: str) -> tuple[str, str]:
    """Kind (``"glue"`` or ``"uci"``) and canonical name of a ``--tasks`` entry.

    The one place task names are normalised: case and hyphens are ignored (``SST-2`` -> ``sst2``,
    ``Boston`` -> ``boston``), and a UCI dataset may also be named by its folder (``bostonHousing``).

    Raises:
        ValueError: An unknown name (the message lists the valid ones).
    """
    key = name.strip().lower().replace("-", "")
    if key in TASKS:
        return "glue", key
    uci = {**{k: k for k in UCI_DATASETS}, **{v.lower(): k for k, v in UCI_DATASETS.items()}}
    if key in uci:
        return "uci", uci[key]
    raise ValueError(
        f"unknown task(s) [{name!r}]; valid tasks: {', '.join([*TASKS, *UCI_DATASETS])}"
    )


def plan_run(
    tasks: Sequence[str], methods: Sequence[str] | None, optimizer: str = "adamw"
) -> dict[str, tuple[list[str], list[str]]]:
    """Check every (task kind, method) combination of ``glue-bench run`` before any work starts.

    Args:
        tasks: ``--tasks`` entries (normalised by :func:`resolve_task`).
        methods: ``--methods``, or ``None`` for the defaults of each task kind (:data:`DEFAULT_METHODS`).
        optimizer: The fine-tuning optimizer (the ``ivon`` method needs ``ivon``).

    Returns:
        ``{kind: (canonical tasks, methods)}`` for the kinds present, in the order given.

    Raises:
        ValueError: Unknown tasks or methods, or methods without a version for a kind of task that was
            asked for (one line per kind, listing that kind's valid methods).
    """
    from partialbayes.glue_bench.uci import UCI_METHODS

    valid = {"glue": list(METHODS), "uci": list(UCI_METHODS)}
    by_kind: dict[str, list[str]] = {}
    unknown = []
    for t in tasks:
        try:
            kind, name = resolve_task(t)
        except ValueError:
            unknown.append(t)
            continue
        if name not in by_kind.setdefault(kind, []):
            by_kind[kind].append(name)
    if unknown:
        raise ValueError(
            f"unknown task(s) {unknown}; valid tasks: {', '.join([*TASKS, *UCI_DATASETS])}"
        )
    if methods is not None:
        bad = [m for m in methods if m not in METHODS and m not in UCI_METHODS]
        if bad:
            raise ValueError(
                f"unknown method(s) {bad}; valid methods: {', '.join(METHODS)} "
                f"(UCI: {', '.join(UCI_METHODS)})"
            )
    plan: dict[str, tuple[list[str], list[str]]] = {}
    errors = []
    for kind, names in by_kind.items():
        chosen = list(DEFAULT_METHODS[kind]) if methods is None else list(dict.fromkeys(methods))
        bad = [m for m in chosen if m not in valid[kind]]
        if bad:
            errors.append(
                f"method(s) {bad} have no {TASK_KINDS[kind]} version (tasks {', '.join(names)}); "
                f"valid {TASK_KINDS[kind]} methods: {', '.join(valid[kind])}"
            )
        if kind == "glue" and "ivon" in chosen and optimizer != "ivon":
            errors.append(
                "method 'ivon' needs --optimizer ivon (its posterior comes from fine-tuning)"
            )
        plan[kind] = (names, chosen)
    if errors:
        raise ValueError("; ".join(errors))
    return plan


def cmd_run(args: argparse.Namespace) -> int:
    """``glue-bench run``: validate the whole request, then the GLUE grid, then the UCI grid."""
    from partialbayes.glue_bench.experiment import run_grid
    from partialbayes.glue_bench.store import parse_shard

    plan = plan_run(args.tasks, args.methods, args.optimizer)
    shard = parse_shard(args.shard)
    splits = {
        kind: args.splits if args.splits is not None else parse_splits(DEFAULT_SPLITS[kind])
        for kind in plan
    }
    if "uci" in plan:
        from partialbayes.glue_bench.data_uci import num_splits, uci_folder

        for name in plan["uci"][0]:
            folder = uci_folder(name, args.uci_dir)
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"UCI data for {name} not found: no folder {folder} (pass --uci-dir /path/to/uci, "
                    f"a folder holding {UCI_DATASETS[name]}/data/)"
                )
            n = num_splits(name, args.uci_dir)
            if args.splits is None:
                splits["uci"] = [k for k in splits["uci"] if k < n]
            if any(k >= n for k in splits["uci"]):
                raise ValueError(
                    f"--splits {[k for k in splits['uci'] if k >= n]} out of range for UCI dataset "
                    f"{name} ({n} splits: 0-{n - 1})"
                )
    config = _configs(args)
    failures: list[str] = []
    if "glue" in plan:
        tasks, methods = plan["glue"]
        store = run_grid(
            tasks,
            splits["glue"],
            methods,
            config,
            args.results,
            args.device,
            args.glue_dir,
            shard,
            progress=not args.no_progress,
            keep_going=True,
        )
        failures += store.failures
    if "uci" in plan:
        from partialbayes.glue_bench.uci import run_uci

        tasks, methods = plan["uci"]
        uci_store = run_uci(
            tasks,
            splits["uci"],
            methods,
            args.results / "uci",
            args.uci_dir,
            shard,
            seed=args.seed,
            device=args.device,
            keep_going=True,
        )
        failures += uci_store.failures
    print(f"results in {args.results}; summarise with: glue-bench report --results {args.results}")
    return _report_failures(failures)


def _report_failures(failures: list[str]) -> int:
    if not failures:
        return 0
    print(f"{len(failures)} cell(s) failed (rerun to retry them):", file=sys.stderr)
    for f in failures:
        print(f"  {f}", file=sys.stderr)
    return 1


def cmd_report(args: argparse.Namespace) -> int:
    """``glue-bench report``."""
    from partialbayes.glue_bench.report import write_report

    if args.results_dir is not None and args.results is not None:
        raise ValueError("give the results folder once: either RESULTS or --results")
    results = args.results_dir or args.results or Path("results")
    out = write_report(
        results,
        args.out,
        budget=args.budget,
        calibration_methods=args.calibration_methods,
        budget_tolerance=args.budget_tolerance,
    )
    print(out["markdown"])
    for f in out["files"]:
        print(f"wrote {f}")
    for s in out["skipped"]:
        print(f"skipped {s}")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """``glue-bench quickstart``: fine-tune on a subsample, compare four methods, print, plot and read."""
    from partialbayes.glue_bench.data_glue import task_spec
    from partialbayes.glue_bench.experiment import run_grid
    from partialbayes.glue_bench.quickstart import order_rows, read_table
    from partialbayes.glue_bench.report import ramping_plot, short_table, summarise
    from partialbayes.glue_bench.store import iter_records

    if args.split < 0:
        raise ValueError(f"--split must be >= 0, got {args.split}")
    folder = args.glue_dir or default_glue_dir()
    spec = task_spec(args.task)
    if folder is None or not (Path(folder) / spec.folder).is_dir():
        print(glue_missing_message(args.task, folder), file=sys.stderr)
        return 2
    if args.model == DEFAULT_MODEL:
        from partialbayes.glue_bench.models import minilm_path

        try:
            minilm_path()
        except ImportError as err:
            print(str(err), file=sys.stderr)
            return 2
    config = _configs(args, quick=True)
    start = time.perf_counter()
    print(
        f"glue-bench quickstart: {args.task} split {args.split}, model {args.model}, "
        f"{args.max_train_examples} training examples, {config.train.epochs} epochs, "
        f"{args.max_test_examples} test examples, device {args.device}; results in {args.results}"
    )
    cpu_start = time.process_time()
    timings: list[dict] = []
    store = run_grid(
        [args.task],
        [args.split],
        list(QUICKSTART_METHODS),
        config,
        args.results,
        args.device,
        folder,
        progress=not args.no_progress,
        keep_going=True,
        timings=timings,
    )
    records = [
        r
        for r in iter_records(args.results)
        if r["task"] == args.task and r["split"] == args.split and r["method"] in QUICKSTART_METHODS
    ]
    print()
    print(short_table(order_rows(summarise(records))))
    args.results.mkdir(parents=True, exist_ok=True)
    plot = args.results / f"{args.task}_split{args.split}_ramping_nll.png"
    if ramping_plot(summarise(records), args.task, plot):
        print(f"wrote {plot}")
    print()
    print(stage_table(timings, time.perf_counter() - start, time.process_time() - cpu_start))
    print(
        f"finished in {time.perf_counter() - start:.0f} s; full tables: "
        f"glue-bench report --results {args.results}"
    )
    if any(r["method"] == "map" for r in records):
        print()
        print(read_table(records))
    return _report_failures(store.failures)


def stage_table(timings: list[dict], total_wall: float, total_cpu: float) -> str:
    """Markdown table of where the time went: setup, fine-tuning, each method (its cells summed).

    Args:
        timings: The stage dicts collected by ``run_grid(..., timings=...)``.
        total_wall: Wall-clock seconds of the whole command.
        total_cpu: Process CPU seconds of the whole command (all threads).

    Returns:
        The table; ``other`` is the rest (reading data, tokenising, loading the model, tables, plots).
        CPU time counts every thread, so on a busy machine it estimates the cost better than wall time.
    """
    rows: dict[str, list[float]] = {}
    for t in timings:
        if t["stage"] == "prepare":
            ft = rows.setdefault("fine-tuning", [0.0, 0.0, 0])
            ft[0] += t["finetune_wall"]
            ft[1] += t["finetune_cpu"]
            ft[2] += 1 if t["finetune_wall"] > 0 else 0
            continue
        row = rows.setdefault(t["stage"], [0.0, 0.0, 0])
        row[0] += t["wall"]
        row[1] += t["cpu"]
        row[2] += 1
    lines = ["| stage | cells | wall s | CPU s |", "|---|---:|---:|---:|"]
    for name, (wall, cpu, n) in rows.items():
        cells = "cached" if name == "fine-tuning" and n == 0 else str(n)
        lines.append(f"| {name} | {cells} | {wall:.0f} | {cpu:.0f} |")
    used_wall = sum(r[0] for r in rows.values())
    used_cpu = sum(r[1] for r in rows.values())
    lines.append(
        f"| other | | {max(total_wall - used_wall, 0):.0f} | {max(total_cpu - used_cpu, 0):.0f} |"
    )
    lines.append(f"| **total** | | {total_wall:.0f} | {total_cpu:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``glue-bench``; returns the process exit status.

    An unknown option is reported with the usage of the subcommand it was given to (``glue-bench run
    --bogus`` prints ``run``'s usage, not the top-level one), exit status 2.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparsers(parser).get(args.command) if args.command else None
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    os.environ.setdefault("MPLBACKEND", "Agg")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "methods":
        for m in METHODS.values():
            print(f"{m.name:16s} {m.description}")
        return 0
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "report":
            return cmd_report(args)
        return cmd_quickstart(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"glue-bench: error: {err}", file=sys.stderr)
        return 2
