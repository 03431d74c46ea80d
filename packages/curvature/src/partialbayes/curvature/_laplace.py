"""`LaplaceBase`: fitting, evidence, samples, the linearised predictive and files, once for every structure."""

from __future__ import annotations

import copy
import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import Run, all_reduce
from partialbayes.curvature._likelihood import (
    CurvatureOptions,
    Outputs,
    read_batch,
    resolve_shift_labels,
    take_examples,
)
from partialbayes.curvature._memory import MemoryEstimate, batch_estimate, sized
from partialbayes.curvature._prior import (
    MarglikFit,
    PriorSpec,
    evidence_ascent,
    grid_search,
    grid_val_nlls,
)
from partialbayes.predictive import laplace_bridge
from partialbayes.predictive.internal import (
    PosteriorFile,
    answer_only,
    batch_size,
    check_choice,
    check_finite,
    check_generator,
    check_int,
    check_keys,
    check_number,
    check_target_ids,
    check_type,
    gaussian_draws,
    gaussian_mc,
    probit_kernel,
    read_posterior_file,
    resolve_link,
    write_posterior_file,
)
from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset

_Posterior = TypeVar("_Posterior", bound="LaplaceBase")

#: The file format (``partialbayes.curvature.<class name>``) and its version.
FORMAT = "partialbayes.curvature.{}"
VERSION = 2
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model_class": str,
    "subset": str,
    "modules": list,
    "dtype": str,
    "options": dict,
    "n_data": int,
    "n_outputs": int,
    "map_loss": (int, float),
    "sigma_fit": (int, float),
}


@dataclass
class MapLoss:
    """Training loss at the MAP from the curvature pass's output rows (``on_batch``): summed CE or SSE, float64."""

    likelihood: str
    n_data: int = 0
    n_outputs: int = 0
    total: Tensor | float = 0.0  # a float64 tensor on the batches' device once a batch is added

    def __call__(self, index: int, logits: Tensor, labels: Tensor | None) -> None:
        """Add one batch: output rows ``logits [N, C]`` and their checked labels (refused: none)."""
        if labels is None:
            raise ValueError(
                f"batch {index}: fit needs labels (the training log-likelihood at the MAP enters the "
                "marginal likelihood); the batch has none"
            )
        f = logits.detach().double()
        if self.likelihood == "classification":
            loss = nn.functional.cross_entropy(f, labels, reduction="sum")
        else:
            loss = ((f - labels.double()) ** 2).sum()
        self.total = loss + self.total
        self.n_data += int(f.shape[0])
        self.n_outputs = int(f.shape[1])

    def result(self, device: torch.device) -> tuple[float, int, int]:
        """``(loss, n_examples, n_outputs)`` summed over ranks (the same on every rank: they fail together)."""
        n_data = torch.tensor(float(self.n_data), dtype=torch.float64, device=device)
        total = torch.as_tensor(self.total, dtype=torch.float64, device=device)
        sums = all_reduce(torch.stack([total, n_data]))
        # the max of C and of -C: equal on every rank iff the ranks agree
        outs = all_reduce(torch.tensor([self.n_outputs, -self.n_outputs], device=device), "max")
        if int(outs[0]) != -int(outs[1]):
            raise ValueError(
                f"ranks disagree on the number of model outputs: between {-int(outs[1])} and "
                f"{int(outs[0])}"
            )
        return float(sums[0]), round(float(sums[1])), int(outs[0])


def _place(full: Tensor, keep: Tensor | None, rows: Tensor) -> Tensor:
    """``rows [..., N, C]`` at the kept positions of ``full [..., B, T, C]`` (``rows`` itself for ``keep=None``)."""
    if keep is None:
        return rows
    out = full.clone()
    out[..., keep, :] = rows
    return out


def prior_vector(
    spec: PriorSpec, modules: Sequence[str], *, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``[len(modules)]`` prior precisions from a scalar, a ``[M]`` tensor or ``{module: δ}``."""
    n = len(modules)
    if isinstance(spec, Mapping):  # every module, named once
        check_keys(f"prior_precision (modules {list(modules)})", spec, modules, modules, "modules")
        vec = torch.stack(
            [torch.as_tensor(spec[m], dtype=dtype, device=device).reshape(()) for m in modules]
        )
    elif isinstance(spec, Tensor):
        vec = spec.to(dtype=dtype, device=device)
        if vec.ndim == 0:
            vec = vec.expand(n)
        elif vec.shape != (n,):
            raise ValueError(
                f"prior_precision tensor must be a scalar or have shape ({n},) (one per module), got {tuple(vec.shape)}"
            )
    elif isinstance(spec, (float, int)) and not isinstance(spec, bool):
        vec = torch.full((n,), float(spec), dtype=dtype, device=device)
    else:
        raise TypeError(
            f"prior_precision must be a float, a tensor or a dict module -> float, got {type(spec).__name__}"
        )
    with torch.no_grad():
        bad = ~torch.isfinite(vec) | (vec <= 0)
        if bad.any():
            where = [modules[i] for i in torch.nonzero(bad).flatten().tolist()]
            raise ValueError(
                f"prior_precision must be positive and finite; got {vec.detach().cpu().tolist()} "
                f"(bad for modules {where})"
            )
    return vec


class LaplaceBase(ABC):
    """A Laplace posterior over a `Subset`: what `KronLaplace`, `DiagLaplace` and `DenseLaplace` share.

    Not used directly: build one of the three (each implements ``partialbayes.predictive.Posterior``).

    Batches, everywhere: a tensor ``x``, a pair ``(inputs, labels)``, or any mapping of keyword inputs
    (``dict``, the ``BatchEncoding`` of ``DataCollatorWithPadding``) with labels under ``"labels"`` or
    ``"label"``. Logits ``[B, C]`` give one output per example, token-level logits ``[B, T, C]`` one per
    position. Where labels are used (the curvature, the training loss, ``n_data``, validation scores,
    ``logit_mean_cov``) an output labelled -100 or at padding is skipped, and a batch left without a labelled
    output is skipped with one warning; ``predict`` and ``predictive_samples`` predict every real position.

    Args:
        model: The fine-tuned model (its current weights are the MAP).
        subset: Which entries get a posterior; the rest stay at their MAP values.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian, ``sigma_noise``).
        prior_precision: ``δ > 0``: a scalar, a tensor with one value per module, or ``{module: δ}``.
        temperature: ``T > 0``; the posterior precision is ``H / T + δ``.
        sigma_noise: Observation noise of the regression likelihood.
        fisher: ``"exact"`` (GGN), ``"mc"`` or ``"empirical"``; passed to the curvature routine.
        mc_samples: Sampled labels per example for ``fisher="mc"`` (seeded by ``fit(..., generator=...)``).
        num_classes: Expected number of logits (checked during `fit`); ``None`` to skip the check.
        dtype: dtype of the stored curvature: ``torch.float64`` (default) or ``torch.float32``.
        shift_labels: Causal-LM outputs: the output at ``t`` is scored against ``labels[t + 1]``. ``None``
            (default): whether the model's class name ends with ``ForCausalLM`` or ``LMHeadModel``. Saved.
        max_memory: Bytes a fit (checked at its first batch) or a predictive (after its forward pass) may
            allocate, else a ``ValueError`` with the estimate and what to change, before anything large is
            allocated; ``None``: the available memory. Not saved.

    Raises:
        TypeError: A model that is not an ``nn.Module``, a subset that is not a ``Subset``, a dtype other
            than float32 / float64.
        ValueError: A bad setting (named); an empty subset; a subset parameter missing from the model, of
            another shape, or on the ``meta`` device.
    """

    #: Links `predict` accepts: the linearised probit (default), Monte Carlo, and the Laplace bridge.
    links: ClassVar[tuple[str, ...]] = ("probit", "mc", "bridge")
    #: Constructor keywords of the structure that `save` stores (read back as attributes).
    _SAVED: ClassVar[tuple[str, ...]] = ()

    _options: CurvatureOptions  # the checked settings, built once by the constructor
    #: Prior groups (modules), in the order of `prior_precision`.
    modules: tuple[str, ...]
    device: torch.device
    n_data: int
    #: Examples seen over every episode (`fit` with ``previous=``): ``n_data`` plus the previous posterior's.
    n_seen: int = 0
    _previous: LaplaceBase | None = None  # the previous episode's posterior (its curvature is P₀'s)
    _prior_mean: dict[str, Tensor] | None = None  # its MAP: the prior mean of this episode
    n_outputs: int
    map_loss: float

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        *,
        likelihood: str = "classification",
        prior_precision: PriorSpec = 1.0,
        temperature: float = 1.0,
        sigma_noise: float = 1.0,
        fisher: str = "exact",
        mc_samples: int = 1,
        num_classes: int | None = None,
        dtype: torch.dtype = torch.float64,
        shift_labels: bool | None = None,
        max_memory: int | None = None,
    ) -> None:
        check_subset(subset, empty_ok=False)
        params = subset.parameters_of(model)
        self.model, self.subset = model, subset
        self._options = CurvatureOptions(
            likelihood=likelihood,
            fisher=fisher,
            mc_samples=mc_samples,
            sigma_noise=sigma_noise,
            dtype=dtype,
            num_classes=num_classes,
            shift_labels=resolve_shift_labels(model, shift_labels),
        )
        check_number("temperature", float(temperature))
        self.temperature = float(temperature)
        self.max_memory = None if max_memory is None else check_int("max_memory", max_memory)
        self.device = next(iter(params.values())).device
        groups = self._groups()
        self.modules = tuple(dict.fromkeys(groups.values()))
        self._param_module = {n: self.modules.index(groups[n]) for n in params}
        self._prior = prior_vector(prior_precision, self.modules, dtype=dtype, device=self.device)
        self._map: dict[str, Tensor] = {}
        self._fitted = False
        self.n_data, self.n_outputs, self.map_loss = 0, 0, 0.0
        self._sigma_fit = self._options.sigma_noise

    # ------------------------------------------------------------------ settings
    @property
    def likelihood(self) -> str:
        """``"classification"`` or ``"regression"``."""
        return self._options.likelihood

    @property
    def fisher(self) -> str:
        """``"exact"``, ``"mc"`` or ``"empirical"``."""
        return self._options.fisher

    @property
    def mc_samples(self) -> int:
        """Sampled labels per output for ``fisher="mc"``."""
        return self._options.mc_samples

    @property
    def num_classes(self) -> int | None:
        """The number of logits the model must output (checked by `fit`), or ``None``."""
        return self._options.num_classes

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored curvature and of the predictive's computations."""
        return self._options.dtype

    @property
    def shift_labels(self) -> bool:
        """Whether token-level outputs follow the causal-LM convention (output ``t`` scored on token ``t + 1``)."""
        return self._options.shift_labels

    @property
    def sigma_noise(self) -> float:
        """Observation noise ``σ`` of the regression likelihood (the curvature is rescaled by ``σ_fit² / σ²``)."""
        return self._options.sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: float) -> None:
        self._options = replace(self._options, sigma_noise=value)

    @property
    def prior_precision(self) -> Tensor:
        """Prior precision per module, shape ``[len(modules)]``."""
        return self._prior

    @prior_precision.setter
    def prior_precision(self, value: PriorSpec) -> None:
        self._prior = prior_vector(value, self.modules, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ structure
    def _groups(self) -> dict[str, str]:
        """Structure: ``{param name: module}``, the prior group of every parameter (default: its owner)."""
        return {n: n.rpartition(".")[0] for n in self.subset.names}

    @abstractmethod
    def _compute_curvature(self, loader: Iterable[Any], run: Run) -> Any:
        """Structure: the matching curvature routine's pass over ``loader`` (``self._options``, ``run``)."""

    @abstractmethod
    def _set_curvature(self, curvature: Any) -> None:
        """Structure: check a curvature routine's result against the subset and store its representation."""

    @abstractmethod
    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        """Structure: ``log det P`` for a prior vector and a curvature scale (differentiable in both)."""

    @abstractmethod
    def _sample(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        """Structure: ``n`` zero-mean draws ``N(0, P⁻¹)``, ``{param name: [n, k]}``."""

    @abstractmethod
    def _covariances(
        self,
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Tensor],
        scale: Tensor | float,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """Structure: ``(logits [B, (T,) C] detached, keep [B, T] | None, [Σ_f [N, C, C] per prior])`` (eval mode)."""

    #: `_estimate`'s default: the curvature is ``num_entries`` floats, or its square when dense.
    _dense_curvature = False

    def _estimate(
        self, logits: Tensor, keep: Tensor | None, mask: Tensor | None, k_out: int
    ) -> MemoryEstimate:
        """Structure: the memory of a fit, and of a predictive of ``k_out`` logits, for a batch's logits."""
        n, dense = self.subset.num_entries(), self._dense_curvature
        return batch_estimate(logits, keep, mask, self._options, k_out, entries=(n, dense))

    @classmethod
    def _covariances_of(
        cls,
        posteriors: Sequence[LaplaceBase],
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Sequence[Tensor]],
    ) -> tuple[Tensor, Tensor | None, list[list[Tensor]]]:
        """`_covariances` of posteriors of one model on one batch, each its own passes (`KronLaplace` shares)."""
        pairs = zip(posteriors, priors, strict=True)
        out = [p._covariances(inputs, outputs, pr, p._scale(None)) for p, pr in pairs]
        return out[0][0], out[0][1], [covs for _, _, covs in out]

    @abstractmethod
    def _state(self) -> dict[str, Tensor]:
        """Structure: the stored curvature tensors (saved; counted by `num_floats`)."""

    @abstractmethod
    def _load_state(self, file: PosteriorFile) -> None:
        """Structure: read back `_state` from a posterior file (``file.tensor("curv:<key>", shape)``)."""

    @abstractmethod
    def _summary_rows(self) -> list[tuple[str, str, int]]:
        """Structure: ``(module, stored structure, floats)`` per module."""

    def _accumulate(self, curvature: Any, previous: Any, n_data: int) -> Any:
        """Structure: this episode's curvature (a routine's result) plus ``previous``'s, in that form."""
        raise NotImplementedError

    def _quad(self, delta: Mapping[str, Tensor], prior: Tensor, scale: Tensor | float) -> Tensor:
        """Structure: ``Δᵀ P Δ`` for ``Δ = {param name: [k]}`` (differentiable in ``Δ`` and the prior)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no penalty (DiagLaplace and KronLaplace do: continual learning)"
        )

    # ------------------------------------------------------------------ fitting
    def _require_fit(self) -> None:
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(loader) first")

    def _resolve_prior(self, prior_precision: PriorSpec | None) -> Tensor:
        if prior_precision is None:
            return self._prior
        return prior_vector(prior_precision, self.modules, dtype=self.dtype, device=self.device)

    def _scale(self, sigma_noise: float | Tensor | None) -> Tensor | float:
        """Curvature rescaling ``σ_fit² / σ²`` (regression; 1 for classification)."""
        if self._options.likelihood != "regression":
            return 1.0
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        check_number("sigma_noise", float(torch.as_tensor(sigma).detach()))
        return self._sigma_fit**2 / sigma**2

    def _read(
        self, batch: Any, labels: bool = True, target_ids: Tensor | None = None
    ) -> tuple[Tensor | dict[str, Any], Outputs]:
        """The one place a batch is read: model inputs on the posterior's device and its `Outputs`."""
        return read_batch(
            batch,
            self.device,
            likelihood=self._options.likelihood,
            shift=self._options.shift_labels,
            labels=labels,
            target_ids=target_ids,
        )

    def fit(
        self: _Posterior,
        loader: Iterable[Any],
        *,
        progress: bool = False,
        generator: torch.Generator | None = None,
        previous: LaplaceBase | None = None,
    ) -> _Posterior:
        """Compute the curvature of the subset over ``loader`` and the training loss at the MAP, in one pass.

        The model's current weights are the MAP; it is evaluated in eval mode. ``loader`` is read once (a
        generator works). Under ``torch.distributed`` each rank passes its own shard and gets the posterior of
        the union of the shards.

        Args:
            loader: Labelled batches. Token-level outputs count one example per kept position (``n_data`` is
                their number); outputs labelled -100 are skipped.
            progress: Show a progress bar while accumulating the curvature.
            generator: Randomness of the sampled labels of ``fisher="mc"`` (on the model's device or the CPU);
                same seed, same curvature.
            previous: Continual learning: the fitted posterior of the previous episode (same class, subset,
                likelihood and temperature) as this episode's prior ``N(θ_prev, P_prev⁻¹)``: the curvatures are
                summed (``P = H / T + P_prev``) and the evidence is ``p(D | D_prev)``. `DiagLaplace` adds the
                diagonals; `KronLaplace` accumulates the factor statistics (whole factors only).

        Returns:
            ``self``.

        Raises:
            TypeError: If ``generator`` is not a ``torch.Generator``, or a batch is of an unknown kind.
            ValueError: On an empty loader or batch, a batch without labels, bad labels (naming the batch),
                non-finite curvature (naming the module), a loader without any labelled output, a memory
                estimate above ``max_memory`` or the available memory (before the factors are allocated).
            RuntimeError: Under ``torch.distributed``, when another rank failed on its shard.
        """
        prev = None if previous is None else self._check_previous(previous)
        loss = MapLoss(self._options.likelihood)
        run = Run(check_generator(generator), progress, loss)
        run.preflight = lambda f, k, m: self._estimate(f, k, m, 0).check(self.max_memory)
        curvature = self._compute_curvature(loader, run)
        total, n, n_out = loss.result(self.device)
        run.finish(self.model)
        if prev is not None:
            curvature = self._accumulate(curvature, prev, n)
        self.fit_curvature(curvature, map_loss=total, n_data=n, n_outputs=n_out)
        if prev is not None:
            self._previous = copy.copy(prev)  # without its own previous: no chain of episodes
            self._previous._previous = None
            self._prior_mean = {k: v.clone() for k, v in prev._map.items()}
            self.n_seen = prev.n_seen + n
        return self

    def _check_previous(self, previous: LaplaceBase) -> LaplaceBase:
        if type(self)._accumulate is LaplaceBase._accumulate:
            raise TypeError(
                f"{type(self).__name__} does not take a previous posterior (DiagLaplace and KronLaplace do)"
            )
        check_type("previous", previous, type(self), f"a fitted {type(self).__name__}")
        previous._require_fit()
        mine = (self.subset, self.likelihood, self.temperature, self.sigma_noise)
        theirs = (previous.subset, previous.likelihood, previous.temperature, previous.sigma_noise)
        if mine != theirs:
            raise ValueError(
                "previous must have this posterior's subset, likelihood, temperature and sigma_noise: "
                f"got {theirs[1:]} for {mine[1:]}"
                + ("" if mine[0] == theirs[0] else " and another subset")
            )
        return previous

    def fit_curvature(
        self: _Posterior, curvature: Any, *, map_loss: float, n_data: int, n_outputs: int
    ) -> _Posterior:
        """Fit from precomputed curvature (the output of the matching curvature routine).

        Args:
            curvature: ``kfac(...)`` factors (`KronLaplace`), ``diag_curvature(...)`` (`DiagLaplace`) or
                ``dense_curvature(...)`` (`DenseLaplace`), computed on the model's current weights.
            map_loss: Training loss at the MAP summed over the data: cross-entropy in nats (classification) or
                the sum of squared errors over all outputs (regression).
            n_data: Number of training examples ``N``.
            n_outputs: Number of model outputs ``C``.

        Returns:
            ``self``.

        Raises:
            ValueError: Curvature that does not match the subset, is not finite, or is negative beyond round-off
                (naming the module); ``n_data < 1``; a non-finite ``map_loss``.
        """
        check_number("n_data", n_data, "[1, inf)")
        check_finite(map_loss, f"map_loss must be finite, got {map_loss}")
        params = self.subset.parameters_of(self.model)
        self._set_curvature(curvature)
        self._map = {
            n: self.subset.gather(n, p.detach()).to(self._options.dtype).clone()
            for n, p in params.items()
        }
        self.map_loss, self.n_data, self.n_outputs = float(map_loss), int(n_data), int(n_outputs)
        self.n_seen, self._previous, self._prior_mean = self.n_data, None, None
        self._sigma_fit = self._options.sigma_noise
        self._fitted = True
        return self

    # ------------------------------------------------------------------ evidence and the prior
    def penalty(self, model: nn.Module | None = None) -> Tensor:
        """``½ (θ − θ*)ᵀ P (θ − θ*)`` of ``model``'s current subset values (default: this posterior's model).

        Minus the log density up to a constant, differentiable: continual learning trains the next episode on
        ``loss + posterior.penalty() / N`` (``N`` its examples), then ``fit(loader, previous=posterior)``.
        """
        self._require_fit()
        params = self.subset.parameters_of(self.model if model is None else model)
        delta = {
            n: self.subset.gather(n, p).to(self.dtype) - self._map[n] for n, p in params.items()
        }
        return 0.5 * self._quad(delta, self._prior, self._scale(None))

    def log_det(
        self, prior_precision: PriorSpec | None = None, sigma_noise: float | None = None
    ) -> Tensor:
        """``log det P`` of the posterior precision ``P = H / T + δ`` (differentiable in δ and σ)."""
        self._require_fit()
        return self._log_det(self._resolve_prior(prior_precision), self._scale(sigma_noise))

    def _module_sums(self, values: Mapping[str, Tensor] | None) -> Tensor:
        """Per module: the number of entries (``values=None``) or ``Σ v²`` over its parameters."""
        out = torch.zeros(len(self.modules), dtype=self.dtype, device=self.device)
        for n, m in self._param_module.items():
            if values is None:
                out[m] += self.subset.num_entries(n)
            else:
                out[m] += (values[n].to(self.device) ** 2).sum()
        return out

    def log_likelihood(self, sigma_noise: float | Tensor | None = None) -> Tensor:
        """Tempered training log-likelihood at the MAP, ``log p(D | θ*) / T``.

        Classification: ``-Σ CE / T``. Regression: ``-(SSE / (2σ²) + N C log(σ √(2π))) / T``.
        """
        self._require_fit()
        if self.likelihood == "classification":
            return torch.tensor(
                -self.map_loss / self.temperature, dtype=self.dtype, device=self.device
            )
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        sigma = torch.as_tensor(sigma, dtype=self.dtype, device=self.device)
        norm = self.n_data * self.n_outputs * torch.log(sigma * math.sqrt(2 * math.pi))
        return -(self.map_loss / (2 * sigma**2) + norm) / self.temperature

    def log_marginal_likelihood(
        self, prior_precision: PriorSpec | None = None, sigma_noise: float | Tensor | None = None
    ) -> Tensor:
        """Laplace evidence ``log p(D|θ*)/T - ½ (log det P - log det P₀) - ½ (θ* − μ)ᵀ P₀ (θ* − μ)``.

        The prior is ``N(0, δ⁻¹)``, or after ``fit(..., previous=prev)`` ``N(θ_prev, P_prev⁻¹)`` (the evidence is
        then ``p(D | D_prev)``; a loaded posterior does not keep ``P_prev`` and refuses). Differentiable in
        ``prior_precision`` and ``sigma_noise`` (pass tensors that require grad).

        Args:
            prior_precision: Overrides the stored prior precision (scalar, per module tensor, or dict).
            sigma_noise: Overrides the regression noise (the curvature is rescaled by ``σ_fit² / σ²``).

        Returns:
            Scalar tensor.
        """
        self._require_fit()
        prior = self._resolve_prior(prior_precision)
        if self._prior_mean is None:
            log_det_prior = (self._module_sums(None) * prior.log()).sum()
            scatter = (self._module_sums(self._map) * prior).sum()
        elif self._previous is None:
            raise ValueError(
                "this posterior was fitted with previous= and loaded from a file, which does not keep the "
                "previous episode's curvature: its evidence p(D | D_prev) is not available"
            )
        else:
            prev, scale = self._previous, self._previous._scale(sigma_noise)
            delta = {n: self._map[n] - self._prior_mean[n] for n in self._map}
            log_det_prior, scatter = prev._log_det(prior, scale), prev._quad(delta, prior, scale)
        log_det = self._log_det(prior, self._scale(sigma_noise))  # P's and P₀'s 2π factors cancel
        return self.log_likelihood(sigma_noise) - 0.5 * (log_det - log_det_prior) - 0.5 * scatter

    def optimize_prior_precision(
        self,
        method: str = "marglik",
        *,
        val_loader: Iterable[Any] | None = None,
        grid: Tensor | Sequence[float] | None = None,
        optimizer: str = "grid",
        **gradient: Any,
    ) -> float:
        """Choose one scalar prior precision for every module, the best of ``grid``, and set it.

        One evidence evaluation per candidate (``method="marglik"``), or one linearised predictive per validation
        batch with the Jacobians shared by every candidate (``method="val_nll"``). `maximize_evidence` instead
        fits one prior per module (and ``σ``) by the evidence's gradient.

        Args:
            method: ``"marglik"`` (maximise `log_marginal_likelihood`) or ``"val_nll"`` (minimise `grid_val_nll`
                on ``val_loader``).
            val_loader: Validation batches (``method="val_nll"`` only).
            grid: Candidate values, default ``torch.logspace(-1, 3, 21)``.
            optimizer: Deprecated since 0.6.0, to be removed: ``"gradient"`` warns (``FutureWarning``) and
                returns ``maximize_evidence(**gradient)`` (a `MarglikFit`); call `maximize_evidence` instead.
            **gradient: With ``optimizer="gradient"`` only: `maximize_evidence`'s options.

        Returns:
            The chosen prior precision, also set on the posterior.

        Raises:
            ValueError: A bad ``method``, ``optimizer`` or ``grid``, ``val_loader`` missing for ``"val_nll"`` or
                given without it, and (``"val_nll"``) what `grid_val_nll` refuses.
            TypeError: `maximize_evidence`'s options without ``optimizer="gradient"``.
        """
        self._require_fit()
        check_choice("optimizer", optimizer, ("grid", "gradient"))
        if optimizer == "gradient":  # the 0.3 API
            warnings.warn(
                "optimize_prior_precision(optimizer='gradient', ...) is deprecated and will be removed: "
                "call maximize_evidence(...) with the same options",
                FutureWarning,
                stacklevel=2,
            )
            check_choice("method", method, ("marglik",))
            grid_options = {
                k: v for k, v in (("val_loader", val_loader), ("grid", grid)) if v is not None
            }
            return self.maximize_evidence(**gradient, **grid_options)  # type: ignore[return-value]
        if gradient:
            raise TypeError(
                f"{sorted(gradient)} are options of maximize_evidence, not of the grid search "
                "optimize_prior_precision"
            )
        check_choice("method", method, ("marglik", "val_nll"))
        return grid_search(self, method, val_loader, grid)

    def maximize_evidence(
        self,
        *,
        init_prior_precision: PriorSpec | None = None,
        fit_sigma_noise: bool | None = None,
        per_module: bool = True,
        lr: float = 0.1,
        max_steps: int = 1000,
        tol: float = 1e-4,
    ) -> MarglikFit:
        """Fit the prior precision, one per module, and for regression ``σ``, by gradient ascent on the evidence.

        Adam on ``log δ_m`` (one shared value with ``per_module=False``) and on ``log σ``, until every scaled
        gradient (``|∂L/∂log δ_m| / d_m``, ``d_m`` the module's entries; ``|∂L/∂log σ| / (N C)``) is at most
        ``tol``. Each step is one `log_marginal_likelihood` evaluation (no data pass). Not converging within
        ``max_steps`` warns and returns ``converged=False``; the last values are set anyway.
        `optimize_prior_precision` picks one scalar on a grid instead.

        Args:
            init_prior_precision: Start (scalar, per module tensor or dict); default the current one.
            fit_sigma_noise: Also fit ``σ`` (default: for regression); it becomes ``sigma_noise``.
            per_module: One prior precision per module, or one shared value.
            lr: Adam step size on the log scale.
            max_steps: Most Adam steps.
            tol: Stationarity tolerance on the scaled gradients.

        Returns:
            A `MarglikFit`; its values are also set on the posterior.

        Raises:
            ValueError: A non-positive start, ``lr``, ``tol`` or ``max_steps``; ``fit_sigma_noise=True`` for
                classification; a non-finite evidence.
            TypeError: ``per_module`` or ``fit_sigma_noise`` not a bool, ``lr`` or ``tol`` not a number, ``max_steps``
                not an int.
        """
        self._require_fit()
        return evidence_ascent(
            self, init_prior_precision, fit_sigma_noise, per_module, lr, max_steps, tol
        )

    def grid_val_nll(self, val_loader: Iterable[Any], grid: Tensor) -> Tensor:
        """Mean validation NLL of the linearised predictive for each scalar prior precision in ``grid``.

        The probit predictive (classification) or the Gaussian predictive with the observation noise
        (regression); the Jacobians of a batch serve every grid value. Outputs count and skip as in `fit`.
        `grid_val_nll_many` scores several posteriors in one pass.

        Returns:
            ``[len(grid)]`` mean NLL per example.

        Raises:
            ValueError: On an empty ``val_loader`` (or one without any labelled output), a batch without
                labels, or bad labels (naming the batch).
        """
        return grid_val_nlls([self], val_loader, grid)[0]

    # ------------------------------------------------------------------ samples and swapping
    def _noise(self, shape: Sequence[int], generator: torch.Generator | None) -> Tensor:
        """Standard normal draws in the posterior's dtype, drawn on the generator's device."""
        device = generator.device if generator is not None else self.device
        eps = torch.randn(*shape, generator=generator, dtype=self.dtype, device=device)
        return eps.to(self.device)

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Draw weight samples ``θ ~ N(θ*, P⁻¹)`` of the subset.

        Args:
            n: Number of samples.
            generator: Source of randomness (on the model's device or the CPU); same seed, same samples.

        Returns:
            ``{param name: [n, k]}``, entries in ``subset.gather`` order, parameters in ``subset.names`` order.

        Raises:
            ValueError, TypeError: If ``n`` is not a positive int, or the generator not a ``torch.Generator``.
        """
        check_generator(generator)
        self._require_fit()
        n = check_int("n", n)
        centered = self._sample(n, generator)
        return {name: self._map[name] + centered[name] for name in self.subset.names}

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one weight sample into the model; on exit restore what it held, even on error (``Subset.swapped``).

        Args:
            sample: ``{param name: [k]}`` (or ``[1, k]``) for every parameter of the subset (a row of `sample`).

        Returns:
            A context manager yielding the model, carrying the sample.

        Raises:
            TypeError: If ``sample`` is not a mapping of tensors.
            ValueError: If it does not cover the subset exactly, or a value has the wrong size or is not finite
                (naming the parameter; the model is left untouched).
        """
        self._require_fit()
        return self.subset.swapped(self.model, sample)

    @contextmanager
    def sampled(self, *, generator: torch.Generator | None = None) -> Iterator[nn.Module]:
        """Draw one sample (from ``generator``) and swap it into the model (see `swapped`); restored on exit."""
        one = {k: v[0] for k, v in self.sample(1, generator=generator).items()}
        with self.swapped(one) as model:
            yield model

    # ------------------------------------------------------------------ the linearised predictive
    def logit_mean_cov(
        self,
        batch: Any,
        chunk_size: int | None = None,
        *,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Linearised predictive: ``f_MAP`` and the functional covariance ``J Σ Jᵀ`` per labelled output.

        Args:
            batch: Any accepted batch. Label values are ignored, but labels of -100 (and an attention mask of 0)
                mark the outputs to skip: the cheap way to get the covariance of a few positions only.
            chunk_size: Process at most this many examples at a time (bounds the memory of the recorded
                activations and output gradients); ``None`` = the whole batch at once.
            target_ids: Answer-only: the ``K`` logits to return (a multiple-choice answer's tokens) at the
                answer positions (``partialbayes.predictive.answer_positions``), at ``K`` backward passes per
                position instead of ``C``, and no ``[C, C]`` object.

        Returns:
            ``(f [N, C], Σ_f [N, C, C])`` in the dtype of the logits, one row per output not skipped (row-major
            for token-level logits, as ``predictive.flatten_outputs``); ``(f [P, K], Σ_f [P, K, K])`` with
            ``target_ids``.

        Raises:
            TypeError: A batch of an unknown kind (the message names its type and the accepted ones).
            ValueError: Token-level logits with neither an attention mask nor labels; logits that are not
                finite; an empty batch, or one whose every label is -100; ``target_ids`` out of range,
                repeated, or with regression; a predictive above ``max_memory`` (or the free memory).
        """
        _, _, f, (cov,) = linearised([self], batch, chunk_size, target_ids=target_ids)
        return f, cov.to(f.dtype)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The linearised predictive of a batch, at the model's output shape.

        The logits ``f ~ N(f_MAP, Σ_f)`` (`logit_mean_cov`) are integrated against the likelihood with
        ``partialbayes.predictive``'s approximations. Labels are ignored: every real position of token-level
        logits gets the predictive (index the result with ``partialbayes.predictive.kept_positions`` to keep the
        labelled ones, or call `logit_mean_cov`).

        Args:
            batch: Any accepted batch; labels are ignored.
            link: Classification: ``"probit"`` (default; ``softmax(κ ⊙ f_MAP)`` with
                ``κ_c = (1 + π/8 Σ_f,cc)^(-1/2)``), ``"mc"`` (``n_samples`` draws of ``f``, averaged softmax) or
                ``"bridge"`` (the Laplace bridge). Regression: every link gives the closed-form Gaussian predictive.
            n_samples: Draws for ``link="mc"``.
            generator: Source of randomness for ``link="mc"`` (on the model's device); same seed, same result.
            target_ids: Answer-only (classification): the link applied to the Gaussian of the ``K`` answer
                tokens at the answer positions (see `logit_mean_cov`), renormalised over them.

        Returns:
            Classification: probabilities with the logits' shape and dtype (``[P, K]`` with ``target_ids``).
            Regression: ``(mean, variance)`` of a new target, the variance ``diag Σ_f + σ²``. Padding positions
            hold the MAP prediction (``softmax(f_MAP)``, or ``(f_MAP, σ²)``); never NaN.

        Raises:
            ValueError: A link the posterior does not offer (the message lists `links`), a bad ``n_samples``,
                and as `logit_mean_cov`.
            TypeError: A batch of an unknown kind, a ``generator`` that is not a ``torch.Generator``.
        """
        link = resolve_link(link, self.links, type(self).__name__)
        n_samples = check_int("n_samples", n_samples)
        check_generator(generator)
        logits, keep, f, (cov,) = linearised([self], batch, labels=False, target_ids=target_ids)
        full, f = logits.to(cov.dtype), f.to(cov.dtype)
        if self._options.likelihood == "regression":
            noise = self._options.sigma_noise**2  # our own covariance: added unchecked
            var = _place(torch.full_like(full, noise), keep, cov.diagonal(dim1=-2, dim2=-1) + noise)
            return _place(full, keep, f).to(logits.dtype), var.to(logits.dtype)
        if link == "probit":  # our own covariance: nothing to check
            probs = probit_kernel(f, cov.diagonal(dim1=-2, dim2=-1))
        elif link == "bridge":
            probs = laplace_bridge(f, cov)
        else:
            probs = gaussian_mc(f, cov, True, n_samples, generator)
        if target_ids is not None:
            return probs.to(logits.dtype)
        return _place(torch.softmax(full, dim=-1), keep, probs).to(logits.dtype)

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """``n`` draws of the linearised logits ``f ~ N(f_MAP, Σ_f)`` for a batch (independent per output).

        The input of ``partialbayes.predictive``'s uncertainty decomposition; regression draws the function,
        without the noise. Labels are ignored, as in `predict`; padding holds ``f_MAP``.

        Args:
            batch: Any accepted batch (labels only mark the answers of ``target_ids``).
            n: Number of draws.
            generator: Source of randomness (on the model's device).
            target_ids: Answer-only: draws of the ``K`` answer logits at the answer positions (see
                `logit_mean_cov`).

        Returns:
            ``[n, B, C]`` (or ``[n, B, T, C]``; ``[n, P, K]`` with ``target_ids``) in the logits' dtype.
        """
        n = check_int("n", n)
        check_generator(generator)
        logits, keep, f, (cov,) = linearised([self], batch, labels=False, target_ids=target_ids)
        draws = gaussian_draws(f.to(cov.dtype), cov, True, n, generator)
        if target_ids is not None:
            return draws.to(logits.dtype)
        full = logits.to(cov.dtype).expand(n, *logits.shape)
        return _place(full, keep, draws).to(logits.dtype)

    # ------------------------------------------------------------------ size, summary, files
    @property
    def num_floats(self) -> int:
        """Floats stored for the posterior covariance (curvature representation; MAP excluded)."""
        self._require_fit()
        return sum(t.numel() for t in self._state().values())

    def _settings(self) -> str:
        """The structure's saved keywords, ``", sharing=expand, ..."`` (for `summary` and ``repr``)."""
        return "".join(f", {k}={getattr(self, k)}" for k in self._SAVED)

    def summary(self) -> str:
        """A readable table: module, stored structure, floats; with totals."""
        self._require_fit()
        rows = self._summary_rows()
        width = max([len("module"), *(len(m) for m, _, _ in rows)])
        lines = [
            f"{type(self).__name__}: {len(self.modules)} modules, {self.subset.num_entries()} parameters, "
            f"likelihood={self.likelihood}, fisher={self.fisher}, T={self.temperature:g}, "
            f"N={self.n_data}{self._settings()}",
            f"{'module'.ljust(width)}  {'structure':<40}  floats",
        ]
        lines += [f"{m.ljust(width)}  {s:<40}  {f}" for m, s, f in rows]
        lines.append(f"{'total'.ljust(width)}  {'':<40}  {self.num_floats}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        state = f"{self.num_floats} floats" if self._fitted else "not fitted"
        return f"{type(self).__name__}({len(self.modules)} modules, {state}{self._settings()})"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save to one ``.safetensors`` file (tensors) with JSON metadata (settings, subset, model structure).

        Written atomically by ``partialbayes.predictive.internal.write_posterior_file`` (a missing parent folder is
        created; a folder path is refused); format ``partialbayes.curvature.<class>`` version 2.
        """
        self._require_fit()
        tensors = {f"curv:{k}": v for k, v in self._state().items()}
        tensors.update({f"map:{n}": v for n, v in self._map.items()})
        tensors["prior_precision"] = self.prior_precision
        if self._prior_mean is not None:  # fitted with previous=
            tensors["n_seen"] = torch.tensor(self.n_seen)
            tensors.update({f"prior_mean:{n}": v for n, v in self._prior_mean.items()})
        skip = ("dtype", "sharing", "bias", "max_rank")  # dtype: a field; the rest: the structure's
        options = {k: v for k, v in vars(self._options).items() if k not in skip}
        options.update(temperature=self.temperature, **{k: getattr(self, k) for k in self._SAVED})
        meta = {
            "format": FORMAT.format(type(self).__name__),
            "version": VERSION,
            "model_class": type(self.model).__name__,
            "subset": self.subset.to_json(),
            "modules": list(self.modules),
            "dtype": str(self.dtype),
            "options": options,
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "map_loss": self.map_loss,
            "sigma_fit": self._sigma_fit,
        }
        write_posterior_file(path, tensors, meta, model=self.model)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], model: nn.Module, *, check_weights: bool = True
    ) -> LaplaceBase:
        """Load a posterior saved with `save` onto ``model`` (``LaplaceBase.load``: whichever class the file holds).

        Args:
            path: The file `save` wrote.
            model: The model the posterior was fitted on (same structure and, by default, same weights).
            check_weights: Refuse a model whose current subset weights differ from the saved MAP. ``False`` loads
                it anyway: the posterior stays centred on the saved MAP, the model keeps its values.

        Raises:
            FileNotFoundError: If there is no file at ``path``.
            ValueError: Naming the file: not a readable posterior file of this version (garbage, truncated, a
                missing or mistyped field or tensor, NaN or inf); a ``model`` or saved subset that does not
                match; another posterior class than ``cls``; weights that differ from the saved MAP.
        """
        names = ("KronLaplace", "DiagLaplace", "DenseLaplace")
        file = read_posterior_file(
            path, formats=[FORMAT.format(n) for n in names], version=VERSION, fields=_FIELDS
        )
        saved = file.meta["format"].rpartition(".")[2]
        target = next((c for c in (cls, *cls.__subclasses__()) if c.__name__ == saved), None)
        if target is None:
            raise file.error(f"holds a {saved}, not a {cls.__name__}: load it with {saved}.load")
        file.check_model(model)
        dtype, prior = file.dtype(), file.tensor("prior_precision")
        with file.reraised("the saved settings are invalid"):
            subset = Subset.from_json(file.meta["subset"], model)
            options = {**file.meta["options"], "dtype": dtype, "prior_precision": prior}
            post: LaplaceBase = target(model, subset, **options)
        if list(post.modules) != file.meta["modules"]:
            raise file.error(
                f"saved modules {file.meta['modules']} do not match the subset's {list(post.modules)}"
            )
        post._load_state(file)

        def entries(key: str) -> dict[str, Tensor]:
            shapes = {n: (subset.num_entries(n),) for n in subset.names}
            return {
                n: file.tensor(f"{key}:{n}", k).to(post.device, post.dtype)
                for n, k in shapes.items()
            }

        post._map = entries("map")
        post.n_data, post.n_outputs = file.meta["n_data"], file.meta["n_outputs"]
        post.n_seen = post.n_data
        if f"prior_mean:{subset.names[0]}" in file.tensors:  # fitted with previous=: no P_prev kept
            post.n_seen = int(file.tensor("n_seen"))
            post._prior_mean = entries("prior_mean")
        post.map_loss, post._sigma_fit = file.meta["map_loss"], file.meta["sigma_fit"]
        post._fitted = True
        for n, p in subset.parameters_of(model).items() if check_weights else ():
            here = subset.gather(n, p.detach()).to(post.dtype)
            if not torch.allclose(here, post._map[n], rtol=1e-5, atol=1e-6):
                raise file.error(
                    f"the model's current values of {n!r} differ from the saved MAP (by up to "
                    f"{float((here - post._map[n]).abs().max()):.3g}): the posterior was fitted on other "
                    "weights. Load it onto the model it was fitted on (the same checkpoint), or pass "
                    "check_weights=False to use it anyway (centred on the saved MAP)"
                )
        return post


def linearised(
    posteriors: Sequence[LaplaceBase],
    batch: Any,
    chunk_size: int | None = None,
    labels: bool = True,
    target_ids: Sequence[int] | Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, list[Tensor]]:
    """``(logits, keep, f [N, K], [Σ_f [N, K, K] per posterior])`` at the posteriors' priors."""
    first = posteriors[0]
    first._require_fit()
    if chunk_size is not None:
        check_int("chunk_size", chunk_size)
    ids = None
    if answer_only(target_ids, first._options.likelihood == "regression"):
        ids = check_target_ids(target_ids, first.n_outputs).to(first.device)
    inputs, outputs = first._read(batch, labels or ids is not None, ids)
    if outputs.unlabelled:
        raise ValueError(
            "every output of the batch is labelled -100: there is no labelled output to return "
            "(pass the batch without labels to get every output)"
        )
    logits, keeps = [], []
    covs: list[list[Tensor]] = [[] for _ in posteriors]
    chunks = [(inputs, outputs)]
    if chunk_size is not None:  # in row order
        n = batch_size(inputs)
        chunks = [
            take_examples(inputs, outputs, slice(i, i + chunk_size))
            for i in range(0, n, chunk_size)
        ]
    for part, part_outputs in chunks:
        with sized(posteriors, part_outputs):
            f, keep, part_covs = type(first)._covariances_of(
                posteriors, part, part_outputs, [[p._prior] for p in posteriors]
            )
        logits.append(f.detach())
        keeps.append(keep)
        for acc, (cov,), p in zip(covs, part_covs, posteriors, strict=True):
            acc.append(cov.to(p._options.dtype))
    keep_all = None if keeps[0] is None else torch.cat([k for k in keeps if k is not None])
    logits_all = torch.cat(logits)
    rows = logits_all if keep_all is None else logits_all[keep_all]
    check_finite(
        rows,
        "the model's logits for this batch are not finite (NaN or inf in the inputs?): "
        "no predictive is computed from them",
    )
    f_rows = rows if ids is None else rows.index_select(-1, ids)
    return logits_all, keep_all, f_rows, [torch.cat(c) for c in covs]
