"""Per-cell metrics of a classifier's predictive probabilities: accuracy, NLL, ECE, Brier.

Thin float-valued wrappers over `partialbayes.predictive` (which validates the inputs), so that every
results record is plain JSON.
"""

from __future__ import annotations

from typing import Any

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


def reliability_bins(
    probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 20
) -> dict[str, list[float] | list[int]]:
    """Reliability-diagram data: ``n_bins`` equal-mass bins of the top-class confidence.

    Args:
        probs: (N, C) predictive probabilities.
        labels: (N,) integer labels.
        n_bins: Number of bins (the paper's 20).

    Returns:
        ``{"confidence": [n_bins], "accuracy": [n_bins], "count": [n_bins]}``: mean confidence, accuracy and
        number of examples per bin, bins ordered by confidence (``partialbayes.predictive.reliability``;
        empty bins, when N < n_bins, have count 0 and zeros elsewhere).
    """
    rel = predictive.reliability(probs.double(), labels, n_bins=n_bins, binning="equal_mass")
    return {
        "confidence": [float(v) for v in rel.confidence],
        "accuracy": [float(v) for v in rel.accuracy],
        "count": [int(v) for v in rel.count],
    }


def all_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """The metrics of one prediction, as stored in a results record.

    Returns:
        ``accuracy``, ``nll``, ``ece`` (20 equal-mass bins) and ``brier`` as floats, and ``reliability``:
        the 20 equal-mass bins of :func:`reliability_bins` (for calibration curves).
    """
    return {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": ece(probs, labels),
        "brier": brier(probs, labels),
        "reliability": reliability_bins(probs, labels),
    }
