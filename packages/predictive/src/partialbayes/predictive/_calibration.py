"""Top-label calibration: reliability data, ECE and MCE with equal-width or equal-mass bins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from partialbayes.predictive._metrics import _probs_labels
from partialbayes.predictive._validate import check_choice, check_int

Binning = Literal["equal_width", "equal_mass"]


@dataclass(frozen=True)
class ReliabilityData:
    """Per-bin data of a reliability diagram (top-label confidence).

    Attributes:
        confidence: Mean confidence per bin ``[n_bins]`` (0 for empty bins).
        accuracy: Accuracy per bin ``[n_bins]`` (0 for empty bins).
        count: Examples per bin ``[n_bins]`` (int64).
        edges: Bin edges ``[n_bins + 1]``. Equal width: ``k / n_bins``, bins ``(lo, hi]`` with the
            first bin also holding 0. Equal mass: confidence quantiles (the smallest confidence
            of each bin, then the largest confidence overall); bins are contiguous chunks of the
            sorted confidences with sizes differing by at most one.
    """

    confidence: Tensor
    accuracy: Tensor
    count: Tensor
    edges: Tensor

    @property
    def gaps(self) -> Tensor:
        """``|accuracy − confidence|`` per bin ``[n_bins]``."""
        return (self.accuracy - self.confidence).abs()

    @property
    def ece(self) -> Tensor:
        """Expected calibration error ``Σ_b (n_b / N) |acc_b − conf_b|``."""
        n = self.count.sum().clamp_min(1)
        return (self.count.to(self.gaps.dtype) * self.gaps).sum() / n

    @property
    def mce(self) -> Tensor:
        """Maximum calibration error ``max_b |acc_b − conf_b|`` over non-empty bins."""
        gaps = self.gaps[self.count > 0]
        return gaps.max() if gaps.numel() else self.gaps.new_zeros(())


def reliability(
    probs: Tensor, labels: Tensor, *, n_bins: int = 20, binning: Binning = "equal_mass"
) -> ReliabilityData:
    """Bin top-label confidences ``max_c p_c`` of ``probs`` ``[N, C]`` and compare with accuracy per bin.

    ``"equal_mass"`` (default; Kampen et al. use 20 bins) splits the stably sorted confidences into
    ``n_bins`` contiguous chunks whose sizes differ by at most one; ``"equal_width"`` uses
    ``(k/n_bins, (k+1)/n_bins]``. ``labels`` are ``[N]``. The result's ``ece`` and ``mce`` give the errors.
    """
    p, y = _probs_labels(probs, labels)
    check_int("n_bins", n_bins)
    check_choice("binning", binning, ("equal_width", "equal_mass"))
    conf, pred = p.max(-1)
    correct = (pred == y).to(p.dtype)
    n = conf.shape[0]
    if binning == "equal_width":
        edges = torch.linspace(0, 1, n_bins + 1, dtype=p.dtype, device=p.device)
        idx = torch.bucketize(conf, edges[1:-1], right=False)
    else:  # equal_mass
        order = torch.sort(conf, stable=True).indices
        # Position r in sorted order goes to bin b with array_split sizes: the first n % n_bins
        # bins have q + 1 members, the rest q.
        q, rem = divmod(n, n_bins)
        r = torch.arange(n, device=p.device)
        big = rem * (q + 1)
        bin_of_rank = torch.where(r < big, r // (q + 1), rem + (r - big) // max(q, 1)).clamp_max(
            n_bins - 1
        )
        idx = torch.empty_like(bin_of_rank)
        idx[order] = bin_of_rank
        sorted_conf = conf[order]
        sizes = torch.full((n_bins,), q, device=p.device)
        sizes[:rem] += 1
        starts = torch.cumsum(sizes, 0) - sizes
        lo = (
            torch.where(sizes > 0, sorted_conf[starts.clamp_max(max(n - 1, 0))], torch.nan)
            if n
            else torch.full((n_bins,), torch.nan, dtype=p.dtype, device=p.device)
        )
        top = sorted_conf[-1:] if n else lo.new_full((1,), torch.nan)
        edges = torch.cat([lo, top])
    count = torch.bincount(idx, minlength=n_bins)
    sum_conf = torch.zeros(n_bins, dtype=p.dtype, device=p.device).index_add_(0, idx, conf)
    sum_acc = torch.zeros(n_bins, dtype=p.dtype, device=p.device).index_add_(0, idx, correct)
    denom = count.clamp_min(1).to(p.dtype)
    return ReliabilityData(sum_conf / denom, sum_acc / denom, count, edges)


def ece(
    probs: Tensor, labels: Tensor, *, n_bins: int = 20, binning: Binning = "equal_mass"
) -> Tensor:
    """Expected calibration error ``Σ_b (n_b / N) |acc_b − conf_b|`` of the top-label confidence, in ``[0, 1]``.

    Arguments as [`reliability`][partialbayes.predictive.reliability].
    """
    return reliability(probs, labels, n_bins=n_bins, binning=binning).ece


def mce(
    probs: Tensor, labels: Tensor, *, n_bins: int = 20, binning: Binning = "equal_mass"
) -> Tensor:
    """Maximum calibration error ``max_b |acc_b − conf_b|`` over non-empty bins, in ``[0, 1]``.

    Arguments as [`reliability`][partialbayes.predictive.reliability].
    """
    return reliability(probs, labels, n_bins=n_bins, binning=binning).mce
