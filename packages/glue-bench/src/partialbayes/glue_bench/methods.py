"""The posterior methods of the benchmark: a registry of plain functions ``run(ctx, size) -> Prediction``.

Every method turns the fine-tuned (MAP) classifier of one (task, split) into predictive probabilities on
the test set. Ramping methods have several sizes (module counts or percentages); the others have the
single size ``"-"``. Methods that need a sibling package import it when they run, so the registry itself
imports nothing optional.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partialbayes.glue_bench.linearised import LinearSamplingConfig

Batch = dict[str, torch.Tensor]

# Where the ramp sizes come from (every record also stores the percentage of countable parameters that was
# actually stochastic, ``percent_stochastic`` = ``Subset.percent_of``, and the requested size):
# * MODULE_COUNTS: the module counts of Kampen et al.'s ramping figures (``selection.PAPER_COUNTS`` without
#   the 0, which is the MAP cell); counts above a model's number of linear maps in the group are dropped.
# * SKFAC_PERCENTS: the S-KFAC percentages p of the paper's Table 3 (percent of the rows and of the columns
#   kept in every linear map, DESIGN.md's S-KFAC rule) without its 0 (the MAP cell) and 100 (the
#   ``kfac-full`` cell). A map keeps about (p/100)² of its weights (the paper's g_p), so these cover about
#   0.01 % to 11 % of the linear weights; 33 is the ≈ 10 % cell of Table 2.
# * SWAG_L1_PERCENTS: the paper's l1 sub-layer ramp p ∈ {1, 12, 24, 36, 48, 60, 100}: percent of the
#   countable parameters with the largest magnitude (``selection.largest_magnitude``).
MODULE_COUNTS = (1, 2, 3, 4, 5, 8, 11, 17, 38)
SKFAC_PERCENTS = (1.0, 1.8, 2.5, 3.2, 3.9, 4.6, 5.4, 6.1, 6.8, 12.6, 18.4, 24.2, 30.0, 33.0)
SWAG_L1_PERCENTS = (1.0, 12.0, 24.0, 36.0, 48.0, 60.0, 100.0)
# Prior precisions 10^-1, 10^-0.5, ..., 10^3: the paper's range (Table 6, "equidistant in logspace in
# [10^-1, 10^3]"; the number of points is not given, we take half decades). Built in float64 so that
# records store 0.1, not the float32 value 0.10000000149011612. Hand it to the Laplace posteriors as
# :func:`prior_grid` (a float64 tensor): ``torch.as_tensor`` of a tuple of floats would round it to float32.
# The grid is not extended beyond the paper's range: a cell whose tuned prior lands on an end of it says so
# (``extra.prior_at_grid_edge``) and the report flags it; ``Settings.prior_grid`` changes the grid.
PRIOR_GRID = tuple(float(v) for v in torch.logspace(-1, 3, 9, dtype=torch.float64))
# Fisher types of the Laplace curvature (``partialbayes.curvature``): the paper's KFAC is built on the
# empirical Fisher (its Eqs. 13-16), its last-layer Laplace on the full GGN ("exact").
FISHERS = ("empirical", "exact", "mc")


def prior_grid(values: Sequence[float] = PRIOR_GRID) -> torch.Tensor:
    """A prior-precision grid as a float64 tensor (the ``grid`` argument of ``optimize_prior_precision``)."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def prior_edge(chosen: float, grid: Sequence[float]) -> str | None:
    """``"lowest"`` / ``"highest"`` when ``chosen`` is the smallest / largest value of ``grid``, else ``None``.

    A prior precision tuned to an end of its grid may not be the optimum: the validation NLL (or the
    evidence) might still improve beyond it. The lowest prior gives the widest posterior the grid allows, the
    highest the one closest to the MAP.
    """
    if chosen == min(grid):
        return "lowest"
    if chosen == max(grid):
        return "highest"
    return None


def _check_positive_int(owner: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{key} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{key} must be >= 1, got {value}")


def _check_numbers(owner: str, key: str, values: Any, high: float = math.inf) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{owner}.{key} must be a sequence of numbers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{owner}.{key} must hold numbers, got {v!r} in {values!r}")
        if not (0 < v <= high) or math.isnan(v):
            raise ValueError(f"{owner}.{key} values must be in (0, {high:g}], got {v!r}")
        out.append(float(v))
    if not out:
        raise ValueError(f"{owner}.{key} is empty")
    if len(set(out)) != len(out):
        raise ValueError(f"{owner}.{key} has repeated values: {list(values)}")
    return tuple(out)


@dataclass
class Settings:
    """Method hyperparameters (part of the results configuration).

    Attributes:
        prior: ``val_nll`` (grid search over ``prior_grid`` on validation) or ``marglik``.
        prior_grid: Candidate prior precisions (default :data:`PRIOR_GRID`, the paper's range).
        fisher: Fisher type of the KFAC / S-KFAC / module-ramp Laplace curvature: ``empirical`` (default:
            the paper's, its Eqs. 13-16, and one backward pass per batch), ``exact`` (the GGN, one backward
            pass per class) or ``mc`` (one sampled label per example, seeded by the run).
        last_layer_fisher: Fisher type of the dense last-layer Laplace (default ``exact``: the paper's
            last-layer Laplace uses the full GGN).
        n_samples: Monte Carlo samples for SWAG and IVON predictions.
        swag_lrs: SWAG learning rates of the validation sweep.
        swag_sweep_steps: SGD steps per sweep point.
        swag_steps: SGD steps of the final SWAG run.
        module_counts: Module counts of the module-ramping methods.
        skfac_percents: Percentages of the S-KFAC ramping (default: the paper's Table 3).
        swag_l1_percents: Percentages of the SWAG largest-magnitude (l1) sub-layer ramping.
        linear_sampling: Settings of the sampling-based linearised Laplace methods (``ls-*``).
    """

    prior: str = "val_nll"
    prior_grid: tuple[float, ...] = PRIOR_GRID
    fisher: str = "empirical"
    last_layer_fisher: str = "exact"
    n_samples: int = 50
    swag_lrs: tuple[float, ...] = (1e-3, 1e-2, 5e-2, 1e-1)
    swag_sweep_steps: int = 400
    swag_steps: int = 2000
    module_counts: tuple[int, ...] = MODULE_COUNTS
    skfac_percents: tuple[float, ...] = SKFAC_PERCENTS
    swag_l1_percents: tuple[float, ...] = SWAG_L1_PERCENTS
    linear_sampling: LinearSamplingConfig = field(default_factory=LinearSamplingConfig)

    def __post_init__(self) -> None:
        if self.prior not in ("val_nll", "marglik"):
            raise ValueError(f"Settings.prior must be 'val_nll' or 'marglik', got {self.prior!r}")
        for key in ("fisher", "last_layer_fisher"):
            if getattr(self, key) not in FISHERS:
                raise ValueError(
                    f"Settings.{key} must be one of {FISHERS}, got {getattr(self, key)!r}"
                )
        for key in ("n_samples", "swag_sweep_steps", "swag_steps"):
            _check_positive_int("Settings", key, getattr(self, key))
        self.prior_grid = _check_numbers("Settings", "prior_grid", self.prior_grid)
        if len(self.prior_grid) < 2:
            raise ValueError(f"Settings.prior_grid needs at least 2 values, got {self.prior_grid}")
        self.swag_lrs = _check_numbers("Settings", "swag_lrs", self.swag_lrs)
        self.skfac_percents = _check_numbers("Settings", "skfac_percents", self.skfac_percents, 100)
        self.swag_l1_percents = _check_numbers(
            "Settings", "swag_l1_percents", self.swag_l1_percents, 100
        )
        counts = self.module_counts
        if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence) or not counts:
            raise TypeError(f"Settings.module_counts must be a non-empty sequence, got {counts!r}")
        for k in counts:
            _check_positive_int("Settings", "module_counts", k)
        self.module_counts = tuple(counts)
        if not isinstance(self.linear_sampling, LinearSamplingConfig):
            raise TypeError(
                "Settings.linear_sampling must be a LinearSamplingConfig, got "
                f"{type(self.linear_sampling).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        out["linear_sampling"] = asdict(self.linear_sampling)
        return out


@dataclass
class Context:
    """Everything a method needs about one fine-tuned (task, split).

    Attributes:
        model: The fine-tuned classifier at its MAP weights, in eval mode, on ``device``.
        train: Training batches (dicts with ``labels``) on ``device``, for curvature and SWAG.
        val: Validation batches on ``device``.
        test: Test batches on ``device``.
        num_labels: Number of classes.
        device: The device.
        seed: Seed of this (task, split): random module choices and sampling derive from it.
        settings: Method hyperparameters.
        ivon: ``{"hess": {name: tensor}, "ess": float, "weight_decay": float, "finetune_seconds": float}``
            when fine-tuned with IVON (``finetune_seconds``: wall-clock time of the IVON fine-tuning that
            produced the checkpoint).
        curvature_dir: Folder of the shared curvature pass (beside the checkpoint); ``None``: not stored.
    """

    model: nn.Module
    train: list[Batch]
    val: list[Batch]
    test: list[Batch]
    num_labels: int
    device: torch.device
    seed: int
    settings: Settings = field(default_factory=Settings)
    ivon: dict[str, Any] | None = None
    curvature_dir: Path | None = None
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def labels(self, which: str) -> torch.Tensor:
        """(N,) labels of ``"val"`` or ``"test"``."""
        return torch.cat([b["labels"] for b in getattr(self, which)]).cpu()

    def logits(self, which: str) -> torch.Tensor:
        """(N, C) float64 MAP logits of ``"val"`` or ``"test"`` (cached)."""
        if which not in self._cache:
            self._cache[which] = batch_logits(self.model, getattr(self, which))
        return self._cache[which]

    def generator(self, offset: int) -> torch.Generator:
        """A CPU generator seeded by this (task, split) and ``offset`` (one offset per kind of draw)."""
        return torch.Generator().manual_seed(self.seed * 1000 + offset)


@dataclass
class Prediction:
    """A method's output on the test set.

    Attributes:
        probs: (N, C) float64 predictive probabilities.
        floats: Floats the posterior stores beyond the MAP weights.
        n_stochastic: Number of stochastic parameters.
        percent_stochastic: Percent of the countable parameters that are stochastic.
        fit_seconds: Time to build the posterior (including hyperparameter search).
        predict_seconds: Time to predict the test set.
        extra: Method-specific facts (chosen prior precision, learning rate, modules).
        val_nll: Mean validation NLL of the method's predictive (the level of a ramp is chosen by it, as in
            the paper's §5.4); ``None`` when not computed.
        curvature_pass: Laplace cells: ``"per-cell"`` (curvature from the cell's own pass over the
            training set) or ``"shared"`` (from the one pass of the whole ramp); ``None`` otherwise.
    """

    probs: torch.Tensor
    floats: int
    n_stochastic: int
    percent_stochastic: float
    fit_seconds: float
    predict_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    val_nll: float | None = None
    curvature_pass: str | None = None


@dataclass(frozen=True)
class KronCell:
    """The subset of a KFAC-type Laplace cell, and what the shared curvature pass derives it from.

    Attributes:
        subset: Kronecker-structured ``selection.Subset``.
        skfac_percent: The S-KFAC percentage of an ``skfac`` cell (factors of that level); ``None`` for a
            union of whole linear maps (their full factors).
    """

    subset: Any
    skfac_percent: float | None = None


@dataclass(frozen=True)
class Method:
    """One registered method.

    Attributes:
        name: Command-line name.
        description: One line.
        sizes: ``sizes(ctx) -> list of size keys`` (``["-"]`` for single-cell methods).
        run: ``run(ctx, size) -> Prediction``.
        requires: Sibling package the method imports when it runs (for error messages).
        kron: For KFAC-type Laplace methods, ``kron(ctx, size) -> KronCell``: the cell's subset, so that a
            whole ramp can share one curvature pass (:mod:`partialbayes.glue_bench.ramp`).
    """

    name: str
    description: str
    sizes: Callable[[Context], list[str]]
    run: Callable[[Context, str], Prediction]
    requires: str | None = None
    kron: Callable[[Context, str], KronCell] | None = None


# ------------------------------------------------------------------------------------------ helpers
@torch.no_grad()
def batch_logits(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """(N, C) float64 logits of ``model`` over dict batches (labels ignored), on cpu."""
    out = []
    for b in batches:
        inputs = {k: v for k, v in b.items() if k != "labels"}
        out.append(model(**inputs).logits.double().cpu())
    return torch.cat(out)


def probit_probs(mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Probit approximation of E[softmax(f)], f ~ N(mean, cov) (Kampen et al. Eq. 12, from `predictive`).

    Args:
        mean: (B, C) logit means.
        cov: (B, C, C) logit covariances.

    Returns:
        (B, C) probabilities ``softmax(mean / sqrt(1 + π/8 · diag(cov)))``.
    """
    from partialbayes.predictive import probit

    return probit(mean, cov)


def _countable(model: nn.Module) -> int:
    from partialbayes.selection import countable_parameters

    return countable_parameters(model)


def _single(_: Context) -> list[str]:
    return ["-"]


def _fmt(p: float) -> str:
    return f"{p:g}"


# ------------------------------------------------------------------------------------------ MAP, TS
def _val_nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    from partialbayes.predictive import nll

    return float(nll(probs.double(), labels))


def run_map(ctx: Context, size: str) -> Prediction:
    """The fine-tuned network's softmax probabilities."""
    t0 = time.perf_counter()
    probs = torch.softmax(ctx.logits("test"), -1)
    val = _val_nll(torch.softmax(ctx.logits("val"), -1), ctx.labels("val"))
    return Prediction(probs, 0, 0, 0.0, 0.0, time.perf_counter() - t0, val_nll=val)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Temperature T > 0 minimising the validation NLL of ``softmax(logits / T)`` (from `predictive`).

    Args:
        logits: (N, C) validation logits.
        labels: (N,) validation labels.

    When the validation NLL has no finite optimum (an untrained model, or a separable validation set),
    `predictive` refuses; the benchmark then takes the best T on the grid ``logspace(-2, 2, 81)`` and warns,
    so that one degenerate cell does not stop a grid.
    """
    import warnings

    from partialbayes.predictive import fit_temperature as fit

    try:
        return float(fit(logits.double(), labels))
    except ValueError as err:
        grid = torch.logspace(-2, 2, 81, dtype=torch.float64)
        z = logits.double()
        losses = torch.stack([torch.nn.functional.cross_entropy(z / t, labels) for t in grid])
        best = float(grid[int(losses.argmin())])
        warnings.warn(
            f"{err}; using the best grid temperature T={best:g} in [0.01, 100]", stacklevel=2
        )
        return best


def run_temperature(ctx: Context, size: str) -> Prediction:
    """Temperature scaling fitted on the validation set."""
    t0 = time.perf_counter()
    temp = fit_temperature(ctx.logits("val"), ctx.labels("val"))
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    probs = torch.softmax(ctx.logits("test") / temp, -1)
    val = _val_nll(torch.softmax(ctx.logits("val") / temp, -1), ctx.labels("val"))
    return Prediction(
        probs, 1, 0, 0.0, fit, time.perf_counter() - t0, {"temperature": temp}, val_nll=val
    )


# ------------------------------------------------------------------------------------------ Laplace
def laplace_prediction(ctx: Context, subset: Any, kind: str = "kron") -> Prediction:
    """Fit a Laplace posterior of ``kind`` (``kron`` or ``dense``) on ``subset``, tune the prior, predict.

    The cell's own curvature pass over the training set (``curvature_pass="per-cell"``), the validation NLL
    of every prior of ``settings.prior_grid``, the prior chosen by validation NLL or by the marginal
    likelihood (``settings.prior``), then the linearised probit predictive on the test set
    (:mod:`partialbayes.glue_bench.laplace_cells`).
    """
    from partialbayes.glue_bench.laplace_cells import (
        PriorSearch,
        TestPredictive,
        fit_per_cell,
        laplace_result,
        new_posterior,
    )

    t0 = time.perf_counter()
    la = fit_per_cell(ctx, new_posterior(ctx, subset, kind))
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


def _modules(subset: Any) -> list[str]:
    return sorted({n.rsplit(".", 1)[0] for n in subset.names})


def _n_linear(ctx: Context, group: str) -> int:
    from partialbayes.selection import grouped_linear_modules

    return len(grouped_linear_modules(ctx.model, group))


def _count_sizes(group: str) -> Callable[[Context], list[str]]:
    def sizes(ctx: Context) -> list[str]:
        n = _n_linear(ctx, group)
        return [str(k) for k in ctx.settings.module_counts if k <= n]

    return sizes


def _module_subset(ctx: Context, strategy: str, group: str, k: int) -> Any:
    from partialbayes import selection

    if strategy == "random":
        return selection.random_modules(ctx.model, k, seed=ctx.seed, group=group)
    if strategy == "max":
        return selection.max_operator_norm(ctx.model, k, group=group)
    return selection.min_operator_norm(ctx.model, k, group=group)


def run_last_layer(ctx: Context, size: str) -> Prediction:
    """Dense-GGN Laplace on the classification head."""
    from partialbayes.selection import last_layer

    return laplace_prediction(ctx, last_layer(ctx.model), kind="dense")


def kron_full(ctx: Context, size: str) -> KronCell:
    """The subset of ``kfac-full``: every linear map."""
    return KronCell(_module_subset(ctx, "max", "all", _n_linear(ctx, "all")))


def kron_skfac(ctx: Context, size: str) -> KronCell:
    """The subset of an ``skfac`` cell: ``size`` % of the rows and columns of every linear map."""
    from partialbayes.selection import sparse_kfac

    return KronCell(sparse_kfac(ctx.model, float(size)), float(size))


def run_kfac_full(ctx: Context, size: str) -> Prediction:
    """KFAC Laplace on every linear map."""
    return laplace_prediction(ctx, kron_full(ctx, size).subset)


def run_skfac(ctx: Context, size: str) -> Prediction:
    """S-KFAC Laplace keeping ``size`` % of the rows and columns of every linear map."""
    pred = laplace_prediction(ctx, kron_skfac(ctx, size).subset)
    pred.extra["skfac_percent"] = float(size)
    return pred


# ------------------------------------------------------------------------------------------ SWAG
# Offsets of the run's generators (``Context.generator``): one per kind of random draw, so that no two
# draws of a run share a stream (the MC fisher uses ``laplace_cells.MC_FISHER_OFFSET`` = 4).
SWAG_SWEEP_OFFSET, SWAG_SAMPLES_OFFSET, IVON_SAMPLES_OFFSET, LS_OFFSET = 1, 2, 3, 5


def _mc_probs(
    ctx: Context, sampled: Callable[[torch.Generator], Any], offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo predictive on the test and validation sets: ``settings.n_samples`` weight samples.

    ``sampled(generator)`` is a context manager that puts one weight sample into ``ctx.model``; each
    sample scores both sets, so the validation NLL (which chooses a ramp's level) is that of the very
    posterior the test probabilities come from.

    Returns:
        ``(test probs [N_test, C], validation probs [N_val, C])``, float64.
    """
    gen = ctx.generator(offset)
    test = torch.zeros_like(ctx.logits("test"))
    val = torch.zeros_like(ctx.logits("val"))
    for _ in range(ctx.settings.n_samples):
        with sampled(gen):
            test += torch.softmax(batch_logits(ctx.model, ctx.test), -1)
            val += torch.softmax(batch_logits(ctx.model, ctx.val), -1)
    return test / ctx.settings.n_samples, val / ctx.settings.n_samples


def swag_prediction(ctx: Context, subset: Any) -> Prediction:
    """SWAG on ``subset``: learning rate by validation NLL, then Monte Carlo predictions.

    With a single learning rate in ``settings.swag_lrs`` there is nothing to choose: the sweep (and its
    validation predictive) is skipped and SWAG is collected at that rate directly. The SGD steps run in
    training mode: their dropout draws come from the global generator, which the cell seeds
    (``experiment.run_cell``).
    """
    from partialbayes.swag import collect_swag, sweep_learning_rate

    s = ctx.settings
    t0 = time.perf_counter()
    if len(s.swag_lrs) == 1:
        lr = float(s.swag_lrs[0])
        swag = collect_swag(
            ctx.model, subset, ctx.train, lr=lr, n_steps=s.swag_steps, progress=False
        )
    else:
        result = sweep_learning_rate(
            ctx.model,
            subset,
            ctx.train,
            ctx.val,
            lrs=s.swag_lrs,
            sweep_steps=s.swag_sweep_steps,
            final_steps=s.swag_steps,
            n_samples=min(s.n_samples, 20),
            generator=ctx.generator(SWAG_SWEEP_OFFSET),
            progress=False,
        )
        lr, swag = result.lr, result.swag
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    test, val = _mc_probs(ctx, lambda g: swag.sampled(ctx.model, generator=g), SWAG_SAMPLES_OFFSET)
    predict = time.perf_counter() - t0
    return Prediction(
        test,
        int(swag.num_floats),
        subset.num_entries(),
        float(subset.percent_of(ctx.model)),
        fit,
        predict,
        {"swag_lr": lr, "swag_lr_swept": len(s.swag_lrs) > 1, "modules": _modules(subset)},
        val_nll=_val_nll(val, ctx.labels("val")),
    )


def run_swag_l1(ctx: Context, size: str) -> Prediction:
    """SWAG on the ``size`` % largest-magnitude (l1) parameters."""
    from partialbayes.selection import largest_magnitude

    pred = swag_prediction(ctx, largest_magnitude(ctx.model, float(size)))
    pred.extra["l1_percent"] = float(size)
    return pred


def run_swag_full(ctx: Context, size: str) -> Prediction:
    """SWAG on every linear map."""
    return swag_prediction(ctx, _module_subset(ctx, "max", "all", _n_linear(ctx, "all")))


# ------------------------------------------------------------------------------------------ IVON
def run_ivon(ctx: Context, size: str) -> Prediction:
    """IVON's mean-field posterior N(m, 1/(ess·(h+δ))) from IVON fine-tuning, Monte Carlo predictions.

    Only the countable parameters are stochastic: the token, position and token-type embeddings are never
    sampled and never counted (DESIGN), also for checkpoints whose IVON Hessians cover them. The posterior
    is built by the IVON fine-tuning, so ``fit_seconds`` is that fine-tuning's wall-clock time (from the
    checkpoint's meta, also when the checkpoint was reused) plus the few milliseconds of turning its Hessian
    into standard deviations; ``extra`` holds both parts. Note that the ``map`` cell of the same results
    folder (the IVON mean) comes from the same training, at ``fit_seconds`` 0.
    """
    from partialbayes.selection import countable_named_parameters

    if ctx.ivon is None:
        raise ValueError("method 'ivon' needs a model fine-tuned with --optimizer ivon")
    t0 = time.perf_counter()
    params = dict(ctx.model.named_parameters())
    countable = countable_named_parameters(ctx.model)
    ess, delta = float(ctx.ivon["ess"]), float(ctx.ivon["weight_decay"])
    hess = {k: v.to(params[k].device) for k, v in ctx.ivon["hess"].items() if k in countable}
    if not hess:
        raise ValueError("the IVON checkpoint holds no Hessian of a countable parameter")
    std = {k: 1.0 / torch.sqrt(ess * (h + delta)) for k, h in hess.items()}
    setup = time.perf_counter() - t0
    finetune = float(ctx.ivon.get("finetune_seconds", 0.0))
    means = {k: params[k].detach().clone() for k in std}

    @contextmanager
    def sampled(gen: torch.Generator) -> Iterator[None]:
        try:
            with torch.no_grad():
                for k, sd in std.items():
                    eps = torch.randn(sd.shape, generator=gen, dtype=sd.dtype).to(sd.device)
                    params[k].copy_(means[k] + sd * eps)
            yield
        finally:
            with torch.no_grad():
                for k, m in means.items():
                    params[k].copy_(m)

    t0 = time.perf_counter()
    test, val = _mc_probs(ctx, sampled, IVON_SAMPLES_OFFSET)
    n = sum(int(h.numel()) for h in hess.values())
    return Prediction(
        test,
        n,
        n,
        100.0 * n / max(_countable(ctx.model), 1),
        finetune + setup,
        time.perf_counter() - t0,
        {
            "finetune_seconds": finetune,
            "posterior_setup_seconds": setup,
            "fit_seconds_note": "IVON fine-tuning (the posterior is its by-product) plus setup",
        },
        val_nll=_val_nll(val, ctx.labels("val")),
    )


# ------------------------------------------------------------------------------------------ linear sampling
def _linear_sampling(ctx: Context, subset: Any) -> Prediction:
    from partialbayes.glue_bench.linearised import linear_sampling_prediction

    return linear_sampling_prediction(ctx, subset)


def run_ls_last_layer(ctx: Context, size: str) -> Prediction:
    """Sampling-based linearised Laplace on the classification head."""
    from partialbayes.selection import last_layer

    return _linear_sampling(ctx, last_layer(ctx.model))


def run_ls_skfac(ctx: Context, size: str) -> Prediction:
    """Sampling-based linearised Laplace on the S-KFAC subset of ``size`` % rows and columns."""
    from partialbayes.selection import sparse_kfac

    pred = _linear_sampling(ctx, sparse_kfac(ctx.model, float(size)))
    pred.extra["skfac_percent"] = float(size)
    return pred


def run_ls_random(ctx: Context, size: str) -> Prediction:
    """Sampling-based linearised Laplace on ``size`` random linear maps."""
    return _linear_sampling(ctx, _module_subset(ctx, "random", "all", int(size)))


def run_ls_full(ctx: Context, size: str) -> Prediction:
    """Sampling-based linearised Laplace on every linear map (weights and biases)."""
    return _linear_sampling(ctx, _module_subset(ctx, "max", "all", _n_linear(ctx, "all")))


# ------------------------------------------------------------------------------------------ module ramps
# The module-ramping strategies of the paper (its Figs. 2-4): (strategy, group) pairs, each ramped over
# ``Settings.module_counts``. Every family (posterior) uses exactly the same module selection
# (:func:`_module_subset`), so ``kfac-max-mlp`` and ``swag-max-mlp`` put their posterior on the same maps.
MODULE_STRATEGIES = (
    ("random", "all"),
    ("max", "mlp"),
    ("min", "mlp"),
    ("max", "attention"),
    ("min", "attention"),
)
# family -> (posterior in words, sibling package it needs)
RAMP_FAMILIES = {"kfac": ("KFAC Laplace", "curvature"), "swag": ("SWAG", "swag")}


def _ramp_name(family: str, strategy: str, group: str) -> str:
    """``kfac-random``, ``kfac-max-mlp``, ``swag-min-attn``, ..."""
    if group == "all":
        return f"{family}-{strategy}"
    return f"{family}-{strategy}-{'attn' if group == 'attention' else group}"


def _module_ramp(family: str, strategy: str, group: str) -> Callable[[Context, str], Prediction]:
    predict = swag_prediction if family == "swag" else laplace_prediction

    def run(ctx: Context, size: str) -> Prediction:
        return predict(ctx, _module_subset(ctx, strategy, group, int(size)))

    return run


def _module_kron(strategy: str, group: str) -> Callable[[Context, str], KronCell]:
    def kron(ctx: Context, size: str) -> KronCell:
        return KronCell(_module_subset(ctx, strategy, group, int(size)))

    return kron


# ------------------------------------------------------------------------------------------ registry
def _pct_sizes(attr: str) -> Callable[[Context], list[str]]:
    return lambda ctx: [_fmt(p) for p in getattr(ctx.settings, attr)]


def _registry() -> dict[str, Method]:
    methods = [
        Method("map", "the fine-tuned network (MAP)", _single, run_map),
        Method("temperature", "temperature scaling on validation NLL", _single, run_temperature),
        Method(
            "last-layer",
            "Laplace, dense GGN on the classification head",
            _single,
            run_last_layer,
            "curvature",
        ),
        Method(
            "kfac-full",
            "KFAC Laplace on every linear map",
            _single,
            run_kfac_full,
            "curvature",
            kron_full,
        ),
        Method(
            "skfac",
            "S-KFAC Laplace ramping (percent of rows/cols)",
            _pct_sizes("skfac_percents"),
            run_skfac,
            "curvature",
            kron_skfac,
        ),
        Method(
            "swag-l1",
            "SWAG on the p % largest-magnitude weights",
            _pct_sizes("swag_l1_percents"),
            run_swag_l1,
            "swag",
        ),
        Method("swag-full", "SWAG on every linear map", _single, run_swag_full, "swag"),
        Method("ivon", "IVON posterior (needs --optimizer ivon)", _single, run_ivon, "ivon"),
        Method(
            "ls-last-layer",
            "sampling-based linearised Laplace (EM prior) on the classification head",
            _single,
            run_ls_last_layer,
            "linear_sampling",
        ),
        Method(
            "ls-skfac",
            "sampling-based linearised Laplace on the S-KFAC subsets (percent of rows/cols)",
            _pct_sizes("skfac_percents"),
            run_ls_skfac,
            "linear_sampling",
        ),
        Method(
            "ls-random",
            "sampling-based linearised Laplace on k random linear maps",
            _count_sizes("all"),
            run_ls_random,
            "linear_sampling",
        ),
        Method(
            "ls-full",
            "sampling-based linearised Laplace on every linear map",
            _single,
            run_ls_full,
            "linear_sampling",
        ),
    ]
    for family, (posterior, requires) in RAMP_FAMILIES.items():
        for strategy, group in MODULE_STRATEGIES:
            label = "random" if strategy == "random" else f"{strategy} operator norm"
            methods.append(
                Method(
                    _ramp_name(family, strategy, group),
                    f"{posterior} on k linear maps ({label}, {group})",
                    _count_sizes(group),
                    _module_ramp(family, strategy, group),
                    requires,
                    _module_kron(strategy, group) if family == "kfac" else None,
                )
            )
    return {m.name: m for m in methods}


METHODS: dict[str, Method] = _registry()


def get_methods(names: Sequence[str]) -> list[Method]:
    """Look up methods by name; raises ``ValueError`` listing the valid names."""
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; valid methods: {', '.join(METHODS)}")
    return [METHODS[n] for n in names]
