"""MAP fine-tuning with the paper's Table 5 settings, early stopping, and cached safetensors checkpoints."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from partialbayes.glue_bench.data_glue import Examples, encode
from partialbayes.glue_bench.store import temp_path

Batch = Mapping[str, torch.Tensor]
OPTIMIZERS = ("adamw", "ivon")


@dataclass(frozen=True)
class TrainConfig:
    """Fine-tuning settings (defaults: the paper's Table 5).

    Attributes:
        lr: AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        batch_size: Training batch size.
        epochs: Maximum number of epochs.
        patience: Stop after this many epochs without a better validation accuracy.
        max_length: Maximum sequence length in tokens.
        dropout: Hidden and attention dropout of the encoder.
        optimizer: ``adamw`` or ``ivon``.
        ivon_lr: IVON learning rate.
        ivon_hess_init: IVON initial Hessian.
        seed: Seed of the initialisation of the head and of the batch order.
        freeze_embeddings: Keep the token embedding matrix fixed (about half of MiniLM's weights; the
            quickstart does this to halve the optimizer's cost on CPU; the paper fine-tunes everything).
        length_buckets: ``0`` (default): batches of a random permutation. ``k >= 1``: after the
            permutation, sort each run of ``k`` batches by text length before cutting it into batches,
            then shuffle the batch order, so that a batch holds sentences of similar length and carries
            little padding (the quickstart uses 4: SST-2's short phrases otherwise pad to about 2.7 times
            their tokens). Every example is still seen once per epoch.
    """

    lr: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    batch_size: int = 16
    epochs: int = 10
    patience: int = 3
    max_length: int = 128
    dropout: float = 0.1
    optimizer: str = "adamw"
    ivon_lr: float = 0.1
    ivon_hess_init: float = 0.1
    seed: int = 0
    freeze_embeddings: bool = False
    length_buckets: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; valid optimizers: {', '.join(OPTIMIZERS)}"
            )
        for key in ("batch_size", "epochs", "patience", "max_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.length_buckets < 0:
            raise ValueError(f"length_buckets must be >= 0, got {self.length_buckets}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


def model_inputs(batch: Batch, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The model's keyword inputs of a batch (everything but ``labels``), moved to ``device``."""
    return {k: v.to(device) for k, v in batch.items() if k != "labels"}


def logits_of(model: nn.Module, batch: Batch, device: torch.device | str) -> torch.Tensor:
    """(B, C) logits of a Hugging Face classifier on a dict batch."""
    return model(**model_inputs(batch, device)).logits


@torch.no_grad()
def predict_logits(
    model: nn.Module, batches: Iterable[Batch], device: torch.device | str
) -> torch.Tensor:
    """(N, C) float64 logits over all batches, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        out = [logits_of(model, b, device).double().cpu() for b in batches]
    finally:
        model.train(was_training)
    return torch.cat(out)


def labels_of(batches: Iterable[Batch]) -> torch.Tensor:
    """(N,) int64 labels over all batches."""
    return torch.cat([b["labels"] for b in batches])


def accuracy(model: nn.Module, batches: Sequence[Batch], device: torch.device | str) -> float:
    """Accuracy of the model on the batches."""
    logits = predict_logits(model, batches, device)
    return float((logits.argmax(-1) == labels_of(batches)).double().mean())


def _epoch_batches(
    train: Examples, tokenizer: Any, config: TrainConfig, epoch: int
) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(config.seed * 1000 + epoch)
    order = torch.randperm(len(train), generator=gen).tolist()
    if config.length_buckets == 0:
        return encode(train.take(order), tokenizer, config.batch_size, config.max_length)
    span = config.length_buckets * config.batch_size
    batches = []
    for start in range(0, len(order), span):
        bucket = train.take(order[start : start + span])
        batches += encode(
            bucket, tokenizer, config.batch_size, config.max_length, sort_by_length=True
        )
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def _make_optimizer(model: nn.Module, config: TrainConfig, n_train: int) -> torch.optim.Optimizer:
    if config.freeze_embeddings:
        get = getattr(model, "get_input_embeddings", None)
        emb = get() if get is not None else None
        if emb is None:
            raise ValueError("freeze_embeddings: the model exposes no get_input_embeddings()")
        emb.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "ivon":
        from partialbayes.ivon import IVON  # optional at import time: sibling package

        return IVON(
            params,
            lr=config.ivon_lr,
            ess=float(n_train),
            hess_init=config.ivon_hess_init,
            weight_decay=1e-4,
        )
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, foreach=True
    )


def finetune(
    model: nn.Module,
    tokenizer: Any,
    train: Examples,
    val: Examples,
    config: TrainConfig,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place; keep the weights of the epoch with the best validation accuracy.

    Returns:
        A summary: best epoch, its validation accuracy, per-epoch history, wall-clock ``seconds`` and
        process ``cpu_seconds`` (all threads); with
        ``optimizer="ivon"`` also ``"ivon_hess"`` (parameter name -> Hessian estimate) and ``"ivon"``
        (the hyperparameters needed to rebuild the posterior).
    """
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"need training and validation examples, got {len(train)} and {len(val)}")
    torch.manual_seed(config.seed)
    model.to(device)
    opt = _make_optimizer(model, config, len(train))
    val_batches = encode(val, tokenizer, 64, config.max_length, sort_by_length=True)
    best_acc, best_epoch, stale = -1.0, -1, 0
    best_state: dict[str, torch.Tensor] | None = None
    best_hess: dict[str, torch.Tensor] | None = None
    history = []
    start, start_cpu = time.perf_counter(), time.process_time()
    for epoch in range(config.epochs):
        model.train()
        batches = _epoch_batches(train, tokenizer, config, epoch)
        bar = tqdm(batches, desc=f"fine-tune epoch {epoch + 1}", disable=not progress, leave=False)
        total = 0.0
        for batch in bar:
            labels = batch["labels"].to(device)
            if config.optimizer == "ivon":
                with opt.sampled_params(train=True):  # type: ignore[attr-defined]
                    loss = F.cross_entropy(logits_of(model, batch, device), labels)
                    loss.backward()
            else:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(logits_of(model, batch, device), labels)
                loss.backward()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss at epoch {epoch + 1}")
            opt.step()
            total += float(loss.detach())
            bar.set_postfix(loss=f"{loss.item():.3f}")
        acc = accuracy(model, val_batches, device)
        history.append(
            {"epoch": epoch + 1, "train_loss": total / len(batches), "val_accuracy": acc}
        )
        if acc > best_acc:
            best_acc, best_epoch, stale = acc, epoch + 1, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best_hess = _ivon_hessians(model, opt) if config.optimizer == "ivon" else None
        else:
            stale += 1
            if stale >= config.patience:
                break
    assert best_state is not None
    model.load_state_dict(best_state)
    model.eval()
    summary: dict[str, Any] = {
        "best_epoch": best_epoch,
        "val_accuracy": best_acc,
        "history": history,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - start_cpu,
    }
    if config.optimizer == "ivon":
        summary["ivon_hess"] = best_hess
        group = opt.param_groups[0]
        summary["ivon"] = {"ess": group["ess"], "weight_decay": group["weight_decay"]}
    return summary


def _ivon_hessians(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        name: opt.state[p]["hess"].detach().clone()
        for name, p in model.named_parameters()
        if p in opt.state and "hess" in opt.state[p]
    }


def save_checkpoint(
    model: nn.Module,
    folder: Path,
    meta: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Publish a checkpoint directory ``folder`` in one atomic step, unless one is there already.

    ``model.safetensors`` (the state dict), the optional ``ivon_hess.safetensors`` (``extra``) and
    ``meta.json`` are written into a fresh temporary sibling directory (host name, pid and a random token in
    its name), which is then renamed onto ``folder`` with one ``os.rename``. A reader therefore sees either
    no checkpoint or a complete one whose weights and meta come from the same training. When ``folder``
    already holds a checkpoint (another process sharing the results folder published first), the rename
    fails, this checkpoint is discarded and ``folder`` is left as it is: load it with
    :func:`load_checkpoint` to use the published weights.

    Returns:
        ``True`` when this call published ``folder``, ``False`` when another checkpoint was already there.
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
    """Load the checkpoint published at ``folder`` into ``model``; ``None`` when there is none.

    Returns:
        ``(meta, ivon_hessians or None)``.

    Raises:
        ValueError: The checkpoint does not match the model's parameter names or shapes, or ``folder`` is
            a non-empty directory without ``meta.json`` (not written by :func:`save_checkpoint`, e.g. an
            interrupted write of an older version).
    """
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    if not (folder / "meta.json").is_file():
        raise ValueError(
            f"checkpoint folder {folder} is incomplete (no meta.json); delete it to fine-tune again"
        )
    meta = json.loads((folder / "meta.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    own = model.state_dict()
    if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
        raise ValueError(f"checkpoint {folder} does not match the model's structure")
    model.load_state_dict(state)
    model.eval()
    hess_path = folder / "ivon_hess.safetensors"
    hess = load_file(str(hess_path)) if hess_path.is_file() else None
    return meta, hess
