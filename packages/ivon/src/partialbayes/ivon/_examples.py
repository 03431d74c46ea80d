"""A loader read example by example (``vmap`` over an HF model fails on its attention masks)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from partialbayes.predictive.internal import IGNORE_INDEX, prefixed, split_batch, take_inputs

#: ``(position in the loader, inputs of one example, label)``.
Example = tuple[int, Tensor | dict[str, Any], int]


def labelled_batches(loader: Iterable[Any], model: nn.Module, who: str) -> Iterator[list[Example]]:
    """``(position in the loader, inputs as a batch of one on the model's device, label)`` of each labelled example."""
    device = next(model.parameters()).device
    seen = skipped = position = 0
    for i, raw in enumerate(loader):
        seen += 1
        with prefixed(f"{who}: batch {i}"):
            batch = split_batch(raw, device=device)
        labels, size = batch.labels, batch.size
        if labels is None:
            raise ValueError(
                f"{who}: batch {i} has no labels; the sensitivities compare predictions with labels: give "
                "(inputs, labels) pairs or a mapping with 'labels'"
            )
        if labels.ndim != 1 or labels.shape[0] != size or labels.is_floating_point():
            raise ValueError(
                f"{who}: batch {i}: labels must be one class index per example ([B] = [{size}] integers, "
                f"sequence-level outputs), got {labels.dtype} of shape {tuple(labels.shape)}"
            )
        kept = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        skipped += not kept
        if kept:
            yield [
                (position + j, take_inputs(batch.inputs, slice(j, j + 1), size), int(labels[j]))
                for j in kept
            ]
        position += size
    if skipped == seen:
        raise ValueError(
            f"{who}: the loader has no labelled example ({seen} batches, every label -100 or none at all)"
        )
    if skipped:
        warnings.warn(
            f"{who}: skipped {skipped} of {seen} batches with no labelled outputs", stacklevel=3
        )


def class_logits(logits: Tensor, who: str) -> Tensor:
    """The ``[C]`` logits of a batch of one, refusing outputs that are not one vector of classes."""
    if logits.ndim != 2 or logits.shape[0] != 1 or logits.shape[1] < 2:
        raise ValueError(
            f"{who}: needs sequence-level classification logits [B, C] with C >= 2, got shape "
            f"{tuple(logits.shape)} (token-level and single-output models are not supported)"
        )
    return logits[0]


@contextmanager
def requiring_grad(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Let every parameter require gradients inside the block (frozen ones too); restore the flags after."""
    flags = [(p, p.requires_grad) for p in params]
    try:
        for p, _ in flags:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
