"""SWAG collection: SGD with momentum on the stochastic entries only, a snapshot every few steps."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialbayes.predictive import flatten_outputs, model_logits, move_batch, split_batch
from partialbayes.swag._labels import check_class_labels
from partialbayes.swag._options import check_collect_options
from partialbayes.swag._posterior import SWAG

Batch = Any
"""A batch of any kind ``partialbayes.predictive.split_batch`` reads: a tensor, an ``(inputs, labels)`` pair,
or a mapping (``dict``, ``transformers.BatchEncoding``) with labels under ``labels`` or ``label``."""
LossFn = Callable[[nn.Module, Batch], Tensor]


class NonFiniteLossError(ValueError):
    """The training loss (or gradient) became NaN or infinite during SWAG collection.

    Attributes:
        step: The 1-based SGD step at which it happened.
        lr: The learning rate in use.
    """

    def __init__(self, step: int, lr: float, what: str) -> None:
        super().__init__(f"non-finite {what} at SGD step {step} (lr={lr}): SWAG collection stopped")
        self.step = step
        self.lr = lr


def to_device(batch: Batch, device: torch.device) -> Any:
    """Move the tensors of a batch of any kind to ``device``, keeping its kind (see ``move_batch``)."""
    return move_batch(batch, device)


def batch_logits(model: nn.Module, batch: Batch) -> Tensor:
    """Logits of ``model`` on a batch of any kind (labels left out of the inputs)."""
    return model_logits(model, split_batch(batch).inputs)


def hf_logits(model: nn.Module, batch: Batch) -> Tensor:
    """Deprecated: ``partialbayes.predictive.model_logits(model, split_batch(batch).inputs)``.

    Logits of a model on a batch of any kind, with the labels left out of the inputs.
    """
    warnings.warn(
        "partialbayes.swag.hf_logits is deprecated and will be removed in partialbayes-swag 0.3; use "
        "partialbayes.predictive.model_logits(model, split_batch(batch).inputs)",
        DeprecationWarning,
        stacklevel=2,
    )
    return batch_logits(model, batch)


def _labelled(batch: Batch) -> Any:
    b = split_batch(batch)
    if b.labels is None:
        keys = f" (keys: {sorted(map(str, batch))})" if isinstance(batch, Mapping) else ""
        raise ValueError(f"batch has no labels under 'labels' or 'label'{keys}")
    return b


def classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean cross-entropy of the model's logits against the batch's labels, over the kept outputs.

    Any batch kind (tensor pairs, dicts, ``BatchEncoding``; labels under ``labels`` or ``label``).
    Sequence-level logits ``[B, C]`` take labels ``[B]``; token-level logits ``[B, T, C]`` take labels
    ``[B, T]``, and positions whose label is -100 or whose attention mask is 0 are left out.
    """
    b = _labelled(batch)
    logits = model_logits(model, b.inputs)
    check_class_labels(logits, b.labels.to(logits.device))
    flat, labels = flatten_outputs(logits, b.labels, attention_mask=b.attention_mask)
    assert labels is not None
    return F.cross_entropy(
        flat.reshape(-1, flat.shape[-1]), labels.reshape(-1).to(flat.device).long()
    )


def regression_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean squared error of the model's outputs against the batch's targets (any batch kind).

    Targets are reshaped to the outputs' shape when they have as many entries (``[B]`` for ``[B, 1]``).
    """
    b = _labelled(batch)
    out = model_logits(model, b.inputs)
    target = b.labels.to(out.device, out.dtype)
    if target.shape != out.shape and target.numel() == out.numel():
        target = target.reshape(out.shape)
    return F.mse_loss(out, target)


def cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Iterate over ``batches`` again and again (re-creating the iterator, so loaders reshuffle).

    Raises:
        ValueError: If ``batches`` is empty, or yields nothing on a later pass (a generator, not a
            re-iterable).
    """
    for _, _, b in numbered_cycle(batches):
        yield b


def numbered_cycle(batches: Iterable[Batch]) -> Iterator[tuple[int, int, Batch]]:
    """`cycle` yielding ``(pass, index within the pass, batch)``, both counted from 0."""
    passes = 0
    while True:
        empty = True
        for i, b in enumerate(batches):
            empty = False
            yield passes, i, b
        if empty:
            if passes == 0:
                raise ValueError("batches is empty")
            raise ValueError(
                "batches yielded nothing on its second pass: pass a re-iterable (a list or a DataLoader), "
                "not a generator or iterator"
            )
        passes += 1


@contextmanager
def _training_state(model: nn.Module, trainable: set[str]) -> Iterator[None]:
    """Train mode, gradients only for ``trainable`` parameters; modes and flags restored on exit."""
    modes = {m: m.training for m in model.modules()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        model.train()
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return None
    return tqdm(total=total, desc=desc, leave=False)


def collect_swag(
    model: nn.Module,
    subset: Any,
    batches: Iterable[Batch],
    *,
    lr: float,
    n_steps: int = 2000,
    snapshot_every: int = 5,
    max_rank: int = 20,
    diagonal_only: bool = False,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    loss_fn: LossFn | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    likelihood: str = "classification",
    sigma_noise: float = 1.0,
) -> SWAG:
    """Run SWAG from the MAP: SGD with momentum on the stochastic entries only, snapshotting as it goes.

    Starting from the model's current weights (the MAP), take ``n_steps`` steps of SGD with momentum at the
    constant learning rate ``lr`` (``buf ← μ·buf + g``, ``w ← w − lr·buf``, as ``torch.optim.SGD``),
    touching only the stochastic entries of ``subset``; after every ``snapshot_every``-th step the entries
    are folded into a `SWAG`. Every other weight, including the frozen entries of partially stochastic
    tensors, never changes. On return (or error) the stochastic entries are reset to the MAP, and the
    model's train/eval modes and ``requires_grad`` flags are restored.

    Args:
        model: The fine-tuned model.
        subset: ``partialbayes.selection.Subset`` of the model.
        batches: Re-iterable of batches of any kind (e.g. a ``DataLoader`` with Hugging Face's
            ``DataCollatorWithPadding``, or ``(inputs, labels)`` pairs), cycled as often as needed.
        lr: Constant learning rate (> 0).
        n_steps: Number of SGD steps (the paper: 2000).
        snapshot_every: Steps between snapshots (the paper: 5).
        max_rank: ``K``, deviation columns kept (the paper: 20).
        diagonal_only: SWAG-Diag.
        momentum: Momentum (0.9).
        weight_decay: L2 coefficient added to the gradient of the stochastic entries.
        loss_fn: ``loss_fn(model, batch) -> scalar``, given the batch in its own kind with its tensors
            on the model's device; default `classification_loss` (cross-entropy, padded and -100
            positions of token-level outputs left out), or `regression_loss` (mean squared error) for
            ``likelihood="regression"``.
        dtype: dtype of the SWAG moments.
        progress: Show a tqdm progress bar (when tqdm is installed).
        likelihood: ``"classification"`` or ``"regression"``: what `SWAG.predict` returns.
        sigma_noise: Observation noise standard deviation of the regression likelihood.

    Returns:
        The collected `SWAG` posterior.

    Raises:
        NonFiniteLossError: (a ``ValueError``) when the loss, the gradient or the weights become NaN/inf,
            or a snapshot's squares would overflow the moments' dtype; names the step.
        ValueError: On bad hyper-parameters, empty ``batches``, a subset that does not match the model,
            or a loss that fails on a batch (labels out of range, missing labels: the message names the
            step and the batch).
    """
    check_collect_options(lr, n_steps, snapshot_every, momentum, weight_decay)
    swag = SWAG(
        model,
        subset,
        max_rank=max_rank,
        diagonal_only=diagonal_only,
        dtype=dtype,
        likelihood=likelihood,
        sigma_noise=sigma_noise,
    )
    if loss_fn is None:
        loss_fn = regression_loss if likelihood == "regression" else classification_loss
    layout = swag.layout
    params = layout.parameters(model)
    device = params[layout.names[0]].device
    w_map = layout.gather(params)
    # Master copy in at least float32, so half-precision models do not lose small momentum steps.
    w = w_map.to(torch.promote_types(w_map.dtype, torch.float32), copy=True)
    buf = torch.zeros_like(w)
    bar = _progress(n_steps, progress, f"SWAG lr={lr:g}")
    try:
        with _training_state(model, set(layout.names)):
            for p in params.values():
                p.grad = None
            data = numbered_cycle(batches)
            for step in range(1, n_steps + 1):
                n_pass, index, batch = next(data)
                try:
                    loss = loss_fn(model, to_device(batch, device))
                except (ValueError, IndexError) as err:
                    raise ValueError(
                        f"loss at SGD step {step} (batch {index} of pass {n_pass}): {err}"
                    ) from err
                loss_value = float(loss.detach())  # the one host sync per step
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(step, lr, f"loss {loss_value}")
                loss.backward()
                grads = {
                    n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()
                }
                g = layout.gather(grads)
                for p in params.values():
                    p.grad = None
                if weight_decay:
                    g = g + weight_decay * w
                buf.mul_(momentum).add_(g)
                w.sub_(lr * buf)
                layout.scatter_(params, w)
                if step % snapshot_every == 0:
                    if not bool(torch.isfinite(w).all()):
                        raise NonFiniteLossError(step, lr, "weights (gradient overflow)")
                    try:
                        swag.collect(model)
                    except ValueError as err:
                        raise NonFiniteLossError(step, lr, f"second moment ({err})") from err
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.4f}", snapshots=swag.n_snapshots)
    finally:
        layout.scatter_(params, w_map)
        for p in params.values():
            p.grad = None
        if bar is not None:
            bar.close()
    return swag
