"""Validation of class labels before a cross-entropy (torch's own error names neither batch nor value)."""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""Label value cross-entropy skips (padding positions of token-level targets)."""


def check_class_labels(logits: Tensor, labels: object) -> Tensor:
    """Check integer class labels for ``logits`` ``[..., C]``: shape ``[...]``, values in ``[0, C)`` or -100.

    On CPU torch raises a bare ``IndexError`` for a label out of range, on CUDA a device-side assert that
    poisons the process; checking first gives an error that says what is wrong.

    Args:
        logits: ``[..., C]`` logits.
        labels: The labels of the batch.

    Returns:
        ``labels``.

    Raises:
        TypeError: If ``labels`` is not an integer tensor.
        ValueError: If its shape does not match the logits, or a label lies outside ``[0, C)`` and is not
            -100.
    """
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
    n_classes = logits.shape[-1]
    if labels.numel() != logits[..., 0].numel():
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but the logits {tuple(logits.shape)} need "
            f"{tuple(logits.shape[:-1])}"
        )
    kept = labels[labels != IGNORE_INDEX]
    if kept.numel():
        lo, hi = int(kept.min()), int(kept.max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(
                f"labels must lie in [0, {n_classes}) (or be {IGNORE_INDEX} to ignore a position), "
                f"got values in [{lo}, {hi}]"
            )
    return labels
