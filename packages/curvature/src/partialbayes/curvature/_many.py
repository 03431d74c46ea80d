"""Several posteriors of one model sharing the network's passes: their predictives and prior grids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._laplace import LaplaceBase, linearised
from partialbayes.curvature._likelihood import check_list
from partialbayes.curvature._prior import grid_val_nlls


def _check_posteriors(posteriors: Any) -> list[LaplaceBase]:
    """A non-empty list of fitted posteriors of one model that read batches alike, or an error."""
    posteriors = check_list(posteriors, "posteriors", LaplaceBase)
    first = posteriors[0]
    reads = (first.model, first.likelihood, first.shift_labels)
    for i, p in enumerate(posteriors):
        p._require_fit()
        if p.model is not reads[0] or (p.likelihood, p.shift_labels) != reads[1:]:
            raise ValueError(
                f"posteriors[{i}] differs from posteriors[0] in its model, likelihood or shift_labels: "
                "the shared passes read one batch into one model"
            )
    return posteriors


def logit_mean_cov_many(
    posteriors: Sequence[LaplaceBase],
    batch: Any,
    chunk_size: int | None = None,
    *,
    target_ids: Sequence[int] | Tensor | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """`LaplaceBase.logit_mean_cov` of several posteriors of one model, sharing the network's passes.

    Kronecker posteriors (e.g. from `KronLaplace.fit_many`) share one forward pass and one backward pass per
    logit and kept position, each result equal to its own ``logit_mean_cov`` bit for bit; other structures
    run their own passes. Memory: the backward passes of the union of the blocks (each posterior alone when
    that does not fit the free memory); each posterior's predictive is checked against its ``max_memory``.

    Args:
        posteriors: Fitted posteriors of one model (same likelihood and ``shift_labels``).
        batch: Any batch ``logit_mean_cov`` takes.
        chunk_size: At most this many examples at a time (``None``: the whole batch).
        target_ids: Answer-only: the ``K`` logits of these tokens (as ``logit_mean_cov``).

    Returns:
        One ``(f [N, K], Σ_f [N, K, K])`` per posterior, in order (``K = C`` without ``target_ids``).

    Raises:
        TypeError: Not a list of Laplace posteriors, and as ``logit_mean_cov``.
        ValueError: An empty list, posteriors of different models or settings, and as ``logit_mean_cov``.
        RuntimeError: An unfitted posterior.
    """
    posteriors = _check_posteriors(posteriors)
    _, _, f, covs = linearised(posteriors, batch, chunk_size, target_ids=target_ids)
    return [(f, cov.to(f.dtype)) for cov in covs]


def grid_val_nll_many(
    posteriors: Sequence[LaplaceBase], val_loader: Iterable[Any], grid: Tensor
) -> Tensor:
    """`LaplaceBase.grid_val_nll` of several posteriors of one model, reading ``val_loader`` once.

    The passes are shared as in `logit_mean_cov_many`: row ``i`` equals ``posteriors[i].grid_val_nll``
    bit for bit, and ``grid[nll.argmin(1)]`` is each posterior's prior by validation NLL.

    Returns:
        ``[len(posteriors), len(grid)]`` mean NLL per example.

    Raises:
        TypeError, ValueError, RuntimeError: As `logit_mean_cov_many` and ``grid_val_nll``.
    """
    return torch.stack(grid_val_nlls(_check_posteriors(posteriors), val_loader, grid))
