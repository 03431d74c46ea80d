"""Run the GLUE grid, one unit per (task, split): fine-tune (or reuse) its MAP, then fill every method cell.

Units go to an executor (:mod:`~partialbayes.glue_bench.executors`); the KFAC-type Laplace cells of a unit
share passes (:mod:`~partialbayes.glue_bench.laplace_cells`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from partialbayes import predictive
from partialbayes.glue_bench.context import Context, Prediction, Settings
from partialbayes.glue_bench.data_glue import (
    Examples,
    count_truncated,
    data_fingerprint,
    encode,
    load_glue,
    split_indices,
    task_spec,
)
from partialbayes.glue_bench.executors import UnitResult, run_units
from partialbayes.glue_bench.laplace_cells import groups_of, shared_predictions
from partialbayes.glue_bench.methods import Method, get_methods
from partialbayes.glue_bench.models import DEFAULT_MODEL, check_model_folder, load_encoder
from partialbayes.glue_bench.store import Cell, ResultStore, UnitBusyError, grid_units, json_ready
from partialbayes.glue_bench.train import (
    TrainConfig,
    finetune,
    load_checkpoint,
    progress_path,
    save_checkpoint,
)
from partialbayes.glue_bench.train import logger as train_logger
from partialbayes.predictive.internal import (
    check_choice,
    check_fields,
    check_finite,
    check_type,
    ranged,
)

ModelFactory = Callable[[str, int, float], tuple[torch.nn.Module, Any]]
logger = logging.getLogger(__name__)
CURVATURE_PASSES = ("shared", "per-cell")
# The Prediction fields every GLUE record holds as they are (all but the probabilities, curvature_pass).
RECORDED = [
    f.name for f in dataclasses.fields(Prediction) if f.name not in ("probs", "curvature_pass")
]


@dataclass
class RunConfig:
    """Everything that determines the results (stored as the results folder's configuration).

    Attributes:
        model: Model name or folder (``minilm`` is the packaged default).
        train: Fine-tuning settings.
        settings: Method hyperparameters.
        max_train_examples: Cap on the training part of each split (``None``: the paper's sizes).
        max_test_examples: Cap on the test set (``None``: the whole GLUE dev set).
        curvature_batch_size: Batch size of the curvature, SWAG and prediction passes.
        seed: Base seed; split ``k`` seeds everything random with ``seed · 100 + k``.
        curvature_pass: ``shared`` (the KFAC-type cells of a unit share their training, validation and
            test passes, :mod:`~partialbayes.glue_bench.laplace_cells`) or ``per-cell``: the same records.
    """

    model: str = DEFAULT_MODEL
    train: TrainConfig = field(default_factory=TrainConfig)
    settings: Settings = field(default_factory=Settings)
    max_train_examples: int | None = ranged(None, "[1, inf)", int, optional=True)
    max_test_examples: int | None = ranged(None, "[1, inf)", int, optional=True)
    curvature_batch_size: int = ranged(16, "[1, inf)", int)
    seed: int = ranged(0, "[0, inf)", int)
    curvature_pass: str = "shared"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"RunConfig.model must be a non-empty string, got {self.model!r}")
        for key, kind in (("train", TrainConfig), ("settings", Settings)):
            check_type(f"RunConfig.{key}", getattr(self, key), kind)
        check_fields(self)
        check_choice("RunConfig.curvature_pass", self.curvature_pass, CURVATURE_PASSES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (the store's fingerprint is taken of it)."""
        return json_ready(self)


def model_length_limit(model: torch.nn.Module, tokenizer: Any) -> int:
    """The longest input ``model`` takes: its position embeddings and the tokenizer's ``model_max_length``."""
    config = getattr(model, "config", None)
    limits = [getattr(config, "max_position_embeddings", None)]
    limits.append(getattr(tokenizer, "model_max_length", None))
    usable = [int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000]
    return min(usable) if usable else 512


def split_data(
    task: str, split: int, config: RunConfig, glue_dir: str | Path | None
) -> tuple[dict[str, Examples], dict[str, Any]]:
    """``({"train", "val", "test"}: examples, data fingerprint)`` of split ``split`` of ``task``."""
    train_all, test = load_glue(task, glue_dir)
    train, val = split_indices(len(train_all), task_spec(task), split, config.max_train_examples)
    if config.max_test_examples is not None:
        test = test.take(range(min(config.max_test_examples, len(test))))
    parts = {"train": train_all.take(train), "val": train_all.take(val), "test": test}
    return parts, data_fingerprint(train_all, test)


def map_checkpoint(
    model: torch.nn.Module,
    tokenizer: Any,
    parts: dict[str, Examples],
    train: TrainConfig,
    folder: Path,
    progress: bool,
    about: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Load the MAP checkpoint at ``folder`` into ``model``, fine-tuning and publishing it first if absent.

    Fine-tuning resumes from, and keeps its state in, :func:`progress_path` (deleted once published); the model
    scores with the published weights. Returns ``(meta, IVON Hessians or None)``; the meta adds ``cached``,
    ``finetune_seconds``, ``finetune_cpu_seconds`` (this process's) and, after fine-tuning, ``published_here``.
    """
    own: dict[str, Any] = {"cached": True, "finetune_seconds": 0.0, "finetune_cpu_seconds": 0.0}
    if load_checkpoint(model, folder) is None:
        device = next(model.parameters()).device
        resume = progress_path(folder)
        summary = finetune(
            model, tokenizer, parts["train"], parts["val"], train, device, progress, resume=resume
        )
        hess = summary.pop("ivon_hess", None)
        cut = {n: count_truncated(e, tokenizer, train.max_length) for n, e in parts.items()}
        meta = {**about, "max_length": train.max_length, "truncated": cut, **summary}
        own = {"cached": False, "published_here": save_checkpoint(model, folder, meta, hess)}
        own.update(finetune_seconds=float(summary["seconds"]))
        own.update(finetune_cpu_seconds=float(summary["cpu_seconds"]))
        resume.unlink(missing_ok=True)
    loaded = load_checkpoint(model, folder)
    assert loaded is not None, "save_checkpoint either published a checkpoint or found one"
    return {**loaded[0], **own}, loaded[1]


def prepare_context(
    task: str,
    split: int,
    config: RunConfig,
    store: ResultStore,
    device: torch.device,
    glue_dir: str | Path | None = None,
    model_factory: ModelFactory | None = None,
    progress: bool = True,
) -> tuple[Context, dict[str, Any]]:
    """Load data, fine-tune or reuse the checkpoint of (task, split); ``(method context, checkpoint meta)``.

    ``model_factory(name, num_labels, dropout) -> (model, tokenizer)`` (default :func:`load_encoder`) runs after
    seeding with the split's seed (a new head is the same in every run); the data are checked against the
    folder's before any work.
    """
    spec = task_spec(task)
    parts, data = split_data(task, split, config, glue_dir)
    seed = config.seed * 100 + split
    torch.manual_seed(seed)  # the new classification head (and anything else the factory draws)
    trained = config.train.epochs == 0
    factory = model_factory or (
        lambda n, c, d: load_encoder(n, c, dropout=d, trained=trained, progress=progress)
    )
    model, tokenizer = factory(config.model, spec.num_labels, config.train.dropout)
    store.check_data(task, data)  # only now: a model that cannot be loaded binds nothing
    limit = model_length_limit(model, tokenizer)
    max_length = min(config.train.max_length or limit, limit)
    train = dataclasses.replace(config.train, seed=seed, max_length=max_length)
    folder = store.checkpoint_dir(task, split, config.model)
    about = {"task": task, "split": split, "model": config.model}
    model.to(device)
    meta, hess = map_checkpoint(model, tokenizer, parts, train, folder, progress, about)
    model.eval()
    ivon = None
    if hess is not None and "ivon" in meta:
        ivon = {"hess": hess, **meta["ivon"], "finetune_seconds": float(meta["seconds"])}
    bs, batches = config.curvature_batch_size, {}
    for name, examples in parts.items():
        encoded = encode(examples, tokenizer, bs, max_length, True)
        batches[name] = [{k: v.to(device) for k, v in b.items()} for b in encoded]
    ctx = Context(**batches, model=model, num_labels=spec.num_labels, device=device, seed=seed)
    ctx.settings, ctx.ivon, ctx.progress = config.settings, ivon, progress
    return ctx, meta


def all_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """``accuracy``, ``nll``, ``ece`` (20 equal-mass bins, the paper's), ``brier`` and those bins' ``reliability``."""
    p = probs.double()
    rel = predictive.reliability(p, labels, n_bins=20, binning="equal_mass")
    bins = {"confidence": rel.confidence.tolist(), "accuracy": rel.accuracy.tolist()}
    out = {
        "accuracy": float(predictive.accuracy(p, labels)),
        "nll": float(predictive.nll(p, labels)),
    }
    out.update(ece=float(rel.ece), brier=float(predictive.brier(p, labels)))
    return {**out, "reliability": {**bins, "count": [int(v) for v in rel.count]}}


def prediction_record(ctx: Context, method: Method, pred: Prediction, cpu: float) -> dict[str, Any]:
    """The results record of a finished cell (test metrics, floats, times, method facts)."""
    labels = ctx.labels("test")
    check_finite(pred.probs, f"method {method.name!r} produced non-finite probabilities")
    record = {**all_metrics(pred.probs, labels), "n_test": len(labels), "cpu_seconds": cpu}
    record.update({k: getattr(pred, k) for k in RECORDED})
    if pred.curvature_pass is not None:
        record["curvature_pass"] = pred.curvature_pass
    return record


def run_cell(ctx: Context, method: Method, size: str) -> dict[str, Any]:
    """Run one cell on its own, the global generator seeded by its (task, split) first; its record.

    ``cpu_seconds`` is the process CPU time of the cell (all threads).
    """
    torch.manual_seed(ctx.seed)
    cpu = time.process_time()
    pred = method.run(ctx, size)
    cpu = time.process_time() - cpu
    try:
        return prediction_record(ctx, method, pred, cpu)
    except ValueError as err:
        raise ValueError(f"{err} (size {size})") from None


@dataclass(frozen=True)
class Grid:
    """The (task, split, method) grid :func:`run_grid` fills: one unit per (task, split), each method's cells.

    Attributes:
        tasks: GLUE task names.
        splits: Split indices.
        methods: Method names (:data:`~partialbayes.glue_bench.METHODS`); cells run in this order.
        config: What determines the results (the results folder's configuration).
        results: The results folder.
        device: Where units compute.
        glue_dir: The GLUE data folder (``None``: ``$PARTIALBAYES_DATA/glue`` or the hub).
        model_factory: ``(name, num_labels, dropout) -> (model, tokenizer)`` instead of loading
            ``config.model``.
        progress: Progress bars.
        keep_going: Log and skip a failing cell (no record: a later run retries it) instead of raising.
        take_over: Take over claims whose owner on another host is gone.
    """

    tasks: Sequence[str]
    splits: Sequence[int]
    methods: Sequence[str]
    config: RunConfig
    results: str | Path
    device: str | torch.device = "cpu"
    glue_dir: str | Path | None = None
    model_factory: ModelFactory | None = None
    progress: bool = True
    keep_going: bool = False
    take_over: bool = False


def run_unit(grid: Grid, task: str, split: int) -> UnitResult:
    """One unit: claim (task, split), fine-tune or reuse its MAP, then run every cell not finished yet.

    A unit claimed by another live process is left to it (a failure line says so, nothing is written). Its
    log lines, fine-tuning's too, begin with ``[task split k]``.
    """
    unit = _Unit(grid, task, split, ResultStore(grid.results, grid.config.to_dict()))
    for named in (logger, train_logger):
        named.addFilter(unit.prefix)
    try:
        with unit.store.unit_claim(task, split, grid.take_over):
            unit.run()
    except UnitBusyError as err:
        unit.out.failures.append(f"{task}/split{split}: {err}")
        logger.warning(f"skipped: {err}")
    finally:
        for named in (logger, train_logger):
            named.removeFilter(unit.prefix)
    return unit.out


@dataclass
class _Unit:
    """One (task, split) while its cells run: where records go and what is reported back."""

    grid: Grid
    task: str
    split: int
    store: ResultStore
    out: UnitResult = field(default_factory=UnitResult)

    def run(self) -> None:
        """The cells, in the order of ``grid.methods`` (the shared ramp at its first method)."""
        ctx = self.prepare()
        methods = get_methods(self.grid.methods)
        sharing = self.grid.config.curvature_pass == "shared"
        shared = [m for m in methods if sharing and m.kron is not None]
        ramp = [(m, size) for m in shared for size in self.todo(m, ctx)]
        for method in methods:
            if method in shared:
                if ramp:
                    self.run_ramp(ctx, ramp)
                ramp = []
                continue
            name, bar = f"{self.task}/{self.split}/{method.name}", not self.grid.progress
            for size in tqdm(self.todo(method, ctx), name, disable=bar, leave=False):
                t0 = time.perf_counter()
                try:
                    record = run_cell(ctx, method, size)
                except Exception as err:  # one broken cell must not stop the grid
                    self.fail(method.name, size, err)
                    continue
                self.done(method.name, size, {**record, "seconds": time.perf_counter() - t0})

    def prepare(self) -> Context:
        g = self.grid
        logger.info(f"preparing model {g.config.model}")
        w0, c0 = time.perf_counter(), time.process_time()
        where = (self.task, self.split, g.config, self.store, torch.device(g.device), g.glue_dir)
        ctx, meta = prepare_context(*where, g.model_factory, g.progress)
        if meta.get("published_here") is False:
            logger.info("another process published this checkpoint first: using its weights")
        tuning = {"finetune_wall": meta["finetune_seconds"]}
        tuning["finetune_cpu"] = meta["finetune_cpu_seconds"]
        self.timing("prepare", time.perf_counter() - w0, time.process_time() - c0, **tuning)
        logger.info(f"MAP val accuracy {meta['val_accuracy']:.3f}")
        return ctx

    def run_ramp(self, ctx: Context, ramp: list[tuple[Method, str]]) -> None:
        """The KFAC-type cells from shared passes, a group at a time (:func:`shared_predictions`).

        A cell's times are its share of its group's passes (``extra.curvature_seconds``, ``extra.shared_cells``);
        a failure of a group's passes fails each of its cells.
        """
        torch.manual_seed(ctx.seed)
        cells = []
        for method, size in ramp:
            try:
                assert method.kron is not None
                cells.append((method, size, method.kron(ctx, size)))
            except Exception as err:  # one broken cell must not stop the ramp
                self.fail(method.name, size, err)
        groups = groups_of([kron for _, _, kron in cells])
        for i, group in enumerate(groups):
            members = [cells[j] for j in group]
            logger.info(f"shared passes: group {i + 1}/{len(groups)}, {len(group)} cells")
            try:
                preds, took = shared_predictions(ctx, [kron for _, _, kron in members])
            except Exception as err:
                for method, size, _ in members:
                    self.fail(method.name, size, err)
                continue
            for (method, size, _), pred in zip(members, preds, strict=True):
                try:
                    record = prediction_record(ctx, method, pred, took["cpu"] / len(group))
                except Exception as err:
                    self.fail(method.name, size, err)
                    continue
                record["seconds"] = pred.fit_seconds + pred.predict_seconds
                record["extra"].update(curvature_seconds=took["fit"], shared_cells=len(group))
                self.done(method.name, size, record)

    def todo(self, method: Method, ctx: Context) -> list[str]:
        cell = partial(Cell, self.task, self.split, method.name)
        return [s for s in method.sizes(ctx) if not self.store.has(cell(s))]

    def prefix(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = f"[{self.task} split {self.split}] {record.getMessage()}", ()
        return True

    def fail(self, name: str, size: str, err: BaseException) -> None:
        line = f"{self.task}/split{self.split}/{name}/{size}: {type(err).__name__}: {err}"
        self.out.failures.append(line)
        logger.warning(f"{name} {size}: FAILED ({line})")
        if not self.grid.keep_going:
            raise err

    def done(self, name: str, size: str, record: dict[str, Any]) -> None:
        self.store.write(Cell(self.task, self.split, name, size), record)
        self.timing(name, record["seconds"], record["cpu_seconds"], size=size)
        extra, r = record.get("extra") or {}, record
        line = f"{name} {size}: acc {r['accuracy']:.3f} nll {r['nll']:.3f} ece {r['ece']:.3f}"
        line += f" ({r['seconds']:.1f} s)"
        # issue 34: a prior at the grid's edge is said at run time, not only in the report
        if edge := extra.get("prior_at_grid_edge"):
            prior = extra.get("prior_precision", 0)
            line += f"; its prior precision {prior:g} is the {edge} value of the grid: widen it (--prior-grid)"
        logger.log(logging.WARNING if edge else logging.INFO, line)

    def timing(self, stage: str, wall: float, cpu: float, **extra: Any) -> None:
        """One stage dict of ``run_grid(..., timings=...)``."""
        where = {"task": self.task, "split": self.split}
        self.out.timings.append({"stage": stage, **extra, **where, "wall": wall, "cpu": cpu})


def run_grid(
    grid: Grid,
    *,
    shard: tuple[int, int] = (0, 1),
    timings: list[dict[str, Any]] | None = None,
    executor: str = "local",
    ray_address: str | None = None,
) -> ResultStore:
    """Fill the grid, one (task, split) unit at a time; finished cells are skipped.

    A unit fine-tunes (or reuses) its MAP once, then runs its cells (:func:`run_unit`) under a claim that
    keeps other processes off it. ``shard=(i, n)``: every n-th unit. ``executor="ray"``: one Ray task per
    unit (:func:`~partialbayes.glue_bench.executors.run_units`), into a results folder every node sees.
    ``grid.config.curvature_pass``: see :class:`RunConfig`.

    With ``grid.keep_going`` a failing cell is logged and skipped; the messages, and one per unit that another
    process holds, are in ``store.failures``. ``timings`` receives one dict per stage: ``{"stage": "prepare",
    "task", "split", "wall", "cpu", "finetune_wall", "finetune_cpu"}`` and ``{"stage": method, "size", ...}``.

    Raises:
        TypeError: If ``grid`` is no :class:`Grid`.
        ValueError: Unknown tasks or methods, none at all, a ``--model`` folder that is missing or has no
            tokenizer, or a results folder of another configuration (before any work).
    """
    check_type("run_grid: grid", grid, Grid, "a Grid")
    for what in ("tasks", "splits", "methods"):
        if len(getattr(grid, what)) == 0:
            raise ValueError(f"run_grid: {what} is empty: nothing to run")
    for t in grid.tasks:
        task_spec(t)
    methods = tuple(dict.fromkeys(m.name for m in get_methods(grid.methods)))
    if grid.model_factory is None:
        check_model_folder(grid.config.model)
    store = ResultStore(grid.results, grid.config.to_dict())
    folder = Path(grid.glue_dir).absolute() if grid.glue_dir is not None else None
    # what the units share, paths absolute (workers may run elsewhere)
    shared = dataclasses.replace(
        grid,
        methods=methods,
        results=store.root.absolute(),
        device=str(grid.device),
        glue_dir=folder,
    )
    gpus = 1.0 if torch.device(grid.device).type == "cuda" else 0.0
    job, units = partial(run_unit, shared), grid_units(grid.tasks, grid.splits, shard)
    for unit in run_units(units, job, store.root, executor, ray_address, grid.keep_going, gpus):
        store.failures += unit.failures
        if timings is not None:
            timings += unit.timings
    return store
