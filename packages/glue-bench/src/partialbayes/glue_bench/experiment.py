"""Run the GLUE grid: fine-tune (or reuse) one MAP per (task, split), then fill every method cell."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from partialbayes.glue_bench.context import Context, Prediction, Settings
from partialbayes.glue_bench.data_glue import (
    count_truncated,
    data_fingerprint,
    encode,
    load_glue,
    split_indices,
    task_spec,
)
from partialbayes.glue_bench.methods import Method, get_methods
from partialbayes.glue_bench.metrics import all_metrics
from partialbayes.glue_bench.models import DEFAULT_MODEL, load_encoder
from partialbayes.glue_bench.ramp import run_shared
from partialbayes.glue_bench.store import Cell, ResultStore, shard_units
from partialbayes.glue_bench.train import TrainConfig, finetune, load_checkpoint, save_checkpoint

ModelFactory = Callable[[str, int, float], tuple[torch.nn.Module, Any]]
CURVATURE_PASSES = ("shared", "per-cell")


@dataclass
class RunConfig:
    """Everything that determines the results (stored as the results folder's configuration).

    Attributes:
        model: Model name or path (``minilm`` is the packaged default).
        train: Fine-tuning settings.
        settings: Method hyperparameters.
        max_train_examples: Cap on the training part of each split (``None``: the paper's sizes).
        max_test_examples: Cap on the test set (``None``: the whole GLUE dev set).
        curvature_batch_size: Batch size of the curvature, SWAG and prediction passes.
        seed: Base seed. Split ``k`` of a run uses ``seed · 100 + k`` for everything random: the new
            classification head, the batch order, dropout, IVON's noise, SWAG's and IVON's samples, random
            module choices and the MC fisher (each kind of draw its own generator).
        curvature_pass: How the KFAC / S-KFAC / module-ramp Laplace cells of a (task, split) get their
            curvature and predictive passes: ``shared`` (default: one pass over the training set for the
            whole ramp, stored beside the checkpoint, and one pass over the validation and test sets,
            :mod:`partialbayes.glue_bench.ramp`) or ``per-cell`` (each cell on its own). Both give the same
            records (up to the timing fields and this field); a results folder holds one of them.
    """

    model: str = DEFAULT_MODEL
    train: TrainConfig = field(default_factory=TrainConfig)
    settings: Settings = field(default_factory=Settings)
    max_train_examples: int | None = None
    max_test_examples: int | None = None
    curvature_batch_size: int = 16
    seed: int = 0
    curvature_pass: str = "shared"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"RunConfig.model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.train, TrainConfig):
            raise TypeError(
                f"RunConfig.train must be a TrainConfig, got {type(self.train).__name__}"
            )
        if not isinstance(self.settings, Settings):
            raise TypeError(
                f"RunConfig.settings must be a Settings, got {type(self.settings).__name__}"
            )
        for key in ("max_train_examples", "max_test_examples", "curvature_batch_size", "seed"):
            value = getattr(self, key)
            if value is None and key.startswith("max_"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"RunConfig.{key} must be an int, got {value!r}")
            low = 0 if key == "seed" else 1
            if value < low:
                raise ValueError(f"RunConfig.{key} must be >= {low}, got {value}")
        if self.curvature_pass not in CURVATURE_PASSES:
            raise ValueError(
                f"RunConfig.curvature_pass must be one of {CURVATURE_PASSES}, got "
                f"{self.curvature_pass!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (the store's fingerprint is taken of it)."""
        return {
            "model": self.model,
            "train": self.train.to_dict(),
            "settings": self.settings.to_dict(),
            "max_train_examples": self.max_train_examples,
            "max_test_examples": self.max_test_examples,
            "curvature_batch_size": self.curvature_batch_size,
            "seed": self.seed,
            "curvature_pass": self.curvature_pass,
        }


def _to(
    batches: list[dict[str, torch.Tensor]], device: torch.device
) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def model_length_limit(model: torch.nn.Module, tokenizer: Any) -> int:
    """The longest input ``model`` takes: its position embeddings and the tokenizer's ``model_max_length``."""
    limits = [
        getattr(getattr(model, "config", None), "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    usable = [int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000]
    return min(usable) if usable else 512


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
    """Load data, fine-tune or reuse the checkpoint of (task, split), and build the method context.

    Args:
        task: GLUE task name.
        split: Split index (seeds the train/validation permutation and the fine-tuning).
        config: The run configuration.
        store: Results store (holds the checkpoint cache).
        device: Device of the model and batches.
        glue_dir: GLUE folder; default ``$PARTIALBAYES_DATA/glue`` (or the hub).
        model_factory: ``(name, num_labels, dropout) -> (model, tokenizer)``; default :func:`load_encoder`.
        progress: Show progress bars.

    The model is built after seeding the global generator with the split's seed, so a freshly initialised
    classification head is the same in every run with the same configuration. The data of the task are
    checked against the ones the results folder was filled with (``ResultStore.check_data``) before any
    work. The checkpoint is fine-tuned only when ``store`` holds none for (task, split, model); it is then
    published atomically (:func:`~partialbayes.glue_bench.train.save_checkpoint`). Either way the model is
    loaded from the published checkpoint, so shards that fine-tuned the same checkpoint concurrently all
    score with the one that was published first.

    Returns:
        ``(context, checkpoint meta)``: the published meta plus ``cached`` (no fine-tuning here),
        ``finetune_seconds`` / ``finetune_cpu_seconds`` (this process's fine-tuning, 0 when cached) and,
        after fine-tuning, ``published_here`` (``False``: another process published first and its
        weights are used).
    """
    spec = task_spec(task)
    factory = model_factory or (lambda n, c, d: load_encoder(n, c, dropout=d))
    train_all, test = load_glue(task, glue_dir)
    tr_idx, val_idx = split_indices(len(train_all), spec, split, config.max_train_examples)
    train, val = train_all.take(tr_idx), train_all.take(val_idx)
    if config.max_test_examples is not None:
        test = test.take(range(min(config.max_test_examples, len(test))))
    seed = config.seed * 100 + split
    torch.manual_seed(seed)  # the new classification head (and anything else the factory draws)
    model, tokenizer = factory(config.model, spec.num_labels, config.train.dropout)
    # checked only now: a model that cannot be loaded leaves no results folder behind
    store.check_data(task, data_fingerprint(train_all, test))
    limit = model_length_limit(model, tokenizer)
    max_length = min(config.train.max_length or limit, limit)
    tcfg = dataclasses.replace(config.train, seed=seed, max_length=max_length)
    model.to(device)
    folder = store.checkpoint_dir(task, split, config.model)
    loaded = load_checkpoint(model, folder)
    own: dict[str, Any] = {"cached": True, "finetune_seconds": 0.0, "finetune_cpu_seconds": 0.0}
    if loaded is None:
        summary = finetune(model, tokenizer, train, val, tcfg, device, progress=progress)
        hess = summary.pop("ivon_hess", None)
        truncated = {
            name: count_truncated(part, tokenizer, max_length)
            for name, part in (("train", train), ("val", val), ("test", test))
        }
        meta = {
            "task": task,
            "split": split,
            "model": config.model,
            "max_length": max_length,
            "truncated": truncated,
            **summary,
        }
        store.claim()
        published = save_checkpoint(model, folder, meta, hess)
        own = {
            "cached": False,
            "published_here": published,
            "finetune_seconds": float(summary["seconds"]),
            "finetune_cpu_seconds": float(summary["cpu_seconds"]),
        }
        # Score with the published weights, not the in-memory ones: when another shard published this
        # checkpoint first, ours was discarded, and every cell of the folder must use the same MAP.
        loaded = load_checkpoint(model, folder)
        if (
            loaded is None
        ):  # pragma: no cover - save_checkpoint either published or found a checkpoint
            raise RuntimeError(f"checkpoint {folder} vanished after it was published")
    meta, hess = loaded
    meta = {**meta, **own}
    model.eval()
    ivon = None
    if hess is not None and "ivon" in meta:
        ivon = {"hess": hess, **meta["ivon"], "finetune_seconds": float(meta["seconds"])}
    bs = config.curvature_batch_size
    ctx = Context(
        model=model,
        train=_to(encode(train, tokenizer, bs, max_length, sort_by_length=True), device),
        val=_to(encode(val, tokenizer, bs, max_length, sort_by_length=True), device),
        test=_to(encode(test, tokenizer, bs, max_length, sort_by_length=True), device),
        num_labels=spec.num_labels,
        device=device,
        seed=seed,
        settings=config.settings,
        ivon=ivon,
        curvature_dir=folder / "curvature",
    )
    return ctx, meta


def prediction_record(ctx: Context, method: Method, pred: Prediction, cpu: float) -> dict[str, Any]:
    """The results record of a finished cell (metrics on the test set, floats, times, method facts).

    Raises:
        ValueError: Non-finite probabilities (naming the method).
    """
    labels = ctx.labels("test")
    if not torch.isfinite(pred.probs).all():
        raise ValueError(f"method {method.name!r} produced non-finite probabilities")
    record = {
        **all_metrics(pred.probs, labels),
        "n_test": len(labels),
        "val_nll": pred.val_nll,
        "floats": pred.floats,
        "n_stochastic": pred.n_stochastic,
        "percent_stochastic": pred.percent_stochastic,
        "fit_seconds": pred.fit_seconds,
        "predict_seconds": pred.predict_seconds,
        "cpu_seconds": cpu,
        "extra": pred.extra,
    }
    if pred.curvature_pass is not None:
        record["curvature_pass"] = pred.curvature_pass
    return record


def run_cell(ctx: Context, method: Method, size: str) -> dict[str, Any]:
    """Run one cell on its own and return its record (metrics, floats, times, method facts).

    The global generator is seeded by the (task, split) first (SWAG's dropout draws use it), so a cell
    gives the same record whatever ran before it. ``fit_seconds`` and ``predict_seconds`` are wall-clock
    times measured by the method; ``cpu_seconds`` is the process CPU time of the whole cell (all threads),
    a load-independent cost measure on a shared machine.
    """
    torch.manual_seed(ctx.seed)
    cpu = time.process_time()
    pred = method.run(ctx, size)
    cpu = time.process_time() - cpu
    try:
        return prediction_record(ctx, method, pred, cpu)
    except ValueError as err:
        raise ValueError(f"{err} (size {size})") from None


def shares_curvature(method: Method, config: RunConfig) -> bool:
    """Whether ``method``'s cells run in the shared ramp (``curvature_pass="shared"`` and a KFAC subset)."""
    return config.curvature_pass == "shared" and method.kron is not None


def run_grid(
    tasks: Sequence[str],
    splits: Sequence[int],
    method_names: Sequence[str],
    config: RunConfig,
    results: str | Path,
    device: str | torch.device = "cpu",
    glue_dir: str | Path | None = None,
    shard: tuple[int, int] = (0, 1),
    model_factory: ModelFactory | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    keep_going: bool = False,
    timings: list[dict[str, Any]] | None = None,
) -> ResultStore:
    """Fill the (task, split, method, size) grid of this shard; finished cells are skipped.

    With ``config.curvature_pass="shared"`` the KFAC-type Laplace cells of a (task, split) (``kfac-full``,
    ``skfac``, the ``kfac-*`` module ramps) run together from one curvature pass
    (:func:`partialbayes.glue_bench.ramp.run_shared`), at the place of the first such method; every other
    cell runs on its own (:func:`run_cell`).

    With ``keep_going`` a cell that raises is logged and skipped (no record is written, so a later run
    retries it); the messages are in ``store.failures``. Otherwise the first failure propagates.
    ``timings``, when given, receives one dict per stage run here: ``{"stage": "prepare", "task",
    "split", "wall", "cpu", "finetune_wall", "finetune_cpu"}`` (fine-tuning times are 0 for a cached
    checkpoint), ``{"stage": "shared passes", "task", "split", "wall", "cpu"}`` for the shared curvature
    and predictive passes, and ``{"stage": method, "size", "task", "split", "wall", "cpu"}`` per computed
    cell.

    Returns:
        The results store.

    Raises:
        ValueError: Unknown tasks or methods, no task, split or method at all, or a results folder of
            another configuration (before any work).
    """
    for what, values in (("tasks", tasks), ("splits", splits), ("methods", method_names)):
        if len(values) == 0:
            raise ValueError(f"run_grid: {what} is empty: nothing to run")
    for t in tasks:
        task_spec(t)
    methods = {m.name: m for m in get_methods(method_names)}
    device = torch.device(device)
    store = ResultStore(results, config.to_dict())
    failures = store.failures
    units = shard_units([(t, s, m) for t in tasks for s in splits for m in methods], shard)
    by_ts: dict[tuple[str, int], list[str]] = {}
    for t, s, m in units:
        by_ts.setdefault((t, s), []).append(m)

    def fail(task: str, split: int, name: str, size: str, err: BaseException) -> None:
        failures.append(f"{task}/split{split}/{name}/{size}: {type(err).__name__}: {err}")
        log(f"[{task} split {split}] {name} {size}: FAILED ({failures[-1]})")
        if not keep_going:
            raise err

    def done(task: str, split: int, name: str, size: str, record: dict[str, Any]) -> None:
        store.write(Cell(task, split, name, size), record)
        if timings is not None:
            timings.append(
                {
                    "stage": name,
                    "size": size,
                    "task": task,
                    "split": split,
                    "wall": record["seconds"],
                    "cpu": record["cpu_seconds"],
                }
            )
        log(
            f"[{task} split {split}] {name} {size}: acc {record['accuracy']:.3f} "
            f"nll {record['nll']:.3f} ece {record['ece']:.3f} ({record['seconds']:.1f} s)"
        )

    for (task, split), names in by_ts.items():
        ctx: Context | None = None
        shared_done = False
        for name in sorted(names, key=list(methods).index):
            method = methods[name]
            if ctx is None:
                ctx = _prepare(
                    task,
                    split,
                    config,
                    store,
                    device,
                    glue_dir,
                    model_factory,
                    progress,
                    log,
                    timings,
                )
            if shares_curvature(method, config):
                if not shared_done:
                    shared_done = True
                    group = [
                        (methods[n], size)
                        for n in sorted(names, key=list(methods).index)
                        if shares_curvature(methods[n], config)
                        for size in methods[n].sizes(ctx)
                        if not store.has(Cell(task, split, n, size))
                    ]
                    if group:
                        _run_shared_group(ctx, task, split, group, log, timings, fail, done)
                continue
            sizes = method.sizes(ctx)
            todo = [s for s in sizes if not store.has(Cell(task, split, name, s))]
            bar = tqdm(todo, desc=f"{task}/{split}/{name}", disable=not progress, leave=False)
            for size in bar:
                t0 = time.perf_counter()
                try:
                    record = run_cell(ctx, method, size)
                except Exception as err:  # one broken cell must not stop the grid
                    fail(task, split, name, size, err)
                    continue
                record["seconds"] = time.perf_counter() - t0
                done(task, split, name, size, record)
    return store


def _prepare(
    task: str,
    split: int,
    config: RunConfig,
    store: ResultStore,
    device: torch.device,
    glue_dir: str | Path | None,
    model_factory: ModelFactory | None,
    progress: bool,
    log: Callable[[str], None],
    timings: list[dict[str, Any]] | None,
) -> Context:
    log(f"[{task} split {split}] preparing model {config.model}")
    w0, c0 = time.perf_counter(), time.process_time()
    ctx, meta = prepare_context(
        task, split, config, store, device, glue_dir, model_factory, progress
    )
    if meta.get("published_here") is False:
        log(
            f"[{task} split {split}] another process published this checkpoint first: using its weights"
        )
    if timings is not None:
        timings.append(
            {
                "stage": "prepare",
                "task": task,
                "split": split,
                "wall": time.perf_counter() - w0,
                "cpu": time.process_time() - c0,
                "finetune_wall": meta["finetune_seconds"],
                "finetune_cpu": meta["finetune_cpu_seconds"],
            }
        )
    log(f"[{task} split {split}] MAP val accuracy {meta['val_accuracy']:.3f}")
    return ctx


def _run_shared_group(
    ctx: Context,
    task: str,
    split: int,
    group: list[tuple[Method, str]],
    log: Callable[[str], None],
    timings: list[dict[str, Any]] | None,
    fail: Callable[[str, int, str, str, BaseException], None],
    done: Callable[[str, int, str, str, dict[str, Any]], None],
) -> None:
    """The shared ramp of one (task, split): records written as the cells finish."""
    torch.manual_seed(ctx.seed)
    w0, c0 = time.perf_counter(), time.process_time()
    own_wall = own_cpu = 0.0
    info = None
    for method, size, result, info in run_shared(
        ctx, group, log=lambda m: log(f"[{task} split {split}] {m}")
    ):
        if isinstance(result, BaseException):
            fail(task, split, method.name, size, result)
            continue
        try:
            record = prediction_record(ctx, method, result, 0.0)
        except ValueError as err:
            fail(task, split, method.name, size, err)
            continue
        # a shared cell's own time: its posterior and its share of the predictive math (the shared
        # passes are reported once, as the "shared passes" stage and in extra.curvature_seconds)
        record["seconds"] = result.fit_seconds + result.predict_seconds
        record["cpu_seconds"] = result.extra.pop("cpu_seconds")
        record["extra"]["curvature_seconds"] = info.curvature_seconds
        record["extra"]["shared_cells"] = info.cells
        own_wall += record["seconds"]
        own_cpu += record["cpu_seconds"]
        done(task, split, method.name, size, record)
    if timings is not None and info is not None:
        timings.append(
            {
                "stage": "shared passes",
                "task": task,
                "split": split,
                "wall": max(time.perf_counter() - w0 - own_wall, 0.0),
                "cpu": max(time.process_time() - c0 - own_cpu, 0.0),
            }
        )
