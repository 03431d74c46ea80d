"""Command-line entry point ``glue-bench``: ``run``, ``report``, ``methods`` and ``quickstart``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from partialbayes.glue_bench import __version__, experiment, uci
from partialbayes.glue_bench import quickstart as qs
from partialbayes.glue_bench.context import FISHERS, Settings
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
from partialbayes.glue_bench.methods import METHODS
from partialbayes.glue_bench.models import DEFAULT_MODEL, minilm_path
from partialbayes.glue_bench.quickstart import QUICKSTART_ARGS as QUICK
from partialbayes.glue_bench.report import short_table, summarise, write_report
from partialbayes.glue_bench.store import grid_units, iter_records, parse_shard
from partialbayes.glue_bench.tables import BUDGET_TOLERANCE, col, markdown
from partialbayes.glue_bench.train import OPTIMIZERS, TrainConfig
from partialbayes.glue_bench.uci import PROTOCOLS, SIGMA_RULES, UCI_METHODS, UCIProtocol
from partialbayes.predictive.internal import check_int

# `glue-bench run` without --methods: the two cheap baselines of each task kind (UCI has no temperature
# scaling, a classification method; last-layer Laplace is its cheapest calibrated alternative).
DEFAULT_METHODS = {"glue": ("map", "temperature"), "uci": ("map", "last-layer")}
# `glue-bench run` without --splits: one GLUE split (fine-tuning is the cost; the paper has 5), and the
# paper's 15 train/test splits of each UCI dataset (its appendix B: splits 0-14 of the standard folders,
# which hold 20; fewer when a folder holds fewer).
DEFAULT_SPLITS = {"glue": "0", "uci": "0-14", "uci-literature": "0-19"}
TASK_KINDS = {"glue": "GLUE", "uci": "UCI"}
# What --splits takes: a GLUE split is the seed of a train/validation permutation (the paper runs 5, each
# costs a fine-tuning), a UCI folder holds 20 (checked per folder). Ranges are bounded before they expand.
MAX_SPLITS = 1000


def parse_splits(text: str, limit: int = MAX_SPLITS) -> list[int]:
    """``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2"`` -> [0, 2]; every split below ``limit`` (checked before expanding)."""
    out: set[int] = set()  # an empty text is one part that cannot be parsed
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
            raise argparse.ArgumentTypeError(f"--splits: {part.strip()!r} beyond 0-{limit - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def _names(text: str) -> list[str]:
    names = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not names:
        raise argparse.ArgumentTypeError(f"empty list {text!r}: name at least one")
    return names


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in _names(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"cannot parse {text!r} as numbers ({err})") from None


# Options of `run` and `quickstart` that set a field of RunConfig, TrainConfig or Settings: their help. The
# default (and the type) of each is the field's, so the help shows each command's own defaults.
FIELD_HELP = {
    "model": "Hugging Face model name or folder (%(default)s)",
    "max_train_examples": "training cap (%(default)s; None: the paper's)",
    "max_test_examples": "test set cap (%(default)s; None: all)",
    "seed": "base seed (%(default)s)",
    "optimizer": "of fine-tuning (%(default)s)",
    "epochs": "fine-tuning (%(default)s; 0: --model is MAP)",
    "lr": "AdamW learning rate (%(default)s)",
    "batch_size": "fine-tuning batch (%(default)s)",
    "max_length": "max tokens (default: the model's limit, as the paper)",
    "length_buckets": "k: sort each run of k shuffled batches by length (less padding; 0: plain, "
    "%(default)s)",
    "prior": "how Laplace cells tune the prior precision (%(default)s)",
    "fisher": "KFAC curvature (%(default)s)",
    "curvature_pass": "shared: one pass per ramp; per-cell: one per cell, same records (%(default)s)",
    "n_samples": "MC samples (%(default)s)",
}
CHOICES = {"optimizer": OPTIMIZERS, "prior": ("val_nll", "marglik"), "fisher": FISHERS}
CHOICES["curvature_pass"] = CURVATURE_PASSES
# UCI options of `run`: dest -> (UCIProtocol field, type, what it sets; the presets' values are added).
UCI_OPTIONS = {
    "sigma": ("sigma", str, "noise σ rule"),
    "hidden_width": ("width", int, "hidden units"),
    "hidden_layers": ("depth", int, "hidden layers"),
    "uci_epochs": ("epochs", int, "most epochs"),
    "uci_lr": ("lr", float, "Adam learning rate"),
    "uci_batch_size": ("batch_size", int, "minibatch"),
    "weight_decay": ("weight_decay", _floats, "weight decay(s), several: on validation"),
    "swag_lr": ("swag_lrs", _floats, "SWAG lr(s), several: on validation"),
}
# Options of `run` that only one kind of task uses: given with tasks of the other kind only, they are
# refused, never ignored. The Settings options prior, prior_grid and n_samples also set the UCI protocol.
SHARED = {"prior": "prior", "prior_grid": "prior_grid", "n_samples": "n_samples"}
GLUE_ONLY = {*FIELD_HELP, "glue_dir", "executor", "ray_address", "take_over"} - {"seed", *SHARED}
UCI_ONLY = {*UCI_OPTIONS, "uci_dir", "protocol"}


def _preset(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" for v in value)
    return "full batch" if value is None else format(value, "g" if isinstance(value, float) else "")


def _common(p: argparse.ArgumentParser, grid: str) -> None:
    """The options of ``run`` and ``quickstart``."""
    config = RunConfig()
    defaults = {**vars(config.settings), **vars(config.train), **vars(config)}
    for dest, text in FIELD_HELP.items():
        value = defaults[dest]
        kind = int if value is None else type(value)
        flag = f"--{dest.replace('_', '-')}"
        p.add_argument(flag, type=kind, default=value, choices=CHOICES.get(dest), help=text)
    add = p.add_argument
    device = "cuda" if torch.cuda.is_available() else "cpu"
    add("--device", default=device, help="torch device (%(default)s)")
    add("--glue-dir", type=Path, help="folder of SST-2/, MRPC/, RTE/ ($PARTIALBAYES_DATA/glue)")
    add("--prior-grid", type=_floats, help=f"prior precisions, e.g. 1e-3,0.1,1 (default {grid})")
    add("--no-progress", action="store_true", help="hide progress bars")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def build_parser() -> argparse.ArgumentParser:
    """The ``glue-bench`` argument parser (no option may be abbreviated: ``--task`` is not ``--tasks``)."""
    parser = argparse.ArgumentParser(
        prog="glue-bench",
        description="Stochastic-subset Bayesian transformers on GLUE (Kampen et al., UAI 2024).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")
    subcommand = partial(sub.add_parser, allow_abbrev=False)
    run = subcommand("run", help="fill (part of) the grid in a results folder")
    add = run.add_argument
    tasks = f"GLUE tasks {list(TASKS)}, UCI datasets {list(UCI_DATASETS)} (case, hyphens ignored)"
    add("--tasks", type=_names, default=["sst2"], help=f"{tasks} (default sst2)")
    defaults = "; ".join(f"{','.join(v)} for {TASK_KINDS[k]}" for k, v in DEFAULT_METHODS.items())
    add("--methods", type=_names, help=f"see `glue-bench methods` (default {defaults})")
    add("--splits", type=parse_splits, help="e.g. 0-4 (default 0 for GLUE, 0-14 for UCI)")
    add("--results", type=Path, default=Path("results"), help="results folder (%(default)s)")
    add("--uci-dir", type=Path, help="folder of bostonHousing/, energy/, yacht/")
    add("--shard", help="i/n: every n-th (task, split) unit from the i-th")
    add("--unit", type=int, help="run only unit INDEX (a Slurm array task; see --list-units)")
    add("--list-units", action="store_true", help="print the units with their index and stop")
    add("--executor", choices=EXECUTORS, default="local", help="where units run (%(default)s)")
    add("--ray-address", help="HOST:PORT of a running Ray cluster (default: start a local one)")
    add("--take-over", action="store_true", help="take over claims of units whose owner is gone")
    _common(run, "10^-1 ... 10^3 in half decades, the paper's")
    add = run.add_argument_group("UCI options (refused with GLUE-only runs)").add_argument
    add("--protocol", choices=PROTOCOLS, default="paper", help="UCI preset (%(default)s)")
    paper, lit = PROTOCOLS["paper"], PROTOCOLS["literature"]
    for dest, (key, kind, what) in UCI_OPTIONS.items():
        values = f"paper {_preset(getattr(paper, key))}, literature {_preset(getattr(lit, key))}"
        choices = SIGMA_RULES if dest == "sigma" else None
        add(f"--{dest.replace('_', '-')}", type=kind, choices=choices, help=f"{what} ({values})")

    rep = subcommand("report", help="tables and figures of a results folder")
    add = rep.add_argument
    add("results_dir", nargs="?", type=Path, metavar="RESULTS", help="results folder")
    add("--results", type=Path, help="results folder (default results)")
    add("--out", type=Path, help="output folder (default <results>/report)")
    add("--budget", type=float, default=10.0, help="Table 2's budget in percent (%(default)s)")
    add("--budget-tolerance", type=float, default=BUDGET_TOLERANCE, help="'≈' (%(default)s)")
    add("--calibration-methods", type=_names, help="default: map, temperature, the 4 best")
    subcommand("methods", help="list the methods")
    quick = subcommand(
        "quickstart",
        help="a CPU demo on one GLUE task: MAP, temperature scaling, last-layer and S-KFAC Laplace "
        "(about 3 min on an idle 2-core CPU: 165 s of CPU time measured; 10+ min on a busy one)",
    )
    add = quick.add_argument
    add("--task", default=QUICK["task"], choices=list(TASKS), help="GLUE task (%(default)s)")
    add("--split", type=int, default=0, help="which split (%(default)s; the how-to reports 0-2)")
    add("--results", type=Path, default=Path("glue-bench-quickstart"), help="folder (%(default)s)")
    _common(quick, "10^-3 ... 10^3 in half decades")
    quick.set_defaults(**{k: v for k, v in QUICK.items() if k != "task"})
    return parser


def _configs(args: argparse.Namespace, quick: bool = False) -> RunConfig:
    def given(cls: type) -> dict:
        names = [f.name for f in dataclasses.fields(cls) if f.name in FIELD_HELP]
        return {name: getattr(args, name) for name in names}

    train, settings = given(TrainConfig), given(Settings)
    if quick:
        train.update(qs.QUICKSTART_TRAIN)
        settings.update(qs.QUICKSTART_SETTINGS)
    if args.prior_grid is not None:
        settings["prior_grid"] = args.prior_grid
    return RunConfig(**given(RunConfig), train=TrainConfig(**train), settings=Settings(**settings))


def resolve_task(name: str) -> tuple[str, str]:
    """Kind (``glue`` or ``uci``) and canonical name of a ``--tasks`` entry (case, hyphens, UCI folder names ok)."""
    key = name.strip().lower().replace("-", "")
    if key in TASKS:
        return "glue", key
    names = {**{k: k for k in UCI_DATASETS}, **{v.lower(): k for k, v in UCI_DATASETS.items()}}
    if key in names:
        return "uci", names[key]
    raise ValueError(
        f"unknown task(s) [{name!r}]; valid tasks: {', '.join([*TASKS, *UCI_DATASETS])}"
    )


def plan_run(
    tasks: Sequence[str], methods: Sequence[str] | None, optimizer: str = "adamw"
) -> dict[str, tuple[list[str], list[str]]]:
    """``{kind: (canonical tasks, methods)}`` of ``glue-bench run``, every (kind, method) checked first.

    ``methods=None``: each kind's :data:`DEFAULT_METHODS`; all problems are raised as one ``ValueError``.
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
    plan, errors = {}, []
    if unknown:
        errors.append(
            f"unknown task(s) {unknown}; valid tasks: {', '.join([*TASKS, *UCI_DATASETS])}"
        )
    bad = [m for m in methods or () if m not in METHODS and m not in UCI_METHODS]
    if bad:
        errors.append(
            f"unknown method(s) {bad}; valid methods: {', '.join(METHODS)} (UCI: {', '.join(UCI_METHODS)})"
        )
    for kind, names in by_kind.items():
        chosen = list(DEFAULT_METHODS[kind]) if methods is None else list(dict.fromkeys(methods))
        if wrong := [m for m in chosen if m not in valid[kind] and m not in bad]:
            errors.append(
                f"method(s) {wrong} have no {TASK_KINDS[kind]} version (tasks {', '.join(names)}); "
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


def _splits(args: argparse.Namespace, plan: dict[str, tuple[list[str], list[str]]]) -> dict:
    """The splits of each kind of task: ``--splits`` or the kind's default, UCI ones checked per folder."""
    given = args.splits
    default = {**DEFAULT_SPLITS, "uci": DEFAULT_SPLITS.get(f"uci-{args.protocol}", "0-14")}
    splits = {kind: given or parse_splits(default[kind]) for kind in plan}
    for name in plan.get("uci", ([], []))[0]:
        folder = uci_folder(name, args.uci_dir)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"UCI data for {name} not found: no folder {folder} (pass --uci-dir /path/to/uci, "
                f"a folder holding {UCI_DATASETS[name]}/data/)"
            )
        n = num_splits(name, args.uci_dir)
        splits["uci"] = splits["uci"] if given else [k for k in splits["uci"] if k < n]
        if any(k >= n for k in splits["uci"]):
            raise ValueError(
                f"--splits {[k for k in splits['uci'] if k >= n]} out of range for UCI dataset "
                f"{name} ({n} splits: 0-{n - 1})"
            )
    return splits


def cmd_run(args: argparse.Namespace) -> int:
    """``glue-bench run``: validate the whole request, then run the GLUE units, then the UCI units."""
    plan = plan_run(args.tasks, args.methods, args.optimizer)
    check_options(getattr(args, "given", {}), plan)
    protocol = uci_protocol(args) if "uci" in plan else None
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
    failures: list[str] = []
    if "glue" in plan:
        tasks, methods = plan["glue"]
        grid = experiment.Grid(
            tasks, splits["glue"], methods, _configs(args), args.results, args.device, args.glue_dir,
            progress=not args.no_progress, keep_going=True, take_over=args.take_over,
        )  # fmt: skip
        at = {"executor": args.executor, "ray_address": args.ray_address, "shard": shard}
        failures += experiment.run_grid(grid, **at).failures
    if "uci" in plan:
        tasks, methods = plan["uci"]
        at = {"uci_dir": args.uci_dir, "shard": shard, "seed": args.seed, "device": args.device}
        at.update(keep_going=True, protocol=protocol)
        failures += uci.run_uci(tasks, splits["uci"], methods, args.results / "uci", **at).failures
    print(f"results in {args.results}; summarise with: glue-bench report --results {args.results}")
    return _report_failures(failures)


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """``{dest: option string}`` of the options of ``parser`` that ``argv`` names (``--lr 1`` or ``--lr=1``)."""
    names = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    return {a.dest: o for a in parser._actions for o in a.option_strings if o in names}


def check_options(given: dict[str, str], plan: dict[str, tuple[list[str], list[str]]]) -> None:
    """Refuse options given for a kind of task that the run does not have (``ValueError`` naming them)."""
    wrong = [(o, "GLUE") for d, o in given.items() if d in GLUE_ONLY and "glue" not in plan]
    wrong += [(o, "UCI") for d, o in given.items() if d in UCI_ONLY and "uci" not in plan]
    if wrong:
        kinds = sorted({k for _, k in wrong})
        raise ValueError(
            f"option(s) {', '.join(o for o, _ in wrong)} apply only to {' and '.join(kinds)} tasks, and "
            f"this run has none (tasks: {', '.join(n for names, _ in plan.values() for n in names)})"
        )


def uci_protocol(args: argparse.Namespace) -> UCIProtocol:
    """The ``--protocol`` preset with the UCI options given on the command line (``ValueError`` if bad)."""
    fields = {**SHARED, **{dest: field for dest, (field, _, _) in UCI_OPTIONS.items()}}
    changes = {f: getattr(args, d) for d, f in fields.items() if d in getattr(args, "given", {})}
    return dataclasses.replace(PROTOCOLS[args.protocol], **changes)


def _report_failures(failures: list[str]) -> int:
    if failures:
        print(f"{len(failures)} cell(s) failed (rerun to retry them):", file=sys.stderr)
        print("\n".join(f"  {f}" for f in failures), file=sys.stderr)
    return 1 if failures else 0


def cmd_report(args: argparse.Namespace) -> int:
    """``glue-bench report``."""
    if args.results_dir is not None and args.results is not None:
        raise ValueError("give the results folder once: either RESULTS or --results")
    results = args.results_dir or args.results or Path("results")
    at = {"budget": args.budget, "budget_tolerance": args.budget_tolerance}
    out = write_report(results, args.out, calibration_methods=args.calibration_methods, **at)
    lines = [*(f"wrote {f}" for f in out["files"]), *(f"skipped {s}" for s in out["skipped"])]
    print(out["markdown"], *lines, sep="\n")  # report.md is always among the files
    return 0


def choose_threads() -> str:
    """Set torch's threads for a shared machine; the line that says what was chosen and why.

    ``OMP_NUM_THREADS`` when set, else the usable CPUs less the load average (at least 1, at most torch's default).
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        why = "OMP_NUM_THREADS"
    else:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), round(cpus - load))))
        why = f"{cpus} usable CPUs less the load average {load:.1f}; set OMP_NUM_THREADS to choose"
    line = f"threads: {torch.get_num_threads()} ({why})"
    if load >= cpus:
        line += f". The machine is busy (load {load:.1f} on {cpus} CPUs): expect several times the time "
        line += "of an idle machine"
    return line


def cmd_quickstart(args: argparse.Namespace) -> int:
    """``glue-bench quickstart``: fine-tune on a subsample, compare four methods, print, plot and read."""
    check_int("--split", args.split, "[0, inf)")
    folder = args.glue_dir or default_glue_dir()
    if folder is None or not (Path(folder) / task_spec(args.task).folder).is_dir():
        print(glue_missing_message(args.task, folder), file=sys.stderr)
        return 2
    if args.model == DEFAULT_MODEL:
        minilm_path()  # the packaged MiniLM, or an ImportError that says how to install it
    config = _configs(args, quick=True)
    threads = choose_threads()
    start, cpu_start = time.perf_counter(), time.process_time()
    print(
        f"glue-bench quickstart: {args.task} split {args.split}, model {args.model}, "
        f"{args.max_train_examples} training examples, {config.train.epochs} epochs, "
        f"{args.max_test_examples} test examples, device {args.device}; results in {args.results}\n"
        f"{threads}"
    )
    timings: list[dict] = []
    methods, unit = qs.QUICKSTART_METHODS, ([args.task], [args.split])
    grid = experiment.Grid(*unit, methods, config, args.results, args.device, folder,
                           progress=not args.no_progress, keep_going=True)  # fmt: skip
    store = experiment.run_grid(grid, timings=timings)
    here = (args.task, args.split)
    records = [r for r in iter_records(args.results) if (r["task"], r["split"]) == here]
    records = [r for r in records if r["method"] in methods]
    rows = summarise(records)
    print(f"\n{short_table(qs.order_rows(rows))}")
    plot = args.results / f"{args.task}_split{args.split}_ramping_nll.png"
    if ramping_plot(rows, args.task, plot):
        print(f"wrote {plot}")
    total = time.perf_counter() - start
    print(f"\n{stage_table(timings, total, time.process_time() - cpu_start)}")
    print(f"finished in {total:.0f} s; full tables: glue-bench report --results {args.results}")
    if any(r["method"] == "map" for r in records):
        print(f"\n{qs.read_table(records)}")
    return _report_failures(store.failures)


STAGE_COLUMNS = [
    col("stage", "stage"),
    col("cells", "cells", align="r"),
    col("wall s", "wall", "{:.0f}", "r"),
    col("CPU s", "cpu", "{:.0f}", "r"),
]


def stage_table(timings: list[dict], total_wall: float, total_cpu: float) -> str:
    """Markdown table of where the time went (``run_grid`` timings; the command's wall and CPU totals)."""
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
    other = {"stage": "other", "cells": "", "wall": wall, "cpu": cpu}
    total = {"stage": "**total**", "cells": "", "wall": total_wall, "cpu": total_cpu}
    return markdown([*rows.values(), other, total], STAGE_COLUMNS).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    """Run ``glue-bench``; the exit status (2 and the subcommand's usage for an unknown option)."""
    parser = build_parser()
    subs = _subparsers(parser)
    args, extra = parser.parse_known_args(argv)
    if extra:
        subs.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    os.environ.setdefault("MPLBACKEND", "Agg")
    if args.command == "run":
        args.given = given_options(subs["run"], sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "methods":
        uci_title = "\nUCI regression (glue-bench run --tasks boston,energy,yacht):\n"
        for title, methods in (("", METHODS), (uci_title, UCI_METHODS)):
            print(title + "\n".join(f"{m.name:16s} {m.description}" for m in methods.values()))
        return 0
    commands = {"run": cmd_run, "report": cmd_report, "quickstart": cmd_quickstart}
    package, handler = logging.getLogger(__package__), logging.StreamHandler(sys.stdout)
    level = package.level  # the library's messages from INFO up, as printed lines (flushed each)
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, OSError, ImportError) as err:  # OSError: unwritable folders
        print(f"glue-bench: error: {err}", file=sys.stderr)
        return 2
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
