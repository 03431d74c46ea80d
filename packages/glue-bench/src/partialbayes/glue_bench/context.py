"""What a method of the benchmark receives and returns: its settings, its context, its prediction."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from partialbayes.curvature.internal import FISHERS as CURVATURE_FISHERS
from partialbayes.glue_bench.linearised import LinearSamplingConfig
from partialbayes.glue_bench.store import json_ready
from partialbayes.predictive import nll
from partialbayes.predictive.internal import (
    check_choice,
    check_fields,
    check_int,
    check_number,
    check_type,
    model_logits,
    ranged,
    split_batch,
)
from partialbayes.selection import Subset, modules
from partialbayes.selection.internal import grouped_linear_modules

Batch = dict[str, torch.Tensor]

# The ramps of the paper (sources: docs, "The paper's protocol"): its module counts without 0 (the MAP cell),
# Table 3's S-KFAC percentages without 0 and 100 (the kfac-full cell), and the SWAG l1 sub-layer ramp.
MODULE_COUNTS = (1, 2, 3, 4, 5, 8, 11, 17, 38)
SKFAC_PERCENTS = (1.0, 1.8, 2.5, 3.2, 3.9, 4.6, 5.4, 6.1, 6.8, 12.6, 18.4, 24.2, 30.0, 33.0)
SWAG_L1_PERCENTS = (1.0, 12.0, 24.0, 36.0, 48.0, 60.0, 100.0)
# Prior precisions 10^-1, 10^-0.5, ..., 10^3: the paper's range (Table 6) in half decades, in float64 so
# that records store 0.1, not 0.10000000149011612 (hand it to the posteriors as :func:`prior_grid`).
PRIOR_GRID = tuple(float(v) for v in torch.logspace(-1, 3, 9, dtype=torch.float64))
# Fisher types of the Laplace curvature (the library's records): the paper's KFAC uses the empirical one
# (Eqs. 13-16), its last-layer Laplace the full GGN ("exact").
FISHERS = tuple(CURVATURE_FISHERS)


def prior_grid(values: Sequence[float] = PRIOR_GRID) -> torch.Tensor:
    """A prior-precision grid as a float64 tensor (the ``grid`` argument of ``optimize_prior_precision``)."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def prior_edge(chosen: float, grid: Sequence[float]) -> str | None:
    """``"lowest"`` / ``"highest"`` when ``chosen`` is the smallest / largest value of ``grid``, else ``None``."""
    return "lowest" if chosen == min(grid) else "highest" if chosen == max(grid) else None


def check_numbers(
    name: str,
    values: Any,
    interval: str = "(0, inf)",
    check: Callable = check_number,
    least: int = 1,
) -> tuple[Any, ...]:
    """``least`` or more distinct numbers in ``interval`` (each through ``check``), or an error naming ``name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {values!r}")
    out = tuple(check(name, v, interval) for v in values)
    if len(out) < least:
        raise ValueError(
            f"{name} needs at least {least} values, got {out}" if out else f"{name} is empty"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has repeated values: {list(values)}")
    return out


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
    n_samples: int = ranged(50, "[1, inf)", int)
    swag_lrs: tuple[float, ...] = (1e-3, 1e-2, 5e-2, 1e-1)
    swag_sweep_steps: int = ranged(400, "[1, inf)", int)
    swag_steps: int = ranged(2000, "[1, inf)", int)
    module_counts: tuple[int, ...] = MODULE_COUNTS
    skfac_percents: tuple[float, ...] = SKFAC_PERCENTS
    swag_l1_percents: tuple[float, ...] = SWAG_L1_PERCENTS
    linear_sampling: LinearSamplingConfig = field(default_factory=LinearSamplingConfig)

    def __post_init__(self) -> None:
        check_choice("Settings.prior", self.prior, ("val_nll", "marglik"))
        check_choice("Settings.fisher", self.fisher, FISHERS)
        check_choice("Settings.last_layer_fisher", self.last_layer_fisher, FISHERS)
        check_fields(self)
        for key in ("prior_grid", "swag_lrs", "skfac_percents", "swag_l1_percents"):
            interval = "(0, 100]" if key.endswith("percents") else "(0, inf)"
            least = 2 if key == "prior_grid" else 1  # a grid search needs a choice
            value = check_numbers(f"Settings.{key}", getattr(self, key), interval, least=least)
            setattr(self, key, value)
        counts = self.module_counts
        self.module_counts = check_numbers("Settings.module_counts", counts, "[1, inf)", check_int)
        check_type("Settings.linear_sampling", self.linear_sampling, LinearSamplingConfig)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        return json_ready(self)


@dataclass
class Context:
    """Everything a method needs about one fine-tuned (task, split).

    ``model`` is the fine-tuned classifier at its MAP weights (eval mode); ``train``, ``val`` and ``test``
    are dict batches (with ``labels``) on ``device``; random choices and sampling derive from ``seed``;
    ``progress`` shows bars in the long stages; ``ivon`` is ``{"hess": {name: tensor}, "ess",
    "weight_decay", "finetune_seconds"}`` when fine-tuned with IVON.
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
    progress: bool = False
    _cache: dict[str, torch.Tensor] = field(default_factory=dict)

    def bar(self, items: Sequence[Any], stage: str) -> Iterable[Any]:
        """``items`` under a progress bar named ``stage`` when ``progress`` is on (long stages say where they are)."""
        return tqdm(items, desc=stage, disable=not self.progress, leave=False)

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


@dataclass(kw_only=True)
class Prediction:
    """A method's output on the test set (keyword arguments only; the counts and times default to 0).

    ``probs``: (N, C) float64 predictive probabilities; ``floats``: what the posterior stores beyond the
    MAP; ``percent_stochastic``: of the countable parameters; ``fit_seconds`` includes hyperparameter
    search; ``extra``: method-specific facts; ``val_nll``: of the method's predictive (chooses a ramp's
    level, the paper's §5.4); ``curvature_pass``: Laplace cells' ``"per-cell"`` or ``"shared"``.
    """

    probs: torch.Tensor
    floats: int = 0
    n_stochastic: int = 0
    percent_stochastic: float = 0.0
    fit_seconds: float = 0.0
    predict_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    val_nll: float | None = None
    curvature_pass: str | None = None


@dataclass(frozen=True)
class KronCell:
    """A KFAC-type Laplace cell: its Kronecker-structured subset and S-KFAC level (``None``: whole maps)."""

    subset: Subset
    skfac_percent: float | None = None


# Offsets of the run's generators (``Context.generator``): one stream per kind of random draw.
SWAG_SWEEP_OFFSET, SWAG_SAMPLES_OFFSET, IVON_SAMPLES_OFFSET, MC_FISHER_OFFSET, LS_OFFSET = range(
    1, 6
)


@torch.no_grad()
def batch_logits(
    model: nn.Module, batches: Sequence[Batch], device: torch.device | str | None = None
) -> torch.Tensor:
    """(N, C) float64 logits of ``model`` over dict batches (labels ignored; moved to ``device``), on cpu."""
    parts = [model_logits(model, split_batch(b, device=device).inputs) for b in batches]
    return torch.cat([z.double().cpu() for z in parts])


def val_nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of ``labels`` (N,) under ``probs`` (N, C), in float64."""
    return float(nll(probs.double(), labels))


def modules_of(subset: Subset) -> list[str]:
    """Sorted names of the modules a subset touches."""
    return sorted({n.rsplit(".", 1)[0] for n in subset.names})


def every_linear_map(model: nn.Module) -> Subset:
    """Every candidate linear map of ``model``, weights and biases: the subset of the ``*-full`` methods."""
    return modules(model, list(grouped_linear_modules(model, "all")))
