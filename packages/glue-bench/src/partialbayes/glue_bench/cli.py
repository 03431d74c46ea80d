"""Command-line entry point ``glue-bench``: ``run``, ``report`` and ``quickstart``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from partialbayes.glue_bench import __version__, experiment, uci
from partialbayes.glue_bench.data_glue import (
    TASKS,
    default_glue_dir,
    glue_missing_message,
    task_spec,
)
from partialbayes.glue_bench.data_uci import UCI_DATASETS, num_splits, uci_folder
from partialbayes.glue_bench.executors import EXECUTORS
from partialbayes.glue_bench.experiment import CURVATURE_PASSES, RunConfig
from partialbayes.glue_bench.figures import ramping_plot
from partialbayes.glue_bench.methods import FISHERS, METHODS, Settings
from partialbayes.glue_bench.models import DEFAULT_MODEL, minilm_path
from partialbayes.glue_bench.quickstart import (
    QUICKSTART_ARGS,
    QUICKSTART_METHODS,
    QUICKSTART_SETTINGS,
    QUICKSTART_TRAIN,
    order_rows,
    read_table,
)
from partialbayes.glue_bench.report import short_table, summarise, write_report
from partialbayes.glue_bench.store import grid_units, iter_records, parse_shard
from partialbayes.glue_bench.tables import BUDGET_TOLERANCE, col, markdown
from partialbayes.glue_bench.train import OPTIMIZERS, TrainConfig
from partialbayes.glue_bench.uci import UCI_METHODS

# `glue-bench run` without --methods: the two cheap baselines of each task kind (UCI has no temperature
# scaling, a classification method; last-layer Laplace is its cheapest calibrated alternative).
DEFAULT_METHODS = {"glue": ("map", "temperature"), "uci": ("map", "last-layer")}
# `glue-bench run` without --splits: one GLUE split (fine-tuning is the cost; the paper has 5), and the
# paper's 15 train/test splits of each UCI dataset (its appendix B: splits 0-14 of the standard folders,
# which hold 20; fewer when a folder holds fewer).
DEFAULT_SPLITS = {"glue": "0", "uci": "0-14"}
TASK_KINDS = {"glue": "GLUE", "uci": "UCI"}
# The largest split index + 1 that --splits takes: a GLUE split is the seed of a train/validation
# permutation (the paper runs 5, each one costs a fine-tuning), a UCI folder holds 20 (checked per folder).
MAX_SPLITS = 1000


def parse_splits(text: str, limit: int = MAX_SPLITS) -> list[int]:
    """``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2"`` -> [0, 2]; every split below ``limit``.

    A range is checked against ``limit`` before it is expanded, so ``0-100000000000`` is refused at once.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("--splits: empty (use e.g. 0-4 or 0,2)")
    out: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise argparse.ArgumentTypeError(
                f"--splits: cannot parse {part!r} (use e.g. 0-4 or 0,2)"
            )
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise argparse.ArgumentTypeError(f"--splits: empty range {part!r}")
        if hi >= limit:
            raise argparse.ArgumentTypeError(
                f"--splits: {part.strip()!r} goes beyond split {limit - 1} (splits are 0-{limit - 1})"
            )
        out.update(range(lo, hi + 1))
    return sorted(out)


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


def _common(p: argparse.ArgumentParser, grid: str) -> None:
    """The options of ``run`` and ``quickstart``; help shows each command's own defaults (``%(default)s``)."""
    train, settings = TrainConfig(), Settings()
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Hugging Face model name or folder (default %(default)s: the packaged MiniLM, extra 'minilm')",
    )
    p.add_argument(
        "--device", default="cuda" if _cuda() else "cpu", help="torch device (%(default)s)"
    )
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
        help="cap the training part of each split (default %(default)s; None: the paper's sizes)",
    )
    p.add_argument(
        "--max-test-examples", type=int, default=None, help="cap the test set (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="base seed (default %(default)s)")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="fine-tuning optimizer (default %(default)s; ivon also yields the 'ivon' posterior)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=train.epochs,
        help="fine-tuning epochs (default %(default)s); 0: take --model FOLDER, a classifier fine-tuned "
        "for the task, as the MAP",
    )
    p.add_argument("--lr", type=float, default=train.lr, help="AdamW learning rate (%(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=train.batch_size, help="fine-tuning batch (%(default)s)"
    )
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
        help="how Laplace methods choose the prior precision (default %(default)s)",
    )
    p.add_argument(
        "--prior-grid",
        type=_floats,
        default=None,
        help=f"prior precisions to choose from, e.g. 1e-3,1e-2,0.1,1 (default {grid} in half decades)",
    )
    p.add_argument(
        "--fisher",
        choices=FISHERS,
        default="empirical",
        help="fisher type of the KFAC / S-KFAC Laplace curvature (default %(default)s, the paper's)",
    )
    p.add_argument(
        "--curvature-pass",
        choices=CURVATURE_PASSES,
        default="shared",
        help="shared (default): one curvature pass for a whole ramp of a (task, split); per-cell: "
        "each cell its own (same records, slower)",
    )
    p.add_argument(
        "--n-samples", type=int, default=settings.n_samples, help="MC samples (%(default)s)"
    )
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
    """The ``glue-bench`` argument parser (no option may be abbreviated: ``--task`` is not ``--tasks``)."""
    parser = argparse.ArgumentParser(
        prog="glue-bench",
        description="Stochastic-subset Bayesian transformers on GLUE (Kampen et al., UAI 2024).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser(
        "run", help="fill (part of) the experiment grid in a results folder", allow_abbrev=False
    )
    run.add_argument(
        "--tasks",
        type=_names,
        default=["sst2"],
        help=f"GLUE tasks {list(TASKS)} and/or UCI datasets {list(UCI_DATASETS)} "
        "(case and hyphens ignored: SST-2, Boston; default sst2)",
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
    run.add_argument("--results", type=Path, default=Path("results"), help="results folder")
    run.add_argument(
        "--uci-dir",
        type=Path,
        default=None,
        help="folder holding bostonHousing/, energy/, yacht/ (default $PARTIALBAYES_DATA/uci)",
    )
    run.add_argument(
        "--shard",
        default=None,
        help="i/n: run every n-th (task, split) unit from the i-th (n processes share the grid)",
    )
    run.add_argument(
        "--unit",
        type=int,
        default=None,
        help="run only unit INDEX of the grid (a Slurm array task; --list-units lists them)",
    )
    run.add_argument(
        "--list-units", action="store_true", help="print the grid's units with their index and stop"
    )
    run.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="local (default): the units one after another here; ray: one Ray task per unit",
    )
    run.add_argument(
        "--ray-address",
        default=None,
        help="HOST:PORT of a running Ray cluster (default: start a local one)",
    )
    run.add_argument(
        "--take-over",
        action="store_true",
        help="take over units claimed by a process on another host that is gone",
    )
    _common(run, "10^-1 ... 10^3, the paper's")

    rep = sub.add_parser(
        "report",
        help="tables (markdown, CSV) and figures (PNG) of a results folder",
        allow_abbrev=False,
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
        help="stochastic budget of Table 2 in percent (default %(default)s)",
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

    sub.add_parser("methods", help="list the methods", allow_abbrev=False)

    quick = sub.add_parser(
        "quickstart",
        help="a CPU demo on one GLUE task: MAP, temperature scaling, last-layer and S-KFAC Laplace "
        "(about 3 min on an idle 2-core CPU: 165 s of CPU time measured; 10+ min on a busy one)",
        allow_abbrev=False,
    )
    quick.add_argument(
        "--task", default=QUICKSTART_ARGS["task"], choices=list(TASKS), help="(default %(default)s)"
    )
    quick.add_argument(
        "--split", type=int, default=0, help="which split (default 0; the how-to reports 0-2)"
    )
    quick.add_argument(
        "--results",
        type=Path,
        default=Path("glue-bench-quickstart"),
        help="results folder (default %(default)s)",
    )
    _common(quick, "10^-3 ... 10^3, the paper's grid extended down")
    quick.set_defaults(**{k: v for k, v in QUICKSTART_ARGS.items() if k != "task"})
    return parser


def _configs(args: argparse.Namespace, quick: bool = False) -> RunConfig:
    train = {"optimizer": args.optimizer, "seed": args.seed, "epochs": args.epochs, "lr": args.lr}
    train.update(batch_size=args.batch_size, max_length=args.max_length)
    settings = {"prior": args.prior, "fisher": args.fisher, "n_samples": args.n_samples}
    if quick:
        train.update(QUICKSTART_TRAIN)
        settings.update(QUICKSTART_SETTINGS)
    if args.prior_grid is not None:
        settings["prior_grid"] = args.prior_grid
    return RunConfig(
        model=args.model,
        train=TrainConfig(**train),
        settings=Settings(**settings),
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


def _splits(
    args: argparse.Namespace, plan: dict[str, tuple[list[str], list[str]]]
) -> dict[str, list[int]]:
    """The splits of each kind of task: ``--splits`` or the kind's default, UCI ones checked per folder."""
    splits = {
        kind: args.splits if args.splits is not None else parse_splits(DEFAULT_SPLITS[kind])
        for kind in plan
    }
    for name in plan.get("uci", ([], []))[0]:
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
    return splits


def cmd_run(args: argparse.Namespace) -> int:
    """``glue-bench run``: validate the whole request, then the GLUE units, then the UCI units.

    ``--list-units`` prints the (task, split) units with their index; ``--unit INDEX`` runs one of them
    (GLUE units first, then UCI), ``--shard i/n`` every n-th unit of each kind.
    """
    plan = plan_run(args.tasks, args.methods, args.optimizer)
    shard = parse_shard(args.shard)
    if args.unit is not None and args.shard is not None:
        raise ValueError("give --unit or --shard, not both")
    splits = _splits(args, plan)
    units = [(kind, t, s) for kind in plan for t, s in grid_units(plan[kind][0], splits[kind])]
    if args.list_units:
        for k, (_, task, split) in enumerate(units):
            print(f"{k}\t{task}\tsplit {split}")
        print(f"{len(units)} units; run one with --unit INDEX (Slurm: --array=0-{len(units) - 1})")
        return 0
    if args.unit is not None:
        if not 0 <= args.unit < len(units):
            raise ValueError(
                f"--unit {args.unit} is out of range: this grid has {len(units)} units "
                f"(0-{len(units) - 1}; --list-units lists them)"
            )
        kind, task, split = units[args.unit]
        plan, splits = {kind: ([task], plan[kind][1])}, {kind: [split]}
    config = _configs(args)
    where = {
        "executor": args.executor,
        "ray_address": args.ray_address,
        "take_over": args.take_over,
    }
    failures: list[str] = []
    if "glue" in plan:
        tasks, methods = plan["glue"]
        glue = experiment.run_grid(
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
            **where,
        )
        failures += glue.failures
    if "uci" in plan:
        tasks, methods = plan["uci"]
        uci_store = uci.run_uci(
            tasks,
            splits["uci"],
            methods,
            args.results / "uci",
            args.uci_dir,
            shard,
            seed=args.seed,
            device=args.device,
            keep_going=True,
            **where,
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
    if args.split < 0:
        raise ValueError(f"--split must be >= 0, got {args.split}")
    folder = args.glue_dir or default_glue_dir()
    spec = task_spec(args.task)
    if folder is None or not (Path(folder) / spec.folder).is_dir():
        print(glue_missing_message(args.task, folder), file=sys.stderr)
        return 2
    if args.model == DEFAULT_MODEL:
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
    store = experiment.run_grid(
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


STAGE_COLUMNS = [
    col("stage", "stage"),
    col("cells", "cells", align="r"),
    col("wall s", "wall", "{:.0f}", "r"),
    col("CPU s", "cpu", "{:.0f}", "r"),
]


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
    rows: dict[str, dict] = {}
    for t in timings:
        tuning = t["stage"] == "prepare"
        name = "fine-tuning" if tuning else t["stage"]
        row = rows.setdefault(name, {"stage": name, "cells": 0, "wall": 0.0, "cpu": 0.0})
        row["wall"] += t["finetune_wall"] if tuning else t["wall"]
        row["cpu"] += t["finetune_cpu"] if tuning else t["cpu"]
        row["cells"] += 1 if not tuning or t["finetune_wall"] > 0 else 0
    if rows.get("fine-tuning", {}).get("cells") == 0:
        rows["fine-tuning"]["cells"] = "cached"
    wall = max(total_wall - sum(r["wall"] for r in rows.values()), 0)
    cpu = max(total_cpu - sum(r["cpu"] for r in rows.values()), 0)
    rest = [
        {"stage": "other", "cells": "", "wall": wall, "cpu": cpu},
        {"stage": "**total**", "cells": "", "wall": total_wall, "cpu": total_cpu},
    ]
    return markdown([*rows.values(), *rest], STAGE_COLUMNS).rstrip("\n")


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
