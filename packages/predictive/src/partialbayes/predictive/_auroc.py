"""Area under the ROC curve via the Mann–Whitney rank statistic, with ties."""

from __future__ import annotations

import torch
from torch import Tensor

from partialbayes.predictive._validate import (
    check_labels,
    check_same_device,
    check_tensor,
    check_type,
)


def auroc(scores: Tensor, positives: Tensor) -> Tensor:
    """AUROC: the probability that a random positive scores above a random negative (ties count one half).

    ``AUROC = (Σ_{i∈P} r_i − n_P (n_P + 1)/2) / (n_P n_N)`` with mid-ranks ``r_i``, in ``O(N log N)``; e.g.
    misclassification detection (score = entropy, positive = error). ``scores`` ``[N]`` (higher: more
    positive), ``positives`` bool or 0/1 ``[N]``; returns a scalar in the dtype of ``scores``.

    Raises:
        ValueError: On NaN/inf scores, mismatched shapes, labels other than 0/1, or only one class present.
    """
    s = check_tensor("scores", scores)
    check_type("positives", positives, Tensor, "a torch.Tensor")
    check_same_device(scores=s, positives=positives)
    if s.ndim != 1:
        raise ValueError(f"scores must have shape [N], got {tuple(s.shape)}")
    pos = positives.long() if positives.dtype == torch.bool else positives  # bool or integer 0 / 1
    positives = check_labels("positives", pos, s.shape[0], 2).bool()
    n_pos = int(positives.sum())
    n_neg = s.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"auroc needs both classes in positives, got {n_pos} positive and {n_neg} negative"
        )
    rank_dtype = torch.float64 if s.dtype == torch.float64 else torch.float32
    sorted_s, order = torch.sort(s)
    _, counts = torch.unique_consecutive(sorted_s, return_counts=True)
    ends = torch.cumsum(counts, 0)  # 1-based rank of the last member of each tie group
    mid = (ends - (counts - 1) / 2.0).to(rank_dtype)  # mean of ranks ends-counts+1 .. ends
    ranks_sorted = torch.repeat_interleave(mid, counts)
    pos_sorted = positives[order]
    rank_sum = ranks_sorted[pos_sorted].to(torch.float64).sum()
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return (u / (n_pos * n_neg)).to(s.dtype)
