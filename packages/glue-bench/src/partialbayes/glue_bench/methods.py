"""The posterior methods of the benchmark: a registry of plain functions ``run(ctx, size) -> Prediction``.

Every method turns the MAP classifier of one (task, split) into test probabilities; ramps have several sizes
(module counts or percentages), the others the size ``"-"``. Inputs and outputs (:class:`Context`,
:class:`Prediction`, :class:`Settings`) live in :mod:`~partialbayes.glue_bench.context`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from partialbayes import selection
from partialbayes.curvature import DenseLaplace
from partialbayes.glue_bench.context import (
    IVON_SAMPLES_OFFSET,
    LS_OFFSET,
    SWAG_SAMPLES_OFFSET,
    SWAG_SWEEP_OFFSET,
    Context,
    KronCell,
    Prediction,
    batch_logits,
    every_linear_map,
    modules_of,
    val_nll,
)
from partialbayes.glue_bench.laplace_cells import kron_prediction, laplace_prediction
from partialbayes.glue_bench.linearised import fit_linearised, linearised_probs
from partialbayes.ivon import GaussianPosterior
from partialbayes.predictive import Posterior, fit_temperature
from partialbayes.predictive.internal import check_choice, check_known, eval_mode
from partialbayes.selection import Subset
from partialbayes.selection.internal import countable_named_parameters, grouped_linear_modules
from partialbayes.sgmcmc import parallel_chains, run_chain
from partialbayes.swag import collect_swag, sweep_learning_rate


@dataclass(frozen=True)
class Method:
    """One registered method: ``sizes(ctx) -> size keys`` (``["-"]``: one cell), ``run(ctx, size)``.

    KFAC-type Laplace methods also give ``kron(ctx, size) -> KronCell``, so that a ramp shares one
    curvature pass (:mod:`~partialbayes.glue_bench.laplace_cells`).
    """

    name: str
    description: str
    sizes: Callable[[Context], list[str]]
    run: Callable[[Context, str], Prediction]
    kron: Callable[[Context, str], KronCell] | None = None


def _one(_: Context) -> list[str]:
    return ["-"]


# ------------------------------------------------------------------------------------------ MAP, TS
def run_map(ctx: Context, size: str) -> Prediction:
    """The fine-tuned network's softmax probabilities."""
    t0 = time.perf_counter()
    probs = torch.softmax(ctx.logits("test"), -1)
    val = val_nll(torch.softmax(ctx.logits("val"), -1), ctx.labels("val"))
    return Prediction(probs=probs, predict_seconds=time.perf_counter() - t0, val_nll=val)


def temperature_or_grid(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """``predictive.fit_temperature`` of (N, C) validation ``logits``, or the best grid temperature.

    When the validation NLL has no finite optimum, the best T of ``logspace(-2, 2, 81)`` is taken with a
    warning, so one degenerate cell does not stop a grid.
    """
    try:
        return float(fit_temperature(logits.double(), labels))
    except ValueError as err:
        grid, z = torch.logspace(-2, 2, 81, dtype=torch.float64), logits.double()
        losses = torch.stack([torch.nn.functional.cross_entropy(z / t, labels) for t in grid])
        best = float(grid[int(losses.argmin())])
        warnings.warn(
            f"{err}; using the best grid temperature T={best:g} in [0.01, 100]", stacklevel=2
        )
        return best


def run_temperature(ctx: Context, size: str) -> Prediction:
    """Temperature scaling fitted on the validation set."""
    t0 = time.perf_counter()
    temp = temperature_or_grid(ctx.logits("val"), ctx.labels("val"))
    fit, t0 = time.perf_counter() - t0, time.perf_counter()
    probs = torch.softmax(ctx.logits("test") / temp, -1)
    val = val_nll(torch.softmax(ctx.logits("val") / temp, -1), ctx.labels("val"))
    took = {"fit_seconds": fit, "predict_seconds": time.perf_counter() - t0}
    return Prediction(probs=probs, floats=1, **took, extra={"temperature": temp}, val_nll=val)


# ------------------------------------------------------------------------------------------ subsets
def _count_sizes(group: str) -> Callable[[Context], list[str]]:
    def sizes(ctx: Context) -> list[str]:
        n = len(grouped_linear_modules(ctx.model, group))
        return [str(k) for k in ctx.settings.module_counts if k <= n]

    return sizes


#: The module strategies by name: ``(ctx, k, group) -> Subset``.
_MODULE_CHOICES = {
    "random": lambda ctx, k, g: selection.random_modules(ctx.model, k, seed=ctx.seed, group=g),
    "max": lambda ctx, k, g: selection.max_operator_norm(ctx.model, k, group=g),
    "min": lambda ctx, k, g: selection.min_operator_norm(ctx.model, k, group=g),
}


def module_subset(ctx: Context, strategy: str, group: str, k: int) -> Subset:
    """``k`` linear maps of ``group`` chosen by ``strategy`` (``random``, ``max`` or ``min`` operator norm)."""
    return _MODULE_CHOICES[check_choice("strategy", strategy, _MODULE_CHOICES)](ctx, k, group)


# ------------------------------------------------------------------------------------------ Laplace
def run_last_layer(ctx: Context, size: str) -> Prediction:
    """Dense-GGN Laplace on the classification head (``settings.last_layer_fisher``)."""
    subset, fisher = selection.last_layer(ctx.model), ctx.settings.last_layer_fisher
    la = DenseLaplace(ctx.model, subset, num_classes=ctx.num_labels, fisher=fisher)
    return laplace_prediction(ctx, la)


def kron_full(ctx: Context, size: str) -> KronCell:
    """The subset of ``kfac-full``: every linear map."""
    return KronCell(every_linear_map(ctx.model))


def kron_skfac(ctx: Context, size: str) -> KronCell:
    """The subset of an ``skfac`` cell: ``size`` % of the rows and columns of every linear map."""
    return KronCell(selection.sparse_kfac(ctx.model, float(size)), float(size))


def kron_method(name: str, description: str, sizes: Callable, kron: Callable) -> Method:
    """A KFAC-type Laplace method: its cells' subsets (``kron(ctx, size)``), each cell on its own by ``run``."""
    return Method(name, description, sizes, lambda c, size: kron_prediction(c, kron(c, size)), kron)


# ------------------------------------------------------------------------------------------ SWAG
def _mc_probs(ctx: Context, posterior: Posterior, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(test probs [N_test, C], validation probs [N_val, C])`` of ``settings.n_samples`` weight samples."""
    gen = ctx.generator(offset)
    test, val = torch.zeros_like(ctx.logits("test")), torch.zeros_like(ctx.logits("val"))
    for _ in range(ctx.settings.n_samples):
        with posterior.sampled(generator=gen):
            test += torch.softmax(batch_logits(ctx.model, ctx.test), -1)
            val += torch.softmax(batch_logits(ctx.model, ctx.val), -1)
    return test / ctx.settings.n_samples, val / ctx.settings.n_samples


def swag_prediction(ctx: Context, subset: Subset) -> Prediction:
    """SWAG on ``subset``: learning rate by validation NLL (no sweep for one rate), then MC predictions.

    The SGD steps' dropout draws come from the global generator, which ``experiment.run_cell`` seeds.
    """
    s, t0 = ctx.settings, time.perf_counter()
    if len(s.swag_lrs) == 1:
        lr = float(s.swag_lrs[0])
        options = {"lr": lr, "n_steps": s.swag_steps, "progress": False}
        swag = collect_swag(ctx.model, subset, ctx.train, **options)
    else:
        sweep = {"sweep_steps": s.swag_sweep_steps, "final_steps": s.swag_steps, "progress": False}
        sweep.update(n_samples=min(s.n_samples, 20), generator=ctx.generator(SWAG_SWEEP_OFFSET))
        result = sweep_learning_rate(ctx.model, subset, ctx.train, ctx.val, lrs=s.swag_lrs, **sweep)
        lr, swag = result.lr, result.swag
    extra = {"swag_lr": lr, "swag_lr_swept": len(s.swag_lrs) > 1}
    return _sampled_prediction(ctx, subset, swag, time.perf_counter() - t0, extra)


def _sampled_prediction(
    ctx: Context, subset: Subset, post: Posterior, fit: float, extra: dict[str, object]
) -> Prediction:
    """The :class:`Prediction` of a sample-based posterior on ``subset`` (its MC test / validation probs)."""
    t0 = time.perf_counter()
    test, val = _mc_probs(ctx, post, SWAG_SAMPLES_OFFSET)
    took = {"fit_seconds": fit, "predict_seconds": time.perf_counter() - t0}
    extra = {**extra, "modules": modules_of(subset)}
    return _subset_prediction(ctx, subset, test, val, int(post.num_floats), took, extra)


def _subset_prediction(
    ctx: Context,
    subset: Subset,
    test: torch.Tensor,
    val: torch.Tensor,
    floats: int,
    took: dict,
    extra: dict,
) -> Prediction:
    """The :class:`Prediction` of a posterior on ``subset`` from its test and validation probabilities."""
    return Prediction(
        probs=test,
        floats=floats,
        n_stochastic=subset.num_entries(),
        percent_stochastic=float(subset.percent_of(ctx.model)),
        **took,
        extra=extra,
        val_nll=val_nll(val, ctx.labels("val")),
    )


def run_swag_l1(ctx: Context, size: str) -> Prediction:
    """SWAG on the ``size`` % largest-magnitude (l1) parameters."""
    pred = swag_prediction(ctx, selection.largest_magnitude(ctx.model, float(size)))
    pred.extra["l1_percent"] = float(size)
    return pred


def run_swag_full(ctx: Context, size: str) -> Prediction:
    """SWAG on every linear map."""
    return swag_prediction(ctx, every_linear_map(ctx.model))


# ------------------------------------------------------------------------------------------ SGHMC
#: SGHMC (``partialbayes.sgmcmc``) at T = 1: SGD's learning rate and momentum, the likelihood scaled by the
#: training set's size. Not ``Settings`` fields, so the results' fingerprint stays that of earlier runs.
SGHMC_LR, SGHMC_MOMENTUM, SGHMC_CHAINS, SGHMC_SEED_OFFSET = 1e-2, 0.9, 4, 6


def sghmc_prediction(ctx: Context, subset: Subset, *, parallel: bool) -> Prediction:
    """SGHMC on ``subset`` from the MAP (eval mode), Monte Carlo predictions over the kept states.

    Serial: one chain of ``settings.swag_steps`` steps, the second half thinned to about
    ``settings.n_samples`` states. Parallel (the Bayesian deep ensemble of Duffield et al.): ``SGHMC_CHAINS``
    chains of ``swag_steps // 2`` steps each, each with its own noise seed and a rotated batch order, the
    last state of each. The model's weights are restored afterwards.
    """
    s, steps, k = ctx.settings, ctx.settings.swag_steps, len(ctx.train)
    n_train = sum(len(b["labels"]) for b in ctx.train)
    seed = ctx.seed * 1000 + SGHMC_SEED_OFFSET
    options = dict(lr=SGHMC_LR, momentum=SGHMC_MOMENTUM, num_data=n_train, method="sghmc")
    t0 = time.perf_counter()
    with eval_mode(ctx.model):
        if parallel:

            def rotated(c: int) -> list:
                return ctx.train[c * k // SGHMC_CHAINS :] + ctx.train[: c * k // SGHMC_CHAINS]

            options.update(n_chains=SGHMC_CHAINS, n_steps=max(1, steps // 2), seed=seed)
            post = parallel_chains(ctx.model, subset, rotated, **options)
        else:
            thin = max(1, (steps - steps // 2) // s.n_samples)
            chain = run_chain(ctx.model, subset, ctx.train, n_steps=steps, seed=seed,
                              burn_in=steps // 2, thin=thin, **options)  # fmt: skip
            post = chain.posterior()
    extra = {"sghmc_lr": SGHMC_LR, "sghmc_states": post.num_samples}
    return _sampled_prediction(ctx, subset, post, time.perf_counter() - t0, extra)


def _sghmc_method(name: str, about: str, sizes: Callable[[Context], list[str]], parallel: bool,
                  cell: Callable[[Context, str], KronCell]) -> Method:  # fmt: skip
    return Method(
        name, about, sizes, lambda c, z: sghmc_prediction(c, cell(c, z).subset, parallel=parallel)
    )


# ------------------------------------------------------------------------------------------ IVON
def run_ivon(ctx: Context, size: str) -> Prediction:
    """IVON's mean-field posterior N(m, 1/(ess·(h+δ))) from IVON fine-tuning, Monte Carlo predictions.

    Only the countable parameters are stochastic (never the embeddings, also when an old checkpoint's
    Hessians cover them). ``fit_seconds`` is the IVON fine-tuning's wall-clock time plus the posterior's
    set-up (both in ``extra``); the ``map`` cell of the folder (the IVON mean) is the same training.
    """
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
    means = {k: params[k].detach().clone() for k in std}
    posterior = GaussianPosterior(means, std, ctx.model)
    setup = time.perf_counter() - t0
    finetune, t0 = float(ctx.ivon.get("finetune_seconds", 0.0)), time.perf_counter()
    test, val = _mc_probs(ctx, posterior, IVON_SAMPLES_OFFSET)
    n = sum(int(h.numel()) for h in hess.values())
    note = "IVON fine-tuning (the posterior is its by-product) plus setup"
    extra = {"finetune_seconds": finetune, "posterior_setup_seconds": setup}
    extra["fit_seconds_note"] = note
    return Prediction(
        probs=test,
        floats=n,
        n_stochastic=n,
        percent_stochastic=100.0 * n / max(selection.countable_parameters(ctx.model), 1),
        fit_seconds=finetune + setup,
        predict_seconds=time.perf_counter() - t0,
        extra=extra,
        val_nll=val_nll(val, ctx.labels("val")),
    )


# ------------------------------------------------------------------------------------------ linear sampling
def linear_sampling_prediction(ctx: Context, subset: Subset) -> Prediction:
    """Sampling-based linearised Laplace on ``subset``: ``floats`` counts the ``d·K`` samples and ``α``."""
    config, t0 = ctx.settings.linear_sampling, time.perf_counter()
    post = fit_linearised(ctx.model, ctx.train, subset, config, ctx.generator(LS_OFFSET))
    fit, t0 = time.perf_counter() - t0, time.perf_counter()
    probs = linearised_probs(ctx.model, ctx.test, subset, post.samples, config.dense_max_floats)
    took = {"fit_seconds": fit, "predict_seconds": time.perf_counter() - t0}
    val = linearised_probs(ctx.model, ctx.val, subset, post.samples, config.dense_max_floats)
    extra = {"prior_precision": post.alpha, "prior_method": "em", "em_converged": post.converged}
    extra.update(cg_converged=post.cg_converged, em_history=post.history)
    extra["modules"] = modules_of(subset)
    floats = int(post.samples.shape[0]) * int(post.samples.shape[1]) + 1
    return _subset_prediction(ctx, subset, probs, val, floats, took, extra)


#: The subsets of the ``ls-*`` and SGHMC methods by key: ``(ctx, size) -> KronCell``.
_CELLS: dict[str, Callable[[Context, str], KronCell]] = {
    "last-layer": lambda c, size: KronCell(selection.last_layer(c.model)),
    "skfac": kron_skfac,
    "random": lambda c, size: KronCell(module_subset(c, "random", "all", int(size))),
    "full": kron_full,
}


def _ls_run(cell: Callable[[Context, str], KronCell]) -> Callable[[Context, str], Prediction]:
    """Linear sampling on the subset of ``cell(ctx, size)``, its S-KFAC level recorded."""

    def run(ctx: Context, size: str) -> Prediction:
        kron = cell(ctx, size)
        pred = linear_sampling_prediction(ctx, kron.subset)
        if kron.skfac_percent is not None:
            pred.extra["skfac_percent"] = kron.skfac_percent
        return pred

    return run


# ------------------------------------------------------------------------------------------ module ramps
# The module-ramping strategies of the paper (Figs. 2-4), each ramped over ``Settings.module_counts``; every
# family selects its modules with :func:`module_subset`, so kfac-max-mlp and swag-max-mlp use the same maps.
MODULE_STRATEGIES = (
    ("random", "all"),
    ("max", "mlp"),
    ("min", "mlp"),
    ("max", "attention"),
    ("min", "attention"),
)
# family -> the posterior in words
RAMP_FAMILIES = {"kfac": "KFAC Laplace", "swag": "SWAG"}


def _ramp_name(family: str, strategy: str, group: str) -> str:
    """``kfac-random``, ``kfac-max-mlp``, ``swag-min-attn``, ..."""
    if group == "all":
        return f"{family}-{strategy}"
    return f"{family}-{strategy}-{'attn' if group == 'attention' else group}"


def _module_ramp(family: str, strategy: str, group: str, about: str) -> Method:
    """The ``family`` ramp (``kfac`` or ``swag``) of ``strategy`` on ``group``'s linear maps."""
    name, sizes = _ramp_name(family, strategy, group), _count_sizes(group)

    def subset(ctx: Context, size: str) -> Subset:
        return module_subset(ctx, strategy, group, int(size))

    if family == "kfac":
        return kron_method(name, about, sizes, lambda ctx, size: KronCell(subset(ctx, size)))
    return Method(name, about, sizes, lambda ctx, size: swag_prediction(ctx, subset(ctx, size)))


# ------------------------------------------------------------------------------------------ registry
def _pct_sizes(attr: str) -> Callable[[Context], list[str]]:
    return lambda ctx: [f"{p:g}" for p in getattr(ctx.settings, attr)]


def _registry() -> dict[str, Method]:
    skfac, l1 = _pct_sizes("skfac_percents"), _pct_sizes("swag_l1_percents")
    ls = "sampling-based linearised Laplace"
    methods = [
        Method("map", "the fine-tuned network (MAP)", _one, run_map),
        Method("temperature", "temperature scaling on validation NLL", _one, run_temperature),
        Method("last-layer", "Laplace, dense GGN on the classification head", _one, run_last_layer),
        kron_method("kfac-full", "KFAC Laplace on every linear map", _one, kron_full),
        kron_method("skfac", "S-KFAC Laplace ramping (percent of rows/cols)", skfac, kron_skfac),
        Method("swag-l1", "SWAG on the p % largest-magnitude weights", l1, run_swag_l1),
        Method("swag-full", "SWAG on every linear map", _one, run_swag_full),
        Method("ivon", "IVON posterior (needs --optimizer ivon)", _one, run_ivon),
    ]
    on = {"skfac": "the S-KFAC subsets (percent of rows/cols)", "full": "every linear map"}
    on.update({"last-layer": "the classification head", "random": "k random linear maps"})
    sizes = {"skfac": skfac, "full": _one, "last-layer": _one, "random": _count_sizes("all")}
    for prefix, kind in (("sghmc", "serial"), ("psghmc", "parallel")):
        for k in ("skfac", "full"):
            about, parallel = f"{kind} SGHMC (T=1) on {on[k]}", prefix == "psghmc"
            methods.append(_sghmc_method(f"{prefix}-{k}", about, sizes[k], parallel, _CELLS[k]))
    for k in ("last-layer", "skfac", "random", "full"):
        em = " (EM prior)" if k == "last-layer" else ""
        about = f"{ls}{em} on {on[k]}"
        methods.append(Method(f"ls-{k}", about, sizes[k], _ls_run(_CELLS[k])))
    for family, posterior in RAMP_FAMILIES.items():
        for strategy, group in MODULE_STRATEGIES:
            label = "random" if strategy == "random" else f"{strategy} operator norm"
            about = f"{posterior} on k linear maps ({label}, {group})"
            methods.append(_module_ramp(family, strategy, group, about))
    return {m.name: m for m in methods}


METHODS: dict[str, Method] = _registry()


def get_methods(names: Sequence[str]) -> list[Method]:
    """Look up methods by name; raises ``ValueError`` listing the valid names."""
    check_known("method(s)", names, METHODS, "valid methods")
    return [METHODS[n] for n in names]
