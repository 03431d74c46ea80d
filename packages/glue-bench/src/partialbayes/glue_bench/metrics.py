"""Per-cell metrics of a classifier's predictive probabilities: accuracy, NLL, ECE, Brier.

Thin float-valued wrappers over `partialbayes.predictive` (which validates the inputs), so that every
results record is plain JSON.
"""

from __future__ import annotations

import torch

from partialbayes import predictive


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label. probs (N, C), labels (N,)."""
    return float(predictive.accuracy(probs, labels))


def nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log predictive probability of the label."""
    return float(predictive.nll(probs.double(), labels))


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over examples of the squared distance between probs and the one-hot label."""
    return float(predictive.brier(probs.double(), labels))


def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20) -> float:
    """Expected calibration error with ``n_bins`` equal-mass bins of the top-class confidence (the paper's)."""
    return float(predictive.ece(probs.double(), labels, n_bins=n_bins, binning="equal_mass"))


def all_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """``accuracy``, ``nll``, ``ece`` (20 equal-mass bins) and ``brier`` of one prediction."""
    return {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": ece(probs, labels),
        "brier": brier(probs, labels),
    }
