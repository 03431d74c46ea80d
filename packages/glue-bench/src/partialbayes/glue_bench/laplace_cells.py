"""One Laplace cell: the posterior, its prior precision, its test predictive, its record.

A cell fitted on its own (``curvature_pass="per-cell"``, :func:`laplace_prediction`) and the cells of a
shared ramp (:mod:`partialbayes.glue_bench.ramp`, through the curvature library's several-posterior calls)
build their posteriors with the same options (:func:`kron_options`), choose the prior with the same rule
(:func:`choose_prior`) from the same validation NLLs, and report the same fields (:func:`laplace_result`):
equal factors give equal records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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


def kron_options(ctx: Context) -> dict[str, Any]:
    """The ``KronLaplace`` settings of a KFAC-type cell (``settings.fisher``; the library's defaults else)."""
    return {"num_classes": ctx.num_labels, "fisher": ctx.settings.fisher}


def choose_prior(
    la: LaplaceBase, nll: torch.Tensor, grid: Sequence[float], method: str
) -> dict[str, Any]:
    """Set the prior precision of ``la`` by ``method`` and describe the choice.

    Args:
        la: The fitted posterior.
        nll: ``[len(grid)]`` its mean validation NLL per prior (``grid_val_nll``).
        grid: The prior precisions (``Settings.prior_grid``).
        method: ``val_nll`` (lowest validation NLL on the grid, ties to the smaller prior) or
            ``marglik`` (largest marginal likelihood on the grid, the library's rule).

    Returns:
        ``{"prior_precision", "prior_method", "prior_at_grid_edge", "val_nll_grid"}`` and ``"val_nll"``
        (the validation NLL at the chosen prior).
    """
    if method == "val_nll":
        best = int(torch.argmin(nll))
        la.prior_precision = grid[best]
    else:
        best = list(grid).index(la.optimize_prior_precision("marglik", grid=prior_grid(grid)))
    return {
        "prior_precision": grid[best],
        "prior_method": method,
        "prior_at_grid_edge": prior_edge(grid[best], grid),
        "val_nll_grid": [float(v) for v in nll],
        "val_nll": float(nll[best]),
    }


def probit_probs(mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """The linearised probit predictive ``[N, C]`` of one batch's ``logit_mean_cov`` (float64, on the CPU)."""
    return probit(mean.double(), cov.double()).cpu()


def laplace_result(
    ctx: Context,
    la: LaplaceBase,
    probs: torch.Tensor,
    prior: dict[str, Any],
    fit_seconds: float,
    predict_seconds: float,
    curvature_pass: str,
) -> Prediction:
    """The :class:`Prediction` of a finished Laplace cell (the same fields whichever path fitted it)."""
    extra = {k: v for k, v in prior.items() if k != "val_nll"}
    extra.update({"fisher": la.fisher, "modules": modules_of(la.subset)})
    return Prediction(
        probs=probs,
        floats=int(la.num_floats),
        n_stochastic=la.subset.num_entries(),
        percent_stochastic=float(la.subset.percent_of(ctx.model)),
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
    likelihood (``settings.prior``), then the linearised probit predictive on the test set. ``kron`` uses
    :func:`kron_options`; ``dense`` (the last layer) ``settings.last_layer_fisher``.

    Raises:
        ValueError: If ``kind`` is neither ``kron`` nor ``dense``.
    """
    s = ctx.settings
    t0 = time.perf_counter()
    if kind == "kron":
        la: LaplaceBase = KronLaplace(ctx.model, subset, **kron_options(ctx))
    elif kind == "dense":
        fisher = s.last_layer_fisher
        la = DenseLaplace(ctx.model, subset, num_classes=ctx.num_labels, fisher=fisher)
    else:
        raise ValueError(f"kind must be 'kron' or 'dense', got {kind!r}")
    la.fit(ctx.train, generator=mc_generator(ctx, la.fisher))
    prior = choose_prior(
        la, la.grid_val_nll(ctx.val, prior_grid(s.prior_grid)), s.prior_grid, s.prior
    )
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    probs = torch.cat([probit_probs(*la.logit_mean_cov(batch)) for batch in ctx.test])
    return laplace_result(ctx, la, probs, prior, fit, time.perf_counter() - t0, "per-cell")
