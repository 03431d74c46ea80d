"""One Laplace cell in steps: the posterior, its prior precision, its test predictive.

A grid cell of a Laplace method is split into small steps so that the two ways of running a ramp share
every line of code after the curvature: a cell fitted on its own (``curvature_pass="per-cell"``:
:func:`fit_per_cell` streams the training set for its subset) and a cell derived from the shared pass
(:mod:`partialbayes.glue_bench.ramp`: ``KronLaplace.fit_curvature`` with factors from one pass for the whole
ramp) both choose their prior with :class:`PriorSearch` and predict with :class:`TestPredictive`, batch by
batch, in the same order, so that equal factors give equal records.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from partialbayes.curvature import DenseLaplace, KronLaplace, LaplaceBase
from partialbayes.glue_bench.context import (
    MC_FISHER_OFFSET,
    Context,
    Prediction,
    modules_of,
    prior_edge,
    prior_grid,
)
from partialbayes.predictive import probit
from partialbayes.selection import Subset


def mc_generator(ctx: Context, fisher: str) -> torch.Generator | None:
    """The generator of the sampled labels for ``fisher="mc"`` (seeded by the run), else ``None``."""
    return ctx.generator(MC_FISHER_OFFSET) if fisher == "mc" else None


def kron_posterior(ctx: Context, subset: Subset) -> KronLaplace:
    """An unfitted ``KronLaplace`` on ``subset`` of ``ctx.model`` with fisher ``settings.fisher``."""
    return KronLaplace(ctx.model, subset, num_classes=ctx.num_labels, fisher=ctx.settings.fisher)


def dense_posterior(ctx: Context, subset: Subset) -> DenseLaplace:
    """An unfitted ``DenseLaplace`` on ``subset`` with fisher ``settings.last_layer_fisher``."""
    return DenseLaplace(
        ctx.model, subset, num_classes=ctx.num_labels, fisher=ctx.settings.last_layer_fisher
    )


def fit_per_cell(ctx: Context, la: LaplaceBase) -> LaplaceBase:
    """Fit ``la`` by its own pass over the training batches (the MC fisher seeded by the run)."""
    la.fit(ctx.train, generator=mc_generator(ctx, la.fisher))
    return la


class PriorSearch:
    """The validation NLL of every prior of the grid, accumulated batch by batch.

    Each batch's mean NLL per grid value (``grid_val_nll`` of the posterior on that one batch) is weighted
    by the batch size and summed; :meth:`choose` then sets the prior of the posterior. Used identically by
    both curvature paths, so the chosen prior and the validation NLL do not depend on the path.

    Args:
        grid: The prior precisions (``Settings.prior_grid``).
    """

    def __init__(self, grid: Sequence[float]) -> None:
        self.grid = tuple(float(v) for v in grid)
        self._grid = prior_grid(self.grid)
        self.totals = torch.zeros(len(self.grid), dtype=torch.float64)
        self.count = 0

    def add(self, la: LaplaceBase, batch: Mapping[str, torch.Tensor]) -> None:
        """Add one validation batch (with ``labels``) of the posterior ``la``."""
        n = int(batch["labels"].shape[0])
        self.totals += la.grid_val_nll([batch], self._grid) * n
        self.count += n

    def nll(self) -> torch.Tensor:
        """``[len(grid)]`` mean validation NLL per prior."""
        if self.count == 0:
            raise ValueError("PriorSearch: no validation batch was added")
        return self.totals / self.count

    def choose(self, la: LaplaceBase, method: str) -> dict[str, Any]:
        """Set the prior precision of ``la`` by ``method`` and describe the choice.

        Args:
            la: The fitted posterior.
            method: ``val_nll`` (lowest validation NLL on the grid, ties to the smaller prior) or
                ``marglik`` (largest marginal likelihood on the grid, the library's rule).

        Returns:
            ``{"prior_precision", "prior_method", "prior_at_grid_edge", "val_nll_grid"}`` and
            ``"val_nll"`` (the validation NLL at the chosen prior).
        """
        nll = self.nll()
        if method == "val_nll":
            best = int(torch.argmin(nll))
            chosen = self.grid[best]
            la.prior_precision = chosen
        else:
            chosen = la.optimize_prior_precision("marglik", grid=self._grid)
            best = self.grid.index(chosen)
        return {
            "prior_precision": chosen,
            "prior_method": method,
            "prior_at_grid_edge": prior_edge(chosen, self.grid),
            "val_nll_grid": [float(v) for v in nll],
            "val_nll": float(nll[best]),
        }


class TestPredictive:
    """The linearised probit predictive of one posterior, batch by batch (float64, on the CPU)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, la: LaplaceBase, batch: Mapping[str, torch.Tensor]) -> None:
        """Add one test batch of the posterior ``la`` (at its current prior precision)."""
        mean, cov = la.logit_mean_cov(batch)
        self.parts.append(probit(mean.double(), cov.double()).cpu())

    def probs(self) -> torch.Tensor:
        """``[N, C]`` predictive probabilities of every batch added, in order."""
        return torch.cat(self.parts)


def laplace_result(
    ctx: Context,
    la: LaplaceBase,
    subset: Subset,
    probs: torch.Tensor,
    prior: dict[str, Any],
    fit_seconds: float,
    predict_seconds: float,
    curvature_pass: str,
) -> Prediction:
    """The :class:`Prediction` of a finished Laplace cell (the same fields whichever path fitted it)."""
    extra = {k: v for k, v in prior.items() if k != "val_nll"}
    extra.update({"fisher": la.fisher, "modules": modules_of(subset)})
    return Prediction(
        probs=probs,
        floats=int(la.num_floats),
        n_stochastic=subset.num_entries(),
        percent_stochastic=float(subset.percent_of(ctx.model)),
        fit_seconds=fit_seconds,
        predict_seconds=predict_seconds,
        extra=extra,
        val_nll=prior["val_nll"],
        curvature_pass=curvature_pass,
    )


def laplace_prediction(ctx: Context, subset: Subset, kind: str = "kron") -> Prediction:
    """Fit a Laplace posterior of ``kind`` (``kron`` or ``dense``) on ``subset``, tune the prior, predict.

    The cell's own curvature pass over the training set (``curvature_pass="per-cell"``), the validation NLL
    of every prior of ``settings.prior_grid``, the prior chosen by validation NLL or by the marginal
    likelihood (``settings.prior``), then the linearised probit predictive on the test set.

    Raises:
        ValueError: If ``kind`` is neither ``kron`` nor ``dense``.
    """
    if kind not in ("kron", "dense"):
        raise ValueError(f"kind must be 'kron' or 'dense', got {kind!r}")
    t0 = time.perf_counter()
    unfitted = kron_posterior(ctx, subset) if kind == "kron" else dense_posterior(ctx, subset)
    la = fit_per_cell(ctx, unfitted)
    search = PriorSearch(ctx.settings.prior_grid)
    for batch in ctx.val:
        search.add(la, batch)
    prior = search.choose(la, ctx.settings.prior)
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    test = TestPredictive()
    for batch in ctx.test:
        test.add(la, batch)
    return laplace_result(
        ctx, la, subset, test.probs(), prior, fit, time.perf_counter() - t0, "per-cell"
    )
