"""Proper scoring rules and accuracy on batched tensors."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from partialbayes.predictive._validate import (
    check_broadcasts,
    check_choice,
    check_labels,
    check_nonneg,
    check_probs,
    check_same_device,
    check_tensor,
)

Reduction = Literal["mean", "sum", "none"]


def _reduce(x: Tensor, reduction: Reduction) -> Tensor:
    check_choice("reduction", reduction, ("mean", "sum", "none"))
    return x if reduction == "none" else getattr(x, reduction)()


def _probs_labels(probs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    p = check_probs("probs", probs)
    if p.ndim != 2 or p.shape[0] == 0:
        raise ValueError(f"probs must have shape [N, C] with N >= 1, got {tuple(p.shape)}")
    y = check_labels("labels", labels, p.shape[0], p.shape[1])
    check_same_device(probs=p, labels=y)
    return p, y


def accuracy(probs: Tensor, labels: Tensor) -> Tensor:
    """Fraction (in ``[0, 1]``) of examples whose most probable class of ``probs`` ``[N, C]`` equals ``labels`` ``[N]``."""
    p, y = _probs_labels(probs, labels)
    return (p.argmax(-1) == y).to(p.dtype).mean()


def nll(probs: Tensor, labels: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    """Negative log-likelihood ``−log p[y]`` in nats of ``probs`` ``[N, C]`` at ``labels`` ``[N]``.

    A probability of exactly 0 is clamped to the dtype's smallest normal number, so the result stays finite
    (about 708 nats in float64, 87 in float32). ``reduction``: ``"mean"``, ``"sum"`` or ``"none"`` (``[N]``).
    """
    p, y = _probs_labels(probs, labels)
    py = p.gather(1, y[:, None]).squeeze(1)
    return _reduce(-py.clamp_min(torch.finfo(p.dtype).tiny).log(), reduction)


def gaussian_nll(
    mean: Tensor, var: Tensor | float, targets: Tensor, *, reduction: Reduction = "mean"
) -> Tensor:
    """Gaussian negative log-likelihood ``½ log(2π v) + (y − m)² / (2 v)`` in nats.

    ``var`` (``> 0``) broadcasts to ``mean``, ``targets`` has its shape; ``reduction``: ``"mean"``, ``"sum"``
    or ``"none"``.
    """
    m = check_tensor("mean", mean)
    t = check_tensor("targets", targets)
    if not isinstance(var, Tensor):
        var = torch.as_tensor(float(var), dtype=m.dtype, device=m.device)
    v = check_nonneg("var", var)
    check_same_device(mean=m, var=v, targets=t)
    if t.shape != m.shape:
        raise ValueError(f"targets shape {tuple(t.shape)} != mean shape {tuple(m.shape)}")
    if bool((v == 0).any()):
        raise ValueError("var must be strictly positive for a Gaussian NLL")
    check_broadcasts("var", v, "mean", m)
    out = 0.5 * (math.log(2 * math.pi) + v.log() + (t - m).square() / v)
    return _reduce(out, reduction)


def brier(probs: Tensor, labels: Tensor, *, reduction: Reduction = "mean") -> Tensor:
    """Multiclass Brier score ``Σ_c (p_c − 1[y = c])²`` in ``[0, 2]`` of ``probs`` ``[N, C]`` and ``labels`` ``[N]``.

    ``reduction``: ``"mean"``, ``"sum"`` or ``"none"``.
    """
    p, y = _probs_labels(probs, labels)
    py = p.gather(1, y[:, None]).squeeze(1)
    # Σ_c p_c² − 2 p_y + 1, without materialising the one-hot matrix.
    out = p.square().sum(1) - 2 * py + 1
    return _reduce(out, reduction)
