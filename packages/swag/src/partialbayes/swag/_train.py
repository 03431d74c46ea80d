"""SWAG collection: SGD with momentum on the stochastic entries only, a snapshot every few steps."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialbayes.predictive.internal import (
    IGNORE_INDEX,
    check_int,
    check_labels,
    check_number,
    flatten_outputs,
    gradients_only,
    model_logits,
    move_batch,
    split_batch,
)
from partialbayes.selection import Subset
from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._posterior import SWAG

Batch = Any
"""A batch of any kind ``partialbayes.predictive.internal.split_batch`` reads: a tensor, an ``(inputs, labels)`` pair,
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


# ---------------------------------------------------------------------------------------- checks
def check_snapshots(name: str, n_steps: int, every: int, diagonal_only: bool) -> None:
    """Refuse ``n_steps`` (named ``name``) giving fewer snapshots, one per ``every`` steps, than sampling needs."""
    needed = 1 if diagonal_only else 2
    if n_steps // every < needed:
        raise ValueError(
            f"{name}={n_steps} with snapshot_every={every} gives {n_steps // every} snapshot(s); "
            f"SWAG{'-Diag' if diagonal_only else ''} needs at least {needed} to sample (raise {name}"
            f"{'' if diagonal_only else ' or use diagonal_only=True'})"
        )


def check_class_labels(logits: Tensor, labels: Tensor) -> Tensor:
    """Check integer class labels for ``logits`` ``[..., C]``: shape ``[...]``, values in ``[0, C)`` or -100.

    Checked first, as torch raises a bare ``IndexError`` on CPU and a process-poisoning assert on CUDA.
    """
    if labels.numel() != logits[..., 0].numel():
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but the logits {tuple(logits.shape)} need "
            f"{tuple(logits.shape[:-1])}"
        )
    kept = labels[labels != IGNORE_INDEX]  # integer class indices, each in [0, C)
    check_labels(f"labels (other than {IGNORE_INDEX})", kept, kept.numel(), logits.shape[-1])
    return labels


def has_labelled_outputs(labels: Tensor | None) -> bool:
    """False when every class label of a batch is -100; a batch without labels or with float targets counts."""
    if labels is None or labels.is_floating_point() or labels.numel() == 0:
        return True
    return bool((labels != IGNORE_INDEX).any())


def skipped_warning(what: str, skipped: int, total: int) -> None:
    """Warn once about the batches a call skipped; refuse when it skipped every batch (or saw none)."""
    if skipped == total:
        raise ValueError(
            f"{what}: every batch ({total}) has no labelled outputs (all labels -100): nothing to use"
            if total
            else f"{what}: the batches are empty"
        )
    if skipped:
        warnings.warn(
            f"{what} skipped {skipped} of {total} batches with no labelled outputs (all labels -100)",
            RuntimeWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------- losses
def _labelled(batch: Batch, device: torch.device | None = None) -> Any:
    b = split_batch(batch, device=device)
    if b.labels is None:
        keys = f" (keys: {sorted(map(str, batch))})" if isinstance(batch, Mapping) else ""
        raise ValueError(f"batch has no labels under 'labels' or 'label'{keys}")
    return b


def classification_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean cross-entropy of the model's logits against the batch's labels, over the kept outputs.

    Any batch kind (tensor pairs, dicts, ``BatchEncoding``; labels under ``labels`` or ``label``).
    Sequence-level logits ``[B, C]`` take labels ``[B]``; token-level logits ``[B, T, C]`` take labels
    ``[B, T]``. Outputs labelled -100 (and token positions whose attention mask is 0) are left out.
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
    """Mean squared error of the model's outputs against the batch's targets (reshaped if they fit)."""
    b = _labelled(batch)
    out = model_logits(model, b.inputs)
    target = b.labels.to(out.device, out.dtype)
    if target.shape != out.shape and target.numel() == out.numel():
        target = target.reshape(out.shape)
    return F.mse_loss(out, target)


# ---------------------------------------------------------------------------------------- the loop
def numbered_cycle(batches: Iterable[Batch]) -> Iterator[tuple[int, int, Batch]]:
    """``(pass, index within the pass, batch)`` over ``batches`` again and again (re-iterated: loaders reshuffle)."""
    for passes in itertools.count():
        i = -1
        for i, b in enumerate(batches):
            yield passes, i, b
        if i < 0:
            raise ValueError(
                "batches is empty"
                if passes == 0
                else "batches yielded nothing on its second pass: pass a re-iterable (a list or a "
                "DataLoader), not a generator or iterator"
            )


@contextmanager
def _training_state(model: nn.Module, trainable: set[str]) -> Iterator[None]:
    """Train mode, gradients only for ``trainable`` parameters; modes and flags restored on exit."""
    modes = {m: m.training for m in model.modules()}
    try:
        with gradients_only(model.train(), trainable):
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is optional
        return None
    return tqdm(total=total, desc=desc, leave=False)


def _batch_loss(
    loss_fn: LossFn, model: nn.Module, batch: Batch, device: torch.device, *where: int
) -> Tensor | None:
    """``loss_fn`` on ``batch`` moved to ``device``; ``None`` for a batch without labelled outputs."""
    try:
        if not has_labelled_outputs(split_batch(batch).labels):
            return None
        return loss_fn(model, move_batch(batch, device))
    except (ValueError, IndexError) as err:
        step, index, n_pass = where
        raise ValueError(
            f"loss at SGD step {step + 1} (batch {index} of pass {n_pass}): {err}"
        ) from err


def _take_grads(layout: FlatLayout, params: Mapping[str, nn.Parameter]) -> Tensor:
    """The stochastic entries of the gradients (0 where none), which are cleared."""
    g = layout.gather(
        {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}
    )
    for p in params.values():
        p.grad = None
    return g


def collect_swag(
    model: nn.Module,
    subset: Subset,
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

    From the model's current weights, ``n_steps`` steps of SGD with momentum at the constant ``lr``
    (``buf ← μ·buf + g``, ``w ← w − lr·buf``, as ``torch.optim.SGD``) move only the subset's entries; after
    every ``snapshot_every``-th step they are folded into a `SWAG`. On return (or error) the entries are
    reset to the MAP and the modules' modes and ``requires_grad`` flags restored. Batches whose labels are all
    -100 are skipped without a step (one warning counts them; all unlabelled is an error).

    Args:
        model: The fine-tuned model.
        subset: ``partialbayes.selection.Subset`` of the model.
        batches: Re-iterable of batches of any kind (e.g. a ``DataLoader`` with Hugging Face's
            ``DataCollatorWithPadding``, or ``(inputs, labels)`` pairs), cycled as often as needed.
        lr: Constant learning rate (> 0).
        n_steps: Number of SGD steps (the paper: 2000); at least ``2·snapshot_every`` (``snapshot_every``
            for SWAG-Diag), so that the posterior can sample.
        snapshot_every: Steps between snapshots (the paper: 5).
        max_rank: ``K``, deviation columns kept (the paper: 20).
        diagonal_only: SWAG-Diag.
        momentum: Momentum (0.9).
        weight_decay: L2 coefficient added to the gradient of the stochastic entries.
        loss_fn: ``loss_fn(model, batch) -> scalar``, given the batch in its own kind with its tensors
            on the model's device; default: cross-entropy over the labelled outputs, or the mean squared
            error for ``likelihood="regression"``.
        dtype: dtype of the SWAG moments.
        progress: Show a tqdm progress bar (when tqdm is installed).
        likelihood: ``"classification"`` or ``"regression"``: what `SWAG.predict` returns.
        sigma_noise: Observation noise standard deviation of the regression likelihood.

    Returns:
        The collected `SWAG` posterior.

    Raises:
        NonFiniteLossError: (a ``ValueError``) when the loss, the gradient or the weights become NaN/inf,
            or a snapshot's squares would overflow the moments' dtype; names the step.
        ValueError: On bad hyper-parameters (too few snapshots to sample included), empty ``batches``, a
            subset that does not match the model (or on the ``meta`` device), every batch unlabelled, or
            a batch that fails (empty, labels out of range, missing labels: the message names the step
            and the batch).
    """
    check_number("lr", lr)
    check_snapshots(
        "n_steps",
        check_int("n_steps", n_steps),
        check_int("snapshot_every", snapshot_every),
        diagonal_only,
    )
    check_number("momentum", momentum, "[0, 1)")
    check_number("weight_decay", weight_decay, "[0, inf)")
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
    params = subset.parameters_of(model)
    device = swag.device
    w_map = layout.gather(params)
    # Master copy in at least float32, so half-precision models do not lose small momentum steps.
    w = w_map.to(torch.promote_types(w_map.dtype, torch.float32), copy=True)
    buf = torch.zeros_like(w)
    bar = _progress(n_steps, progress, f"SWAG lr={lr:g}")
    step = drawn = skipped = 0
    try:
        with _training_state(model, set(layout.names)):
            for p in params.values():
                p.grad = None
            data = numbered_cycle(batches)
            while step < n_steps:
                n_pass, index, batch = next(data)
                if n_pass and not step:  # a whole pass without a labelled batch
                    break
                drawn += 1
                loss = _batch_loss(loss_fn, model, batch, device, step, index, n_pass)
                if loss is None:
                    skipped += 1
                    continue
                step += 1
                loss_value = float(loss.detach())  # the one host sync per step
                if not math.isfinite(loss_value):
                    raise NonFiniteLossError(step, lr, f"loss {loss_value}")
                loss.backward()
                g = _take_grads(layout, params)
                if weight_decay:
                    g = g + weight_decay * w
                buf.mul_(momentum).add_(g)
                w.sub_(lr * buf)
                layout.scatter_(params, w)
                if step % snapshot_every == 0:
                    try:  # collect refuses NaN / inf weights (a gradient overflow) and squares that overflow
                        swag.collect(model)
                    except ValueError as err:
                        raise NonFiniteLossError(step, lr, f"snapshot ({err})") from err
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_value:.4f}", snapshots=swag.n_snapshots)
    finally:
        layout.scatter_(params, w_map)
        for p in params.values():
            p.grad = None
        if bar is not None:
            bar.close()
    skipped_warning("collect_swag", skipped, drawn)
    swag.warn_if_negligible("collect_swag")
    return swag
