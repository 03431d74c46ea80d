"""The posterior methods of the benchmark: a registry of plain functions ``run(ctx, size) -> Prediction``.

Every method turns the fine-tuned (MAP) classifier of one (task, split) into predictive probabilities on
the test set. Ramping methods have several sizes (module counts or percentages); the others have the
single size ``"-"``. Methods that need a sibling package import it when they run, so the registry itself
imports nothing optional.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from partialbayes.glue_bench.linearised import LinearSamplingConfig

Batch = dict[str, torch.Tensor]

# Where the ramp sizes come from (every record also stores the percentage of countable parameters that was
# actually stochastic, ``percent_stochastic`` = ``Subset.percent_of``, and the requested size):
# * MODULE_COUNTS: the module counts of Kampen et al.'s ramping figures (``selection.PAPER_COUNTS`` without
#   the 0, which is the MAP cell); counts above a model's number of linear maps in the group are dropped.
# * SKFAC_PERCENTS: the S-KFAC percentage p (percent of the rows and of the columns kept in every linear
#   map, DESIGN.md's S-KFAC rule) of the authors' experiment code, ``numpy.linspace(1, 30, 6)`` rounded to
#   one decimal. A map keeps about (p/100)² of its weights (the paper's g_p, Table 3), so these cover
#   about 0.01 % to 9 % of the linear weights.
# * SWAG_L1_PERCENTS: the paper's l1 sub-layer ramp p ∈ {1, 12, 24, 36, 48, 60, 100}: percent of the
#   countable parameters with the largest magnitude (``selection.largest_magnitude``).
MODULE_COUNTS = (1, 2, 3, 4, 5, 8, 11, 17, 38)
SKFAC_PERCENTS = tuple(round(float(p), 1) for p in torch.linspace(1, 30, 6, dtype=torch.float64))
SWAG_L1_PERCENTS = (1.0, 12.0, 24.0, 36.0, 48.0, 60.0, 100.0)
# Prior precisions 10^-1, 10^-0.5, ..., 10^3, built in float64 so that records store 0.1, not the float32
# value 0.10000000149011612. Hand it to the Laplace posteriors as :func:`prior_grid` (a float64 tensor):
# ``torch.as_tensor`` of a tuple of floats would round it to float32 again.
PRIOR_GRID = tuple(float(v) for v in torch.logspace(-1, 3, 9, dtype=torch.float64))


def prior_grid() -> torch.Tensor:
    """:data:`PRIOR_GRID` as a float64 tensor (the ``grid`` argument of ``optimize_prior_precision``)."""
    return torch.tensor(PRIOR_GRID, dtype=torch.float64)


@dataclass
class Settings:
    """Method hyperparameters (part of the results configuration).

    Attributes:
        prior: ``val_nll`` (grid search over :data:`PRIOR_GRID` on validation) or ``marglik``.
        n_samples: Monte Carlo samples for SWAG and IVON predictions.
        swag_lrs: SWAG learning rates of the validation sweep.
        swag_sweep_steps: SGD steps per sweep point.
        swag_steps: SGD steps of the final SWAG run.
        module_counts: Module counts of the module-ramping methods.
        skfac_percents: Percentages of the S-KFAC ramping.
        swag_l1_percents: Percentages of the SWAG largest-magnitude (l1) sub-layer ramping.
        linear_sampling: Settings of the sampling-based linearised Laplace methods (``ls-*``).
    """

    prior: str = "val_nll"
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
            raise ValueError(f"prior must be 'val_nll' or 'marglik', got {self.prior!r}")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")

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
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def labels(self, which: str) -> torch.Tensor:
        """(N,) labels of ``"val"`` or ``"test"``."""
        return torch.cat([b["labels"] for b in getattr(self, which)]).cpu()

    def logits(self, which: str) -> torch.Tensor:
        """(N, C) float64 MAP logits of ``"val"`` or ``"test"`` (cached)."""
        if which not in self._cache:
            self._cache[which] = batch_logits(self.model, getattr(self, which))
        return self._cache[which]


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
    """

    probs: torch.Tensor
    floats: int
    n_stochastic: int
    percent_stochastic: float
    fit_seconds: float
    predict_seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One registered method.

    Attributes:
        name: Command-line name.
        description: One line.
        sizes: ``sizes(ctx) -> list of size keys`` (``["-"]`` for single-cell methods).
        run: ``run(ctx, size) -> Prediction``.
        requires: Sibling package the method imports when it runs (for error messages).
    """

    name: str
    description: str
    sizes: Callable[[Context], list[str]]
    run: Callable[[Context, str], Prediction]
    requires: str | None = None


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
def run_map(ctx: Context, size: str) -> Prediction:
    """The fine-tuned network's softmax probabilities."""
    t0 = time.perf_counter()
    probs = torch.softmax(ctx.logits("test"), -1)
    return Prediction(probs, 0, 0, 0.0, 0.0, time.perf_counter() - t0)


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
    return Prediction(probs, 1, 0, 0.0, fit, time.perf_counter() - t0, {"temperature": temp})


# ------------------------------------------------------------------------------------------ Laplace
def laplace_prediction(ctx: Context, subset: Any, kind: str = "kron") -> Prediction:
    """Fit a Laplace posterior of ``kind`` (``kron`` or ``dense``) on ``subset``, tune the prior, predict.

    The prior precision is chosen by validation NLL over :data:`PRIOR_GRID` or by the marginal
    likelihood (``ctx.settings.prior``); predictions use the linearised probit approximation.
    """
    from partialbayes import curvature

    cls = curvature.KronLaplace if kind == "kron" else curvature.DenseLaplace
    t0 = time.perf_counter()
    la = cls(ctx.model, subset, num_classes=ctx.num_labels)
    la.fit(ctx.train)
    if ctx.settings.prior == "val_nll":
        prior = la.optimize_prior_precision("val_nll", val_loader=ctx.val, grid=prior_grid())
    else:
        prior = la.optimize_prior_precision("marglik", grid=prior_grid())
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    probs = []
    for batch in ctx.test:
        mean, cov = la.logit_mean_cov(batch)
        probs.append(probit_probs(mean.double(), cov.double()).cpu())
    predict = time.perf_counter() - t0
    return Prediction(
        torch.cat(probs),
        int(la.num_floats),
        subset.num_entries(),
        float(subset.percent_of(ctx.model)),
        fit,
        predict,
        {"prior_precision": prior, "prior_method": ctx.settings.prior, "modules": _modules(subset)},
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


def run_kfac_full(ctx: Context, size: str) -> Prediction:
    """KFAC Laplace on every linear map."""
    return laplace_prediction(ctx, _module_subset(ctx, "max", "all", _n_linear(ctx, "all")))


def run_skfac(ctx: Context, size: str) -> Prediction:
    """S-KFAC Laplace keeping ``size`` % of the rows and columns of every linear map."""
    from partialbayes.selection import sparse_kfac

    pred = laplace_prediction(ctx, sparse_kfac(ctx.model, float(size)))
    pred.extra["skfac_percent"] = float(size)
    return pred


# ------------------------------------------------------------------------------------------ SWAG
def swag_prediction(ctx: Context, subset: Any) -> Prediction:
    """SWAG on ``subset``: learning rate by validation NLL, then Monte Carlo predictions.

    With a single learning rate in ``settings.swag_lrs`` there is nothing to choose: the sweep (and its
    validation predictive) is skipped and SWAG is collected at that rate directly.
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
            generator=torch.Generator().manual_seed(ctx.seed),
            progress=False,
        )
        lr, swag = result.lr, result.swag
    fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen = torch.Generator(device=swag.mean.device).manual_seed(ctx.seed + 1)
    total = torch.zeros_like(ctx.logits("test"))
    for _ in range(s.n_samples):
        with swag.sampled(ctx.model, generator=gen):
            total += torch.softmax(batch_logits(ctx.model, ctx.test), -1)
    predict = time.perf_counter() - t0
    return Prediction(
        total / s.n_samples,
        int(swag.num_floats),
        subset.num_entries(),
        float(subset.percent_of(ctx.model)),
        fit,
        predict,
        {"swag_lr": lr, "swag_lr_swept": len(s.swag_lrs) > 1, "modules": _modules(subset)},
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

    The posterior is built by the IVON fine-tuning, so ``fit_seconds`` is that fine-tuning's wall-clock
    time (from the checkpoint's meta, also when the checkpoint was reused) plus the few milliseconds of
    turning its Hessian into standard deviations; ``extra`` holds both parts. Note that the ``map`` cell of
    the same results folder (the IVON mean) comes from the same training, at ``fit_seconds`` 0.
    """
    if ctx.ivon is None:
        raise ValueError("method 'ivon' needs a model fine-tuned with --optimizer ivon")
    t0 = time.perf_counter()
    params = dict(ctx.model.named_parameters())
    ess, delta = float(ctx.ivon["ess"]), float(ctx.ivon["weight_decay"])
    hess = {k: v.to(params[k].device) for k, v in ctx.ivon["hess"].items() if k in params}
    std = {k: 1.0 / torch.sqrt(ess * (h + delta)) for k, h in hess.items()}
    setup = time.perf_counter() - t0
    finetune = float(ctx.ivon.get("finetune_seconds", 0.0))
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(ctx.seed + 2)
    total = torch.zeros_like(ctx.logits("test"))
    means = {k: params[k].detach().clone() for k in std}
    try:
        for _ in range(ctx.settings.n_samples):
            with torch.no_grad():
                for k, s in std.items():
                    eps = torch.randn(s.shape, generator=gen, dtype=s.dtype).to(s.device)
                    params[k].copy_(means[k] + s * eps)
            total += torch.softmax(batch_logits(ctx.model, ctx.test), -1)
    finally:
        with torch.no_grad():
            for k, m in means.items():
                params[k].copy_(m)
    n = sum(int(h.numel()) for h in hess.values())
    return Prediction(
        total / ctx.settings.n_samples,
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
            "kfac-full", "KFAC Laplace on every linear map", _single, run_kfac_full, "curvature"
        ),
        Method(
            "skfac",
            "S-KFAC Laplace ramping (percent of rows/cols)",
            _pct_sizes("skfac_percents"),
            run_skfac,
            "curvature",
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
