"""Per-cell metrics of a classifier's predictive probabilities: accuracy, NLL, ECE, Brier."""

from __future__ import annotations

import torch


def _check(probs: torch.Tensor, labels: torch.Tensor) -> None:
    if probs.ndim != 2 or labels.ndim != 1 or probs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"probs must be (N, C) and labels (N,), got {tuple(probs.shape)} and {tuple(labels.shape)}"
        )
    if probs.shape[0] == 0:
        raise ValueError("probs is empty")
    if not torch.isfinite(probs).all():
        raise ValueError("probs contains NaN or inf")
    if labels.min() < 0 or labels.max() >= probs.shape[1]:
        raise ValueError(
            f"labels must lie in [0, {probs.shape[1]}), got {labels.min()}..{labels.max()}"
        )


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label. probs (N, C), labels (N,)."""
    _check(probs, labels)
    return float((probs.argmax(-1) == labels).double().mean())


def nll(probs: torch.Tensor, labels: torch.Tensor, eps: float = 1e-12) -> float:
    """Mean negative log predictive probability of the label (probabilities clamped at ``eps``)."""
    _check(probs, labels)
    p = probs.double().gather(1, labels[:, None]).squeeze(1)
    return float(-p.clamp_min(eps).log().mean())


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over examples of the squared distance between probs and the one-hot label."""
    _check(probs, labels)
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).double()
    return float(((probs.double() - onehot) ** 2).sum(-1).mean())


def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20) -> float:
    """Expected calibration error with ``n_bins`` equal-mass bins of the top-class confidence.

    Examples are sorted by confidence (ties by index) and cut into ``n_bins`` groups whose sizes differ
    by at most one; ECE = Σ_b |B_b|/N · |acc(B_b) − conf(B_b)|.
    """
    _check(probs, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf, pred = probs.double().max(-1)
    correct = (pred == labels).double()
    order = torch.sort(conf, stable=True).indices
    total = 0.0
    n = conf.shape[0]
    for chunk in torch.tensor_split(order, min(n_bins, n)):
        total += len(chunk) / n * abs(float(correct[chunk].mean() - conf[chunk].mean()))
    return total


def all_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """``accuracy``, ``nll``, ``ece`` (20 equal-mass bins) and ``brier`` of one prediction."""
    return {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": ece(probs, labels),
        "brier": brier(probs, labels),
    }
