"""A whole ramp of KFAC-type Laplace cells from one curvature pass (``RunConfig.curvature_pass="shared"``).

The KFAC, S-KFAC and module-ramp cells of one (task, split) share the fine-tuned model, the training set
and the validation and test sets. Run one at a time (``curvature_pass="per-cell"``), each cell streams the
training set for its curvature and the validation and test sets for its predictive: a forward pass and
one backward pass per class (or one, with the empirical Fisher) of the whole network per batch, per cell.
Here they share those passes:

1. **Curvature** (:mod:`partialbayes.glue_bench.curvature_pass`): one pass over the training set gives the
   full factors of every linear map a module cell uses and the factors of every S-KFAC level a cell uses,
   bit for bit what each cell's own fit would give; they are stored beside the checkpoint and reused.
2. **Posteriors**: each cell's ``KronLaplace`` is fitted from its factors (``fit_curvature``).
3. **Validation and test** (:mod:`partialbayes.glue_bench.replay`): each batch runs through the network
   once; every cell's posterior then computes its validation NLLs (prior search) and its test predictive
   on a replay of that pass, with the same library code as a per-cell run.

Steps 2–3 hold every posterior of a group in memory at once; cells are grouped so that a group's
eigenbases stay below ``memory_floats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partialbayes.curvature import KronLaplace, ModuleFactors
from partialbayes.glue_bench.context import Context, KronCell, Prediction
from partialbayes.glue_bench.curvature_pass import (
    CurvatureStore,
    TrainingLoss,
    compute_pass,
    weights_digest,
)
from partialbayes.glue_bench.laplace_cells import (
    PriorSearch,
    TestPredictive,
    kron_posterior,
    laplace_result,
    mc_generator,
)
from partialbayes.glue_bench.methods import Method
from partialbayes.glue_bench.replay import capture_batch, replaying
from partialbayes.selection import linear_modules

# Floats of eigenbases a group of cells may hold at once (float64: 8 bytes each, so 1.6 GB).
MEMORY_FLOATS = 200_000_000


@dataclass
class RampCell:
    """One cell of a shared ramp while it is computed.

    Attributes:
        method: The method.
        size: The size key.
        kron: Its subset and S-KFAC level.
        posterior: The fitted ``KronLaplace`` (``None`` before step 2, and after a failure).
        search: Its validation prior search (``laplace_cells.PriorSearch``).
        test: Its test predictive (``laplace_cells.TestPredictive``).
        prior: The prior choice (``PriorSearch.choose``).
        fit_seconds: Wall-clock time of its own fitting steps (eigendecompositions, validation NLLs).
        predict_seconds: Wall-clock time of its own test predictive (on replays).
        cpu_seconds: Process CPU time of its own steps.
        error: The exception that failed the cell, if any.
    """

    method: Method
    size: str
    kron: KronCell
    posterior: KronLaplace | None = None
    search: PriorSearch | None = None
    test: TestPredictive | None = None
    prior: dict[str, Any] = field(default_factory=dict)
    fit_seconds: float = 0.0
    predict_seconds: float = 0.0
    cpu_seconds: float = 0.0
    error: BaseException | None = None

    def fitted(self) -> tuple[KronLaplace, PriorSearch, TestPredictive]:
        """The posterior, prior search and test predictive of a cell fitted without error."""
        assert self.posterior is not None
        assert self.search is not None
        assert self.test is not None
        return self.posterior, self.search, self.test

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time the block as part of this cell's ``phase`` (``fit`` or ``predict``); keep its exception.

        The wall-clock time goes to ``fit_seconds`` or ``predict_seconds``, the CPU time to
        ``cpu_seconds``; an exception becomes the cell's failure instead of propagating.
        """
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        except Exception as err:  # one broken cell must not stop its group
            self.error = err
        finally:
            wall = time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0
            if phase == "fit":
                self.fit_seconds += wall
            else:
                self.predict_seconds += wall


@dataclass
class RampPass:
    """What the shared steps cost (wall-clock seconds), for the records and the stage table.

    Attributes:
        curvature_seconds: The curvature pass (0 when every part was stored already).
        curvature_computed: Whether this run computed (part of) the curvature pass.
        capture_seconds: Forward and backward passes over the validation and test batches.
        cells: Number of cells that shared these passes.
    """

    curvature_seconds: float = 0.0
    curvature_computed: bool = False
    capture_seconds: float = 0.0
    cells: int = 0


def floats_of(kron: KronCell) -> int:
    """Floats of a cell's Kronecker eigenbases (``KronLaplace.num_floats``, before fitting it)."""
    total = 0
    for km in kron.subset.kron_modules().values():
        r = km.n_rows
        c = km.n_cols + (km.bias_name is not None)
        total += r * r + r + c * c + c
    return total


def groups_of(cells: Sequence[RampCell], memory_floats: int) -> list[list[RampCell]]:
    """Consecutive groups of cells whose eigenbases sum to at most ``memory_floats`` (at least one cell)."""
    out: list[list[RampCell]] = []
    used = 0
    for cell in cells:
        need = floats_of(cell.kron)
        if out and used + need <= memory_floats:
            out[-1].append(cell)
            used += need
        else:
            out.append([cell])
            used = need
    return out


def curvature_key(ctx: Context) -> dict[str, Any]:
    """What the stored curvature parts of ``ctx`` depend on (besides the data, fixed per results folder)."""
    return {
        "fisher": ctx.settings.fisher,
        "map": weights_digest(ctx.model),
        "n_train": sum(int(b["labels"].shape[0]) for b in ctx.train),
        "batches": [list(b["input_ids"].shape) for b in ctx.train],
        "num_classes": ctx.num_labels,
        "mc_seed": ctx.seed,
    }


def shared_factors(
    ctx: Context, cells: Sequence[RampCell], log: Callable[[str], None]
) -> tuple[dict[str, ModuleFactors], dict[float, dict[str, ModuleFactors]], TrainingLoss, RampPass]:
    """The factors every cell needs: loaded from the stored parts, the missing ones computed in one pass."""
    modules = [
        m for c in cells if c.kron.skfac_percent is None for m in c.kron.subset.kron_modules()
    ]
    levels = {
        c.kron.skfac_percent: c.kron.subset for c in cells if c.kron.skfac_percent is not None
    }
    info = RampPass(cells=len(cells))
    store = CurvatureStore(ctx.curvature_dir, curvature_key(ctx)) if ctx.curvature_dir else None
    todo_modules, todo_levels = (
        store.missing(modules, levels) if store else (list(dict.fromkeys(modules)), list(levels))
    )
    computed: (
        tuple[dict[str, ModuleFactors], dict[float, dict[str, ModuleFactors]], TrainingLoss] | None
    ) = None
    if todo_modules or todo_levels:
        log(
            f"shared curvature pass ({ctx.settings.fisher} fisher): {len(todo_modules)} linear maps, "
            f"{len(todo_levels)} S-KFAC levels, {sum(int(b['labels'].shape[0]) for b in ctx.train)} "
            "training examples"
        )
        t0 = time.perf_counter()
        computed = compute_pass(
            ctx.model,
            ctx.train,
            todo_modules,
            {p: levels[p] for p in todo_levels},
            fisher=ctx.settings.fisher,
            num_classes=ctx.num_labels,
            generator=mc_generator(ctx, ctx.settings.fisher),
        )
        info.curvature_seconds = time.perf_counter() - t0
        info.curvature_computed = True
        if store is not None:
            store.save(*computed)
    if store is None:
        assert computed is not None
        return (*computed, info)
    full, by_level, loss = store.load(modules, levels)
    if computed is not None and not computed[2].agrees(loss):
        raise ValueError(
            f"the stored curvature parts under {store.folder} disagree with this pass's training loss: "
            "delete the folder to recompute them"
        )
    return full, by_level, loss, info


def cell_factors(
    cell: RampCell,
    full: dict[str, ModuleFactors],
    by_level: dict[float, dict[str, ModuleFactors]],
) -> dict[str, ModuleFactors]:
    """``{module: factors}`` of one cell: its level's factors, or the full factors of its modules."""
    if cell.kron.skfac_percent is not None:
        return by_level[cell.kron.skfac_percent]
    return {m: full[m] for m in cell.kron.subset.kron_modules()}


def _linear_maps(ctx: Context, cells: Sequence[RampCell]) -> dict[str, nn.Module]:
    lin = linear_modules(ctx.model)
    names = {m for c in cells for m in c.kron.subset.kron_modules()}
    return {m: mod for m, mod in lin.items() if m in names}


def _each(cells: Sequence[RampCell]) -> Iterator[RampCell]:
    yield from (c for c in cells if c.error is None)


def _run_group(ctx: Context, group: Sequence[RampCell], info: RampPass) -> None:
    """Validation and test predictives of a group of fitted cells, one network pass per batch."""
    modules = _linear_maps(ctx, [c for c in group if c.error is None])
    for cell in _each(group):
        cell.search = PriorSearch(ctx.settings.prior_grid)
        cell.test = TestPredictive()
    for which in ("val", "test"):
        for batch in getattr(ctx, which):
            live = list(_each(group))
            if not live:
                return
            t0 = time.perf_counter()
            cap = capture_batch(ctx.model, batch, modules)
            info.capture_seconds += time.perf_counter() - t0
            with replaying(ctx.model, modules, cap):
                for cell in live:
                    la, search, test = cell.fitted()
                    if which == "val":
                        with cell.timed("fit"):
                            search.add(la, batch)
                    else:
                        with cell.timed("predict"):
                            test.add(la, batch)
            del cap
        if which == "val":
            for cell in _each(group):
                la, search, _ = cell.fitted()
                with cell.timed("fit"):
                    cell.prior = search.choose(la, ctx.settings.prior)


def run_shared(
    ctx: Context,
    cells: Sequence[tuple[Method, str]],
    log: Callable[[str], None] = print,
    memory_floats: int = MEMORY_FLOATS,
) -> Iterator[tuple[Method, str, Prediction | BaseException, RampPass]]:
    """Run KFAC-type Laplace cells of one (task, split) from one curvature pass.

    Args:
        ctx: The (task, split) context (``ctx.curvature_dir`` set: the factors are stored and reused).
        cells: ``(method, size)`` pairs of methods with a ``kron`` subset function.
        log: Progress messages.
        memory_floats: Eigenbasis floats a group of cells may hold at once (see :func:`groups_of`).

    Yields:
        ``(method, size, prediction or the exception that failed the cell, shared costs)`` per cell, a
        group at a time. A failure of the curvature pass itself fails every cell.
    """
    ramp = []
    for method, size in cells:
        if method.kron is None:
            raise ValueError(
                f"method {method.name!r} has no Kronecker subset: it cannot share a pass"
            )
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            kron = method.kron(ctx, size)
        except Exception as err:  # one broken cell must not stop the ramp
            yield method, size, err, RampPass(cells=len(cells))
            continue
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ramp.append(RampCell(method, size, kron, fit_seconds=wall, cpu_seconds=cpu))
    if not ramp:
        return
    try:
        full, by_level, loss, info = shared_factors(ctx, ramp, log)
    except Exception as err:
        for cell in ramp:
            yield cell.method, cell.size, err, RampPass(cells=len(ramp))
        return
    groups = groups_of(ramp, memory_floats)
    for i, group in enumerate(groups):
        if len(groups) > 1:
            log(f"shared predictive: group {i + 1}/{len(groups)} of {len(group)} cells")
        for cell in group:
            with cell.timed("fit"):
                la = kron_posterior(ctx, cell.kron.subset)
                cell.posterior = la.fit_curvature(
                    cell_factors(cell, full, by_level),
                    map_loss=loss.map_loss,
                    n_data=loss.n_data,
                    n_outputs=loss.n_outputs,
                )
        _run_group(ctx, group, info)
        for cell in group:
            if cell.error is not None:
                yield cell.method, cell.size, cell.error, info
                continue
            la, _, test = cell.fitted()
            pred = laplace_result(
                ctx,
                la,
                cell.kron.subset,
                test.probs(),
                cell.prior,
                cell.fit_seconds,
                cell.predict_seconds,
                "shared",
            )
            if cell.kron.skfac_percent is not None:
                pred.extra["skfac_percent"] = cell.kron.skfac_percent
            pred.extra["cpu_seconds"] = cell.cpu_seconds
            del la, test
            cell.posterior = cell.search = cell.test = None  # free the group's memory
            yield cell.method, cell.size, pred, info
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
