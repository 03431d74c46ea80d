"""Laplace cells: the posterior, its prior precision, its test predictive, its record; alone or shared.

A cell on its own (``curvature_pass="per-cell"``, :func:`kron_prediction`) makes its own passes over the
training, validation and test sets; the KFAC-type cells of a (task, split) can share them
(``"shared"``, :func:`shared_predictions`: ``KronLaplace.fit_many``, ``grid_val_nll_many``,
``logit_mean_cov_many``, each bit for bit the single-posterior call). Both paths use :func:`kron_options`,
:func:`choose_prior` and :func:`laplace_result`, so the records are equal; :func:`groups_of` keeps a group's
eigenbases (a block that several cells hold once) and MAP entries below :data:`MEMORY_FLOATS`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from partialbayes.curvature import KronLaplace, LaplaceBase, grid_val_nll_many, logit_mean_cov_many
from partialbayes.curvature.internal import block_key
from partialbayes.glue_bench.context import (
    MC_FISHER_OFFSET,
    Context,
    KronCell,
    Prediction,
    modules_of,
    prior_edge,
    prior_grid,
)
from partialbayes.predictive import probit

# Floats a group of shared cells may hold at once (eigenbases and MAP entries; float64: 1.6 GB).
MEMORY_FLOATS = 200_000_000


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

    ``nll``: the mean validation NLL per prior of ``grid``; ``val_nll`` takes its lowest (ties: the smaller
    prior), ``marglik`` the largest marginal likelihood on the grid.
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
    seconds: tuple[float, float],
    curvature_pass: str,
    skfac_percent: float | None = None,
) -> Prediction:
    """The :class:`Prediction` of a finished Laplace cell; ``seconds``: its fit and predict times."""
    extra = {k: v for k, v in prior.items() if k != "val_nll"}
    extra.update({"fisher": la.fisher, "modules": modules_of(la.subset)})
    if skfac_percent is not None:
        extra["skfac_percent"] = skfac_percent
    return Prediction(
        probs=probs,
        floats=int(la.num_floats),
        n_stochastic=la.subset.num_entries(),
        percent_stochastic=float(la.subset.percent_of(ctx.model)),
        fit_seconds=seconds[0],
        predict_seconds=seconds[1],
        extra=extra,
        val_nll=prior["val_nll"],
        curvature_pass=curvature_pass,
    )


def laplace_prediction(
    ctx: Context, la: LaplaceBase, skfac_percent: float | None = None
) -> Prediction:
    """Fit the posterior ``la`` on its own, tune its prior, predict (``curvature_pass="per-cell"``)."""
    s, t0 = ctx.settings, time.perf_counter()
    la.fit(ctx.train, generator=mc_generator(ctx, la.fisher), progress=ctx.progress)
    nll = la.grid_val_nll(ctx.bar(ctx.val, "prior search"), prior_grid(s.prior_grid))
    prior = choose_prior(la, nll, s.prior_grid, s.prior)
    fit, t0 = time.perf_counter() - t0, time.perf_counter()
    probs = [probit_probs(*la.logit_mean_cov(b)) for b in ctx.bar(ctx.test, "test predictive")]
    probs = torch.cat(probs)
    seconds = (fit, time.perf_counter() - t0)
    return laplace_result(ctx, la, probs, prior, seconds, "per-cell", skfac_percent)


def kron_prediction(ctx: Context, cell: KronCell) -> Prediction:
    """A KFAC-type cell on its own: ``KronLaplace`` on its subset (:func:`kron_options`)."""
    la = KronLaplace(ctx.model, cell.subset, **kron_options(ctx))
    return laplace_prediction(ctx, la, cell.skfac_percent)


def blocks_of(cell: KronCell) -> dict[tuple[Any, ...], int]:
    """The floats of each Kronecker eigenbasis of a cell, by block (`curvature.internal.block_key`)."""
    out = {}
    for m, km in cell.subset.kron_modules().items():
        r, c = km.n_rows, km.n_cols + (km.bias_name is not None)
        out[block_key(m, km)] = r * r + r + c * c + c
    return out


def groups_of(cells: Sequence[KronCell], memory_floats: int = MEMORY_FLOATS) -> list[list[int]]:
    """Consecutive groups of cell indices whose floats fit ``memory_floats`` (at least one cell a group).

    A cell's floats: its MAP entries and its blocks' eigenbases, a block that an earlier cell of the group
    holds counting once (``KronLaplace.fit_many`` shares it).
    """
    out: list[list[int]] = []
    used, seen = 0, set()  # floats and blocks of the last group
    for i, cell in enumerate(cells):
        blocks = blocks_of(cell)
        need = cell.subset.num_entries() + sum(v for k, v in blocks.items() if k not in seen)
        if out and used + need <= memory_floats:
            out[-1].append(i)
            used += need
            seen.update(blocks)
        else:
            out.append([i])
            used = cell.subset.num_entries() + sum(blocks.values())
            seen = set(blocks)
    return out


def shared_predictions(
    ctx: Context, cells: Sequence[KronCell]
) -> tuple[list[Prediction], dict[str, float]]:
    """The cells' predictions from one training, one validation and one test pass for them all.

    Also the group's seconds: ``fit`` (curvature pass and eigendecompositions), ``prior``, ``predict`` (wall)
    and ``cpu``; a cell's ``fit_seconds`` / ``predict_seconds`` are its share, so a ramp's records add up.
    """
    s, c0, t0 = ctx.settings, time.process_time(), time.perf_counter()
    options = {"generator": mc_generator(ctx, s.fisher), "progress": ctx.progress}
    options.update(kron_options(ctx))
    posts = KronLaplace.fit_many(ctx.model, [c.subset for c in cells], ctx.train, **options)
    t1 = time.perf_counter()
    nll = grid_val_nll_many(posts, ctx.bar(ctx.val, "prior search"), prior_grid(s.prior_grid))
    priors = [choose_prior(la, v, s.prior_grid, s.prior) for la, v in zip(posts, nll, strict=True)]
    t2 = time.perf_counter()
    probs: list[list[torch.Tensor]] = [[] for _ in posts]
    for batch in ctx.bar(ctx.test, "test predictive"):
        for part, (mean, cov) in zip(probs, logit_mean_cov_many(posts, batch), strict=True):
            part.append(probit_probs(mean, cov))
    t3 = time.perf_counter()
    took = {"fit": t1 - t0, "prior": t2 - t1, "predict": t3 - t2, "cpu": time.process_time() - c0}
    share = ((t2 - t0) / len(cells), (t3 - t2) / len(cells))
    preds = [
        laplace_result(ctx, la, torch.cat(p), prior, share, "shared", cell.skfac_percent)
        for la, p, prior, cell in zip(posts, probs, priors, cells, strict=True)
    ]
    return preds, took
