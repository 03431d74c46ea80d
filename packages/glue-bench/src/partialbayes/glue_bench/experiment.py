"""Run the GLUE grid: fine-tune (or reuse) one MAP per (task, split), then fill every method cell."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from partialbayes.glue_bench.data_glue import encode, load_glue, split_indices, task_spec
from partialbayes.glue_bench.methods import Context, Method, Settings, get_methods
from partialbayes.glue_bench.metrics import all_metrics
from partialbayes.glue_bench.models import DEFAULT_MODEL, load_encoder
from partialbayes.glue_bench.store import Cell, ResultStore, shard_units
from partialbayes.glue_bench.train import TrainConfig, finetune, load_checkpoint, save_checkpoint

ModelFactory = Callable[[str, int, float], tuple[torch.nn.Module, Any]]


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
        seed: Base seed.
    """

    model: str = DEFAULT_MODEL
    train: TrainConfig = field(default_factory=TrainConfig)
    settings: Settings = field(default_factory=Settings)
    max_train_examples: int | None = None
    max_test_examples: int | None = None
    curvature_batch_size: int = 16
    seed: int = 0

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
        }


def _to(
    batches: list[dict[str, torch.Tensor]], device: torch.device
) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


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

    The checkpoint is fine-tuned only when ``store`` holds none for (task, split, model); it is then
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
    tcfg = TrainConfig(**{**config.train.to_dict(), "betas": config.train.betas, "seed": seed})
    model, tokenizer = factory(config.model, spec.num_labels, tcfg.dropout)
    model.to(device)
    folder = store.checkpoint_dir(task, split, config.model)
    loaded = load_checkpoint(model, folder)
    own: dict[str, Any] = {"cached": True, "finetune_seconds": 0.0, "finetune_cpu_seconds": 0.0}
    if loaded is None:
        summary = finetune(model, tokenizer, train, val, tcfg, device, progress=progress)
        hess = summary.pop("ivon_hess", None)
        meta = {"task": task, "split": split, "model": config.model, **summary}
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
    bs, ml = config.curvature_batch_size, tcfg.max_length
    ctx = Context(
        model=model,
        train=_to(encode(train, tokenizer, bs, ml, sort_by_length=True), device),
        val=_to(encode(val, tokenizer, bs, ml, sort_by_length=True), device),
        test=_to(encode(test, tokenizer, bs, ml, sort_by_length=True), device),
        num_labels=spec.num_labels,
        device=device,
        seed=seed,
        settings=config.settings,
        ivon=ivon,
    )
    return ctx, meta


def run_cell(ctx: Context, method: Method, size: str) -> dict[str, Any]:
    """Run one cell and return its record (metrics, floats, times, method facts).

    ``fit_seconds`` and ``predict_seconds`` are wall-clock times measured by the method; ``cpu_seconds``
    is the process CPU time of the whole cell (all threads), a load-independent cost measure on a shared
    machine.
    """
    torch.manual_seed(ctx.seed)
    cpu = time.process_time()
    pred = method.run(ctx, size)
    cpu = time.process_time() - cpu
    labels = ctx.labels("test")
    if not torch.isfinite(pred.probs).all():
        raise ValueError(f"method {method.name!r} size {size} produced non-finite probabilities")
    return {
        **all_metrics(pred.probs, labels),
        "n_test": len(labels),
        "floats": pred.floats,
        "n_stochastic": pred.n_stochastic,
        "percent_stochastic": pred.percent_stochastic,
        "fit_seconds": pred.fit_seconds,
        "predict_seconds": pred.predict_seconds,
        "cpu_seconds": cpu,
        "extra": pred.extra,
    }


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

    With ``keep_going`` a cell that raises is logged and skipped (no record is written, so a later run
    retries it); the messages are in ``store.failures``. Otherwise the first failure propagates.
    ``timings``, when given, receives one dict per stage run here: ``{"stage": "prepare", "task",
    "split", "wall", "cpu", "finetune_wall", "finetune_cpu"}`` (fine-tuning times are 0 for a cached
    checkpoint) and ``{"stage": method, "size", "task", "split", "wall", "cpu"}`` per computed cell.

    Returns:
        The results store.
    """
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
    for (task, split), names in by_ts.items():
        ctx: Context | None = None
        for name in sorted(names, key=list(methods).index):
            method = methods[name]
            if ctx is None:
                log(f"[{task} split {split}] preparing model {config.model}")
                w0, c0 = time.perf_counter(), time.process_time()
                ctx, meta = prepare_context(
                    task, split, config, store, device, glue_dir, model_factory, progress
                )
                if meta.get("published_here") is False:
                    log(
                        f"[{task} split {split}] another process published this checkpoint first: "
                        "using its weights"
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
            sizes = method.sizes(ctx)
            todo = [s for s in sizes if not store.has(Cell(task, split, name, s))]
            bar = tqdm(todo, desc=f"{task}/{split}/{name}", disable=not progress, leave=False)
            for size in bar:
                t0 = time.perf_counter()
                try:
                    record = run_cell(ctx, method, size)
                except Exception as err:  # one broken cell must not stop the grid
                    failures.append(
                        f"{task}/split{split}/{name}/{size}: {type(err).__name__}: {err}"
                    )
                    log(f"[{task} split {split}] {name} {size}: FAILED ({failures[-1]})")
                    if not keep_going:
                        raise
                    continue
                record["seconds"] = time.perf_counter() - t0
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
    return store
