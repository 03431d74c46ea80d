"""A whole ramp of KFAC-type Laplace cells from shared passes (``RunConfig.curvature_pass="shared"``).

The KFAC, S-KFAC and module-ramp cells of one (task, split) share the fine-tuned model and the training,
validation and test sets. Run one at a time (``curvature_pass="per-cell"``), each cell streams the
training set for its curvature and the validation and test sets for its predictive. Here a group of cells
shares those passes through the curvature library's several-posterior calls:

1. ``KronLaplace.fit_many``: one pass over the training set gives every cell's factors (each bit for bit
   its own fit's) and the training loss, then each cell's eigendecompositions;
2. ``grid_val_nll_many``: one forward and backward pass per validation batch scores every cell's prior
   grid (the prior is then chosen per cell, :func:`~partialbayes.glue_bench.laplace_cells.choose_prior`);
3. ``logit_mean_cov_many``: the same per test batch for every cell's predictive.

So the records equal the per-cell ones. A group's posteriors live in memory together; cells are grouped
so that a group's eigenbases and MAP entries stay below ``memory_floats`` (each group has its own passes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from partialbayes.curvature import KronLaplace, grid_val_nll_many, logit_mean_cov_many
from partialbayes.glue_bench.context import Context, KronCell, Prediction, prior_grid
from partialbayes.glue_bench.laplace_cells import (
    choose_prior,
    kron_options,
    laplace_result,
    mc_generator,
    probit_probs,
)
from partialbayes.glue_bench.methods import Method

# Floats a group of cells may hold at once (eigenbases and MAP entries; float64: 8 bytes each, so 1.6 GB).
MEMORY_FLOATS = 200_000_000


@dataclass
class RampPass:
    """What a group's shared steps cost (wall-clock and process CPU seconds), for the records.

    Attributes:
        fit_seconds: ``KronLaplace.fit_many``: the curvature pass and every cell's eigendecompositions.
        prior_seconds: The validation pass and the prior choices.
        predict_seconds: The test pass.
        cpu_seconds: Process CPU time of the three.
        cells: Number of cells that shared these passes.
    """

    fit_seconds: float = 0.0
    prior_seconds: float = 0.0
    predict_seconds: float = 0.0
    cpu_seconds: float = 0.0
    cells: int = 0


def floats_of(kron: KronCell) -> int:
    """Floats a cell's posterior holds: its Kronecker eigenbases (``num_floats``) and its MAP entries."""
    total = kron.subset.num_entries()
    for km in kron.subset.kron_modules().values():
        r, c = km.n_rows, km.n_cols + (km.bias_name is not None)
        total += r * r + r + c * c + c
    return total


def groups_of(cells: Sequence[KronCell], memory_floats: int) -> list[list[int]]:
    """Consecutive groups of cell indices whose floats sum to at most ``memory_floats`` (at least one)."""
    out: list[list[int]] = []
    used = 0
    for i, cell in enumerate(cells):
        need = floats_of(cell)
        if out and used + need <= memory_floats:
            out[-1].append(i)
            used += need
        else:
            out.append([i])
            used = need
    return out


def shared_predictions(ctx: Context, cells: Sequence[KronCell], info: RampPass) -> list[Prediction]:
    """The cells' predictions from one training, one validation and one test pass (timed into ``info``).

    A cell's ``fit_seconds`` / ``predict_seconds`` are its share of the group's (the group's time over
    its cells), so that a ramp's records add up to what it cost.
    """
    s, c0 = ctx.settings, time.process_time()
    t0 = time.perf_counter()
    subsets = [c.subset for c in cells]
    posts = KronLaplace.fit_many(
        ctx.model, subsets, ctx.train, generator=mc_generator(ctx, s.fisher), **kron_options(ctx)
    )
    info.fit_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    nll = grid_val_nll_many(posts, ctx.val, prior_grid(s.prior_grid))
    priors = [
        choose_prior(la, row, s.prior_grid, s.prior) for la, row in zip(posts, nll, strict=True)
    ]
    info.prior_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    probs: list[list[torch.Tensor]] = [[] for _ in posts]
    for batch in ctx.test:
        for part, (mean, cov) in zip(probs, logit_mean_cov_many(posts, batch), strict=True):
            part.append(probit_probs(mean, cov))
    info.predict_seconds = time.perf_counter() - t0
    info.cpu_seconds = time.process_time() - c0
    fit, predict = (
        (info.fit_seconds + info.prior_seconds) / len(cells),
        info.predict_seconds / len(cells),
    )
    out = []
    for la, part, prior, cell in zip(posts, probs, priors, cells, strict=True):
        pred = laplace_result(ctx, la, torch.cat(part), prior, fit, predict, "shared")
        if cell.skfac_percent is not None:
            pred.extra["skfac_percent"] = cell.skfac_percent
        out.append(pred)
    return out


def run_shared(
    ctx: Context,
    cells: Sequence[tuple[Method, str]],
    log: Callable[[str], None] = print,
    memory_floats: int = MEMORY_FLOATS,
) -> Iterator[tuple[Method, str, Prediction | BaseException, RampPass]]:
    """Run KFAC-type Laplace cells of one (task, split) from shared passes, a group at a time.

    Args:
        ctx: The (task, split) context.
        cells: ``(method, size)`` pairs of methods with a ``kron`` subset function.
        log: Progress messages.
        memory_floats: Floats a group of cells may hold at once (see :func:`groups_of`).

    Yields:
        ``(method, size, prediction or the exception that failed the cell, the group's costs)`` per cell,
        a group at a time. A failure of a group's passes fails every cell of the group.
    """
    ramp: list[tuple[Method, str, KronCell]] = []
    for method, size in cells:
        if method.kron is None:
            raise ValueError(
                f"method {method.name!r} has no Kronecker subset: it cannot share a pass"
            )
        try:
            ramp.append((method, size, method.kron(ctx, size)))
        except Exception as err:  # one broken cell must not stop the ramp
            yield method, size, err, RampPass(cells=1)
    groups = groups_of([kron for _, _, kron in ramp], memory_floats)
    for i, group in enumerate(groups):
        members = [ramp[j] for j in group]
        log(
            f"shared passes ({ctx.settings.fisher} fisher): group {i + 1}/{len(groups)} of "
            f"{len(members)} cells, {sum(int(b['labels'].shape[0]) for b in ctx.train)} training examples"
        )
        info = RampPass(cells=len(members))
        try:
            preds: list[Prediction | BaseException] = [
                *shared_predictions(ctx, [kron for _, _, kron in members], info)
            ]
        except Exception as err:  # the group's pass failed: every cell of it
            preds = [err] * len(members)
        for (method, size, _), pred in zip(members, preds, strict=True):
            yield method, size, pred, info
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
