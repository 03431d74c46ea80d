"""Command-line entry point ``glue-bench``: ``run``, ``report``, ``methods`` and ``quickstart``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from partialbayes.glue_bench import __version__, experiment, uci
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
from partialbayes.glue_bench.quickstart import (
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
from partialbayes.glue_bench.uci import PROTOCOLS, SIGMA_RULES, UCI_METHODS, UCIProtocol

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
            raise argparse.ArgumentTypeError(f"--splits: {part.strip()!r} beyond 0-{limit - 1}")
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
        return tuple(float(t) for t in _names(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"cannot parse {text!r} as numbers ({err})") from None


def _common(p: argparse.ArgumentParser, grid: str) -> None:
    """The options of ``run`` and ``quickstart``; help shows each command's own defaults."""
    train, device = TrainConfig(), "cuda" if _cuda() else "cpu"
    add = p.add_argument
    add("--model", default=DEFAULT_MODEL, help="Hugging Face model name or folder (%(default)s)")
    add("--device", default=device, help="torch device (%(default)s)")
    add("--glue-dir", type=Path, help="folder of SST-2/, MRPC/, RTE/ ($PARTIALBAYES_DATA/glue)")
    add("--max-train-examples", type=int, help="training cap (%(default)s; None: the paper's)")
    add("--max-test-examples", type=int, help="test set cap (%(default)s; None: all)")
    add("--seed", type=int, default=0, help="base seed (%(default)s)")
    add("--optimizer", choices=OPTIMIZERS, default="adamw", help="of fine-tuning (%(default)s)")
    add(
        "--epochs",
        type=int,
        default=train.epochs,
        help="fine-tuning (%(default)s; 0: --model is MAP)",
    )
    add("--lr", type=float, default=train.lr, help="AdamW learning rate (%(default)s)")
    add("--batch-size", type=int, default=train.batch_size, help="fine-tuning batch (%(default)s)")
    add("--max-length", type=int, help="max tokens (default: the model's limit, as the paper)")
    buckets = (
        "k: sort each run of k shuffled batches by length (less padding; 0: plain, %(default)s)"
    )
    add("--length-buckets", type=int, default=train.length_buckets, help=buckets)
    prior = "how Laplace cells tune the prior precision (%(default)s)"
    add("--prior", choices=("val_nll", "marglik"), default="val_nll", help=prior)
    add("--prior-grid", type=_floats, help=f"prior precisions, e.g. 1e-3,0.1,1 (default {grid})")
    add("--fisher", choices=FISHERS, default="empirical", help="KFAC curvature (%(default)s)")
    passes = "shared: one pass per ramp; per-cell: one per cell, same records (%(default)s)"
    add("--curvature-pass", choices=CURVATURE_PASSES, default="shared", help=passes)
    add("--n-samples", type=int, default=Settings().n_samples, help="MC samples (%(default)s)")
    add("--no-progress", action="store_true", help="hide progress bars")


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
    """The ``glue-bench`` argument parser (no option may be abbreviated: ``--task`` is not ``--tasks``).

    ``--epochs 0`` takes ``--model FOLDER``, a classifier fine-tuned for the task, as the MAP as it is.
    """
    parser = argparse.ArgumentParser(
        prog="glue-bench",
        description="Stochastic-subset Bayesian transformers on GLUE (Kampen et al., UAI 2024).",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser(
        "run", help="fill (part of) the grid in a results folder", allow_abbrev=False
    )
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
    uci_opts = run.add_argument_group("UCI options (refused with GLUE-only runs)")
    add = uci_opts.add_argument
    lit = PROTOCOLS["literature"]
    add("--protocol", choices=PROTOCOLS, default="paper", help="UCI preset (%(default)s)")
    add(
        "--sigma", choices=SIGMA_RULES, help=f"noise σ rule (paper: train, literature: {lit.sigma})"
    )
    add("--hidden-width", type=int, help="hidden units (50)")
    add("--hidden-layers", type=int, help=f"hidden layers (paper 2, literature {lit.depth})")
    add(
        "--uci-epochs",
        type=int,
        help=f"most epochs (paper 2000 full batch, literature {lit.epochs})",
    )
    add("--uci-lr", type=float, help=f"Adam learning rate (paper 0.01, literature {lit.lr:g})")
    add(
        "--uci-batch-size",
        type=int,
        help=f"minibatch (paper full batch, literature {lit.batch_size})",
    )
    wd = ",".join(f"{v:g}" for v in lit.weight_decay)
    add(
        "--weight-decay",
        type=_floats,
        help=f"weight decay(s), several: on validation (paper 1e-4, literature {wd})",
    )
    swag = ",".join(f"{v:g}" for v in lit.swag_lrs)
    add(
        "--swag-lr",
        type=_floats,
        help=f"SWAG lr(s), several: on validation (paper 0.01, literature {swag})",
    )

    rep = sub.add_parser(
        "report", help="tables and figures of a results folder", allow_abbrev=False
    )
    add = rep.add_argument
    add("results_dir", nargs="?", type=Path, metavar="RESULTS", help="results folder")
    add("--results", type=Path, help="results folder (default results)")
    add("--out", type=Path, help="output folder (default <results>/report)")
    add("--budget", type=float, default=10.0, help="Table 2's budget in percent (%(default)s)")
    add("--budget-tolerance", type=float, default=BUDGET_TOLERANCE, help="'≈' (%(default)s)")
    add("--calibration-methods", type=_names, help="default: map, temperature, the 4 best")

    sub.add_parser("methods", help="list the methods", allow_abbrev=False)

    quick = sub.add_parser(
        "quickstart",
        help="a CPU demo on one GLUE task: MAP, temperature scaling, last-layer and S-KFAC Laplace "
        "(about 3 min on an idle 2-core CPU: 165 s of CPU time measured; 10+ min on a busy one)",
        allow_abbrev=False,
    )
    add = quick.add_argument
    add("--task", default=QUICK["task"], choices=list(TASKS), help="GLUE task (%(default)s)")
    add("--split", type=int, default=0, help="which split (%(default)s; the how-to reports 0-2)")
    add("--results", type=Path, default=Path("glue-bench-quickstart"), help="folder (%(default)s)")
    _common(quick, "10^-3 ... 10^3 in half decades")
    quick.set_defaults(**{k: v for k, v in QUICK.items() if k != "task"})
    return parser


def _configs(args: argparse.Namespace, quick: bool = False) -> RunConfig:
    train = {"optimizer": args.optimizer, "seed": args.seed, "epochs": args.epochs, "lr": args.lr}
    train.update(batch_size=args.batch_size, max_length=args.max_length)
    train.update(length_buckets=args.length_buckets)
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
    """Kind (``"glue"`` or ``"uci"``) and canonical name of a ``--tasks`` entry; unknown: ``ValueError``.

    The one place task names are normalised: case and hyphens are ignored (``SST-2``, ``Boston``), and a UCI
    dataset may be named by its folder (``bostonHousing``).
    """
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
    """``{kind: (canonical tasks, methods)}``: every (task kind, method) of ``glue-bench run`` checked first.

    ``methods=None`` takes each kind's :data:`DEFAULT_METHODS`; the ``ivon`` method needs ``optimizer``
    ``ivon``. Unknown tasks or methods, or methods without a version for a kind asked for, raise one
    ``ValueError`` (a line per kind, listing its valid methods).
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
    bad = [m for m in methods or () if m not in METHODS and m not in UCI_METHODS]
    if bad:
        raise ValueError(
            f"unknown method(s) {bad}; valid methods: {', '.join(METHODS)} (UCI: {', '.join(UCI_METHODS)})"
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


def _splits(args: argparse.Namespace, plan: dict[str, tuple[list[str], list[str]]]) -> dict:
    """The splits of each kind of task: ``--splits`` or the kind's default, UCI ones checked per folder."""
    given = args.splits
    default = {
        **DEFAULT_SPLITS,
        "uci": DEFAULT_SPLITS.get(f"uci-{args.protocol}", DEFAULT_SPLITS["uci"]),
    }
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
    """``glue-bench run``: validate the whole request, then the GLUE units, then the UCI units.

    ``--list-units`` prints the (task, split) units with their index; ``--unit INDEX`` runs one of them
    (GLUE units first, then UCI), ``--shard i/n`` every n-th unit of each kind.
    """
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
    glue = {"executor": args.executor, "ray_address": args.ray_address, "take_over": args.take_over}
    glue.update(device=args.device, glue_dir=args.glue_dir, progress=not args.no_progress)
    failures: list[str] = []
    if "glue" in plan:
        tasks, methods = plan["glue"]
        store = experiment.run_grid(
            tasks,
            splits["glue"],
            methods,
            _configs(args),
            args.results,
            shard=shard,
            keep_going=True,
            **glue,
        )
        failures += store.failures
    if "uci" in plan:
        tasks, methods = plan["uci"]
        at = {"uci_dir": args.uci_dir, "shard": shard, "seed": args.seed, "device": args.device}
        at["protocol"] = protocol
        failures += uci.run_uci(
            tasks, splits["uci"], methods, args.results / "uci", keep_going=True, **at
        ).failures
    print(f"results in {args.results}; summarise with: glue-bench report --results {args.results}")
    return _report_failures(failures)


# Options of `run` that only one kind of task uses (the others apply to both): given with tasks of the other
# kind only, they are refused, never ignored.
GLUE_ONLY = [
    "model",
    "glue_dir",
    "max_train_examples",
    "max_test_examples",
    "optimizer",
    "epochs",
    "lr",
    "batch_size",
    "max_length",
    "fisher",
    "curvature_pass",
    "executor",
    "ray_address",
    "take_over",
    "length_buckets",
]
UCI_ONLY = [
    "uci_dir",
    "protocol",
    "sigma",
    "hidden_width",
    "hidden_layers",
    "uci_epochs",
    "uci_lr",
    "uci_batch_size",
    "weight_decay",
    "swag_lr",
]
# UCIProtocol field of each UCI option (and of the shared ones that the UCI protocol takes).
UCI_FIELDS = {
    "sigma": "sigma",
    "hidden_width": "width",
    "hidden_layers": "depth",
    "uci_epochs": "epochs",
    "uci_lr": "lr",
    "uci_batch_size": "batch_size",
    "weight_decay": "weight_decay",
    "swag_lr": "swag_lrs",
    "prior": "prior",
    "prior_grid": "prior_grid",
    "n_samples": "n_samples",
}


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
    given = getattr(args, "given", {})
    changes = {f: getattr(args, d) for d, f in UCI_FIELDS.items() if d in given}
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
    out = write_report(
        args.results_dir or args.results or Path("results"),
        args.out,
        budget=args.budget,
        calibration_methods=args.calibration_methods,
        budget_tolerance=args.budget_tolerance,
    )
    print(out["markdown"])
    print(
        "\n".join(
            [*(f"wrote {f}" for f in out["files"]), *(f"skipped {s}" for s in out["skipped"])]
        )
    )
    return 0


def choose_threads() -> str:
    """Set torch's thread count for a machine others may share; the line that says what was chosen and why.

    ``OMP_NUM_THREADS`` when set (torch reads it); else the CPUs this process may use
    (``os.sched_getaffinity``) less the 1-minute load average of the machine, at least 1 and never above
    torch's default: a thread beyond the free cores spins against the other processes (measured in the
    GLUE how-to). When the load is at or above the usable CPUs, the line says to expect a slow run.
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
        line += (
            f". The machine is busy (load {load:.1f} on {cpus} CPUs): expect several times the time "
            "of an idle machine"
        )
    return line


def cmd_quickstart(args: argparse.Namespace) -> int:
    """``glue-bench quickstart``: fine-tune on a subsample, compare four methods, print, plot and read."""
    if args.split < 0:
        raise ValueError(f"--split must be >= 0, got {args.split}")
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
        if (r["task"], r["split"]) == (args.task, args.split) and r["method"] in QUICKSTART_METHODS
    ]
    print(f"\n{short_table(order_rows(summarise(records)))}")
    plot = args.results / f"{args.task}_split{args.split}_ramping_nll.png"
    if ramping_plot(summarise(records), args.task, plot):
        print(f"wrote {plot}")
    print(f"\n{stage_table(timings, time.perf_counter() - start, time.process_time() - cpu_start)}")
    print(
        f"finished in {time.perf_counter() - start:.0f} s; full tables: "
        f"glue-bench report --results {args.results}"
    )
    if any(r["method"] == "map" for r in records):
        print(f"\n{read_table(records)}")
    return _report_failures(store.failures)


STAGE_COLUMNS = [
    col("stage", "stage"),
    col("cells", "cells", align="r"),
    col("wall s", "wall", "{:.0f}", "r"),
    col("CPU s", "cpu", "{:.0f}", "r"),
]


def stage_table(timings: list[dict], total_wall: float, total_cpu: float) -> str:
    """Markdown table of where the time went: fine-tuning, each method (its cells summed), the rest.

    ``timings`` from ``run_grid(..., timings=...)``; the totals are the command's wall and process CPU
    seconds (all threads: on a busy machine a better cost measure than wall time).
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
    if args.command == "run":
        args.given = given_options(
            _subparsers(parser)["run"], sys.argv[1:] if argv is None else argv
        )
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "methods":
        print("\n".join(f"{m.name:16s} {m.description}" for m in METHODS.values()))
        print("\nUCI regression (glue-bench run --tasks boston,energy,yacht):")
        print("\n".join(f"{m.name:16s} {m.description}" for m in UCI_METHODS.values()))
        return 0
    commands = {"run": cmd_run, "report": cmd_report, "quickstart": cmd_quickstart}
    try:
        return commands[args.command](args)
    except (ValueError, TypeError, OSError, ImportError) as err:  # OSError: unwritable folders
        print(f"glue-bench: error: {err}", file=sys.stderr)
        return 2
