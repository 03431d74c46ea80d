"""One Laplace cell in steps: the posterior, its prior precision, its test predictive.

A grid cell of a Laplace method is split into small steps so that the two ways of running a ramp share
every line of code after the curvature: a cell fitted on its own (``curvature_pass="per-cell"``:
:func:`fit_per_cell` streams the training set for its subset) and a cell derived from the shared pass
(:mod:`partialbayes.glue_bench.ramp`: ``KronLaplace.fit_curvature`` with factors from one pass for the whole
ramp) both choose their prior with :class:`PriorSearch` and predict with :class:`TestPredictive`, batch by
batch, in the same order, so that equal factors give equal records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from partialbayes.glue_bench.methods import Prediction, prior_edge, prior_grid, probit_probs

if TYPE_CHECKING:
    from partialbayes.glue_bench.methods import Context

# Offset of the MC-fisher generator among the run's generators (``Context.generator``).
MC_FISHER_OFFSET = 4


def mc_generator(ctx: Context, fisher: str) -> torch.Generator | None:
    """The generator of the sampled labels for ``fisher="mc"`` (seeded by the run), else ``None``."""
    return ctx.generator(MC_FISHER_OFFSET) if fisher == "mc" else None


def new_posterior(ctx: Context, subset: Any, kind: str = "kron") -> Any:
    """An unfitted Laplace posterior on ``subset`` of ``ctx.model``.

    ``kind="kron"``: ``KronLaplace`` with fisher ``settings.fisher``; ``kind="dense"``: ``DenseLaplace``
    with fisher ``settings.last_layer_fisher``.
    """
    from partialbayes import curvature

    if kind == "kron":
        return curvature.KronLaplace(
            ctx.model, subset, num_classes=ctx.num_labels, fisher=ctx.settings.fisher
        )
    if kind == "dense":
        return curvature.DenseLaplace(
            ctx.model, subset, num_classes=ctx.num_labels, fisher=ctx.settings.last_layer_fisher
        )
    raise ValueError(f"kind must be 'kron' or 'dense', got {kind!r}")


def fit_per_cell(ctx: Context, la: Any) -> Any:
    """Fit ``la`` by its own pass over the training batches (the MC fisher seeded by the run)."""
    return la.fit(ctx.train, generator=mc_generator(ctx, la.fisher))


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

    def add(self, la: Any, batch: Mapping[str, torch.Tensor]) -> None:
        """Add one validation batch (with ``labels``) of the posterior ``la``."""
        n = int(batch["labels"].shape[0])
        self.totals += la.grid_val_nll([batch], self._grid) * n
        self.count += n

    def nll(self) -> torch.Tensor:
        """``[len(grid)]`` mean validation NLL per prior."""
        if self.count == 0:
            raise ValueError("PriorSearch: no validation batch was added")
        return self.totals / self.count

    def choose(self, la: Any, method: str) -> dict[str, Any]:
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

    def add(self, la: Any, batch: Mapping[str, torch.Tensor]) -> None:
        """Add one test batch of the posterior ``la`` (at its current prior precision)."""
        mean, cov = la.logit_mean_cov(batch)
        self.parts.append(probit_probs(mean.double(), cov.double()).cpu())

    def probs(self) -> torch.Tensor:
        """``[N, C]`` predictive probabilities of every batch added, in order."""
        return torch.cat(self.parts)


def modules_of(subset: Any) -> list[str]:
    """Sorted names of the modules a subset touches."""
    return sorted({n.rsplit(".", 1)[0] for n in subset.names})


def laplace_result(
    ctx: Context,
    la: Any,
    subset: Any,
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
        probs,
        int(la.num_floats),
        subset.num_entries(),
        float(subset.percent_of(ctx.model)),
        fit_seconds,
        predict_seconds,
        extra,
        val_nll=prior["val_nll"],
        curvature_pass=curvature_pass,
    )
