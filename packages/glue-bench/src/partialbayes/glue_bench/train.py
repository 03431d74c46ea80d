"""MAP fine-tuning with the paper's Table 5 settings, early stopping, and cached safetensors checkpoints."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from partialbayes.glue_bench.context import batch_logits
from partialbayes.glue_bench.data_glue import Examples, encode
from partialbayes.glue_bench.store import atomic_write, json_ready, read_json, temp_path
from partialbayes.ivon import IVON
from partialbayes.predictive.internal import (
    check_fields,
    check_known,
    eval_mode,
    model_logits,
    ranged,
    split_batch,
)
from partialbayes.selection.internal import countable_named_parameters

Batch = Mapping[str, torch.Tensor]
OPTIMIZERS = ("adamw", "ivon")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Fine-tuning settings (defaults: the paper's Table 5).

    Attributes:
        lr: AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        batch_size: Training batch size.
        epochs: Maximum number of epochs; 0: the model is the MAP as it is (a classifier fine-tuned for
            the task); the validation set still serves the post-hoc methods.
        patience: Stop after this many epochs without a better validation accuracy.
        max_length: Maximum sequence length in tokens; ``None``: the model's own limit, so nothing is
            truncated (as in the paper, whose Table 4 gives the longest examples in characters).
        dropout: Hidden and attention dropout of the encoder.
        optimizer: ``adamw`` or ``ivon``; with ``ivon`` the embeddings are still trained by AdamW and stay
            deterministic: IVON and its posterior cover the countable parameters only.
        ivon_lr: IVON learning rate.
        ivon_hess_init: IVON initial Hessian.
        seed: Seed of the batch order, dropout and IVON's weight noise.
        freeze_embeddings: Keep the token embedding matrix fixed (the quickstart's CPU shortcut).
        length_buckets: ``k >= 1``: sort each run of ``k`` shuffled batches by text length before cutting
            it into batches (less padding; every example still seen once per epoch); ``0``: plain.
    """

    lr: float = ranged(5e-5, "(0, inf)")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = ranged(0.01, "[0, inf)")
    batch_size: int = ranged(16, "[1, inf)", int)
    epochs: int = ranged(10, "[0, inf)", int)
    patience: int = ranged(3, "[1, inf)", int)
    max_length: int | None = ranged(None, "[1, inf)", int, optional=True)
    dropout: float = ranged(0.1, "[0, 1)")
    optimizer: str = "adamw"
    ivon_lr: float = ranged(0.1, "(0, inf)")
    ivon_hess_init: float = ranged(0.1, "(0, inf)")
    seed: int = ranged(0, "[0, inf)", int)
    freeze_embeddings: bool = False
    length_buckets: int = ranged(0, "[0, inf)", int)

    def __post_init__(self) -> None:
        check_known("optimizer", self.optimizer, OPTIMIZERS)
        check_fields(self)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.optimizer == "ivon" and self.epochs == 0:
            raise ValueError(
                "TrainConfig: optimizer 'ivon' needs epochs >= 1 (its posterior is trained)"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return json_ready(self)


def accuracy(model: nn.Module, batches: Sequence[Batch], device: torch.device | str) -> float:
    """Accuracy of ``model`` on dict batches, in eval mode (the model's mode is restored)."""
    with eval_mode(model):
        logits = batch_logits(model, batches, device)
    return float((logits.argmax(-1) == torch.cat([b["labels"] for b in batches])).double().mean())


def _epoch_batches(train: Examples, tokenizer: Any, config: TrainConfig, epoch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(config.seed * 1000 + epoch)
    order = torch.randperm(len(train), generator=gen).tolist()
    bs, max_length = config.batch_size, config.max_length
    if config.length_buckets == 0:
        return encode(train.take(order), tokenizer, bs, max_length)
    span, batches = config.length_buckets * bs, []
    for start in range(0, len(order), span):
        batches += encode(train.take(order[start : start + span]), tokenizer, bs, max_length, True)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def _make_optimizers(model: nn.Module, config: TrainConfig, n: int) -> list[torch.optim.Optimizer]:
    """``[AdamW]``, or ``[IVON on the countable parameters (``n`` data), AdamW on the others (embeddings)]``."""
    if config.freeze_embeddings:
        get = getattr(model, "get_input_embeddings", None)
        if (emb := get() if get is not None else None) is None:
            raise ValueError("freeze_embeddings: the model exposes no get_input_embeddings()")
        emb.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = {"lr": config.lr, "betas": config.betas, "weight_decay": config.weight_decay}
    if config.optimizer != "ivon":
        return [torch.optim.AdamW(params, **adamw, foreach=True)]
    countable = {id(p) for p in countable_named_parameters(model).values()}
    others = [p for p in params if id(p) not in countable]
    ivon = {"lr": config.ivon_lr, "ess": float(n), "hess_init": config.ivon_hess_init}
    ivon.update(weight_decay=1e-4, generator=torch.Generator().manual_seed(config.seed))
    opts = [IVON([p for p in params if id(p) in countable], **ivon)]
    return [*opts, torch.optim.AdamW(others, **adamw, foreach=True)] if others else opts


def train_epoch(
    model: nn.Module,
    opts: Sequence[torch.optim.Optimizer],
    batches: Sequence[Batch],
    device: torch.device | str,
    epoch: int,
    progress: bool = True,
) -> float:
    """One epoch of steps in training mode (the caller's mode restored); the mean loss (non-finite: raises).

    ``opts`` from :func:`_make_optimizers` (IVON first: it samples the weights and zeroes its own gradients).
    """
    ivon = opts[0] if isinstance(opts[0], IVON) else None
    was_training = model.training
    model.train()
    try:
        bar = tqdm(batches, desc=f"fine-tune epoch {epoch + 1}", disable=not progress, leave=False)
        total = 0.0
        for batch in bar:
            for o in opts[1:] if ivon is not None else opts:
                o.zero_grad(set_to_none=True)
            with ivon.sampled_params(train=True) if ivon is not None else nullcontext():
                logits = model_logits(model, split_batch(batch, device=device).inputs)
                loss = F.cross_entropy(logits, batch["labels"].to(device))
                loss.backward()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss at epoch {epoch + 1}")
            for o in opts:
                o.step()
            total += float(loss.detach())
            bar.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        model.train(was_training)
    return total / len(batches)


def finetune(
    model: nn.Module,
    tokenizer: Any,
    train: Examples,
    val: Examples,
    config: TrainConfig,
    device: torch.device | str = "cpu",
    progress: bool = True,
    resume: Path | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place; keep the weights of the epoch with the best validation accuracy.

    ``epochs == 0`` only scores the model. ``resume``: a file that holds the loop's state after every epoch
    (written atomically); an existing one is continued bit for bit (same device and threads). The summary:
    best epoch, its validation accuracy, history, ``seconds``, ``cpu_seconds``; with IVON also ``ivon_hess``
    (name -> Hessian) and ``ivon`` (the hyperparameters that rebuild the posterior).
    """
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"need training and validation examples, got {len(train)} and {len(val)}")
    torch.manual_seed(config.seed)  # dropout; the batch order has its own seeded generator
    model.to(device)
    opts = _make_optimizers(model, config, len(train))
    val_batches = encode(val, tokenizer, 64, config.max_length, sort_by_length=True)
    st = _Progress()
    if resume is not None and resume.is_file():
        st = _read_progress(resume, model, opts, config, device)
        logger.info(f"resuming after epoch {st.epoch}/{config.epochs} from {resume}")
    start, start_cpu = time.perf_counter(), time.process_time()
    while st.epoch < config.epochs and st.stale < config.patience:
        epoch = st.epoch
        batches = _epoch_batches(train, tokenizer, config, epoch)
        loss = train_epoch(model, opts, batches, device, epoch, progress)
        acc = accuracy(model, val_batches, device)
        st.history.append({"epoch": epoch + 1, "train_loss": loss, "val_accuracy": acc})
        st.epoch += 1
        if acc > st.best_acc:
            st.best_acc, st.best_epoch, st.stale = acc, epoch + 1, 0
            st.best = {k: v.detach().clone() for k, v in model.state_dict().items()}
            st.hess = _ivon_hessians(model, opts[0]) if config.optimizer == "ivon" else None
        else:
            st.stale += 1
        if resume is not None:
            took = (time.perf_counter() - start, time.process_time() - start_cpu)
            _write_progress(resume, model, opts, config, st, took)
        logger.info(
            f"epoch {epoch + 1}/{config.epochs}: train loss {loss:.4f}, val accuracy {acc:.3f}"
        )
    if st.best is not None:
        model.load_state_dict(st.best)
    else:  # epochs=0: the model as it came, scored on the validation set
        st.best_acc, st.best_epoch = accuracy(model, val_batches, device), 0
    summary: dict[str, Any] = {"best_epoch": st.best_epoch, "val_accuracy": st.best_acc}
    summary.update(history=st.history, seconds=st.seconds + time.perf_counter() - start)
    summary["cpu_seconds"] = st.cpu_seconds + time.process_time() - start_cpu
    if config.optimizer == "ivon":
        summary["ivon_hess"] = st.hess
        group = opts[0].param_groups[0]
        summary["ivon"] = {"ess": group["ess"], "weight_decay": group["weight_decay"]}
    return summary


_COUNTERS = ("epoch", "best_acc", "best_epoch", "stale", "history")


@dataclass
class _Progress:
    """The fine-tuning loop's state after ``epoch`` finished epochs (what a resumed run continues from)."""

    epoch: int = 0
    best_acc: float = -1.0
    best_epoch: int = -1
    stale: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, torch.Tensor] | None = None
    hess: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def _pack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON with every tensor moved to ``tensors`` (int dict keys and tuples kept)."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().clone().contiguous().cpu()
        return {"tensor": key}
    if isinstance(obj, dict):
        return {"dict": [[k, _pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return {type(obj).__name__: [_pack(v, tensors) for v in obj]}
    return {"value": obj}


def _unpack(obj: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_pack`."""
    ((kind, value),) = obj.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: _unpack(v, tensors) for k, v in value}
    if kind in ("list", "tuple"):
        items = [_unpack(v, tensors) for v in value]
        return items if kind == "list" else tuple(items)
    return value


def _write_progress(
    path: Path,
    model: nn.Module,
    opts: Sequence[torch.optim.Optimizer],
    config: TrainConfig,
    st: _Progress,
    took: tuple[float, float],
) -> None:
    """Write the loop's state after an epoch (model, optimizers, RNGs, best weights) to ``path`` atomically."""
    device = next(model.parameters()).device
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {
        "config": config.to_dict(),
        **{k: getattr(st, k) for k in _COUNTERS},
        "seconds": st.seconds + took[0],
        "cpu_seconds": st.cpu_seconds + took[1],
        "model": _pack(model.state_dict(), tensors),
        "best": _pack(st.best, tensors),
        "hess": _pack(st.hess, tensors),
        "opts": _pack([o.state_dict() for o in opts], tensors),
        "rng": _pack(rng, tensors),
    }
    meta = {"partialbayes": "glue-bench fine-tuning progress", "state": json.dumps(skeleton)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def progress_path(checkpoint: Path) -> Path:
    """The fine-tuning progress file kept beside the (not yet published) checkpoint folder ``checkpoint``."""
    return checkpoint.with_name(checkpoint.name + ".progress.safetensors")


def _read_progress(
    path: Path,
    model: nn.Module,
    opts: Sequence[torch.optim.Optimizer],
    config: TrainConfig,
    device: torch.device | str,
) -> _Progress:
    """Restore the state :func:`_write_progress` saved (``ValueError`` naming a damaged or foreign file)."""
    tensors = _load_tensors(path, "fine-tuning progress")
    try:
        with safe_open(str(path), "pt") as f:
            skel = json.loads(f.metadata()["state"])
        if skel["config"] != config.to_dict():
            raise ValueError("it was written for other fine-tuning settings")
        model.load_state_dict(_unpack(skel["model"], tensors))
        for opt, state in zip(opts, _unpack(skel["opts"], tensors), strict=True):
            opt.load_state_dict(state)
        rng = _unpack(skel["rng"], tensors)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"fine-tuning progress {path} cannot be resumed ({err}); delete it to start over"
        ) from err
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], torch.device(device))
    tensors_of = {k: _unpack(skel[k], tensors) for k in ("best", "hess")}
    return _Progress(**{k: skel[k] for k in (*_COUNTERS, "seconds", "cpu_seconds")}, **tensors_of)


def _ivon_hessians(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    states = {name: opt.state.get(p, {}) for name, p in model.named_parameters()}
    return {name: s["hess"].detach().clone() for name, s in states.items() if "hess" in s}


def save_checkpoint(
    model: nn.Module,
    folder: Path,
    meta: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Publish the checkpoint folder ``folder`` in one ``os.rename`` of a temporary sibling, unless one is there.

    Returns whether this call published it (``False``: another process was first; this one is discarded).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(folder)
    tmp.mkdir()
    try:
        # safetensors refuses shared storage: clone every tensor.
        state = {k: v.detach().clone().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        if extra:
            hess = {k: v.detach().contiguous().cpu() for k, v in extra.items()}
            save_file(hess, str(tmp / "ivon_hess.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        try:
            os.rename(tmp, folder)  # replaces at most an empty directory
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY) and folder.is_dir():
                return False
            raise
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(
    model: nn.Module, folder: Path
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None] | None:
    """Load the checkpoint at ``folder`` into ``model``: ``(meta, IVON Hessians or None)``, or ``None``.

    A structure mismatch, a missing ``meta.json`` or a damaged file raise ``ValueError`` naming it.
    """
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    if not (folder / "meta.json").is_file():
        raise ValueError(
            f"checkpoint folder {folder} is incomplete (no meta.json); delete it to fine-tune again"
        )
    meta = read_json(folder / "meta.json", "checkpoint meta")
    state = _load_tensors(folder / "model.safetensors", "checkpoint weights")
    own = model.state_dict()
    if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
        raise ValueError(f"checkpoint {folder} does not match the model's structure")
    model.load_state_dict(state)
    hess_path = folder / "ivon_hess.safetensors"
    hess = _load_tensors(hess_path, "IVON Hessians") if hess_path.is_file() else None
    return meta, hess


def _load_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """``safetensors`` file ``path``; a missing, truncated or garbage file raises ``ValueError`` naming it."""
    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError, ...: name the file
        raise ValueError(
            f"{what} {path} cannot be read ({type(err).__name__}: {err}); delete the checkpoint "
            f"folder {path.parent} to fine-tune again"
        ) from err
