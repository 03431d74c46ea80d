"""What every Laplace posterior over a `Subset` shares: prior, MAP, evidence, sampling, swapping, predictive.

Conventions (DESIGN): the log-likelihood is summed over the N training examples, the curvature ``H`` is the
summed GGN / Fisher of the subset's entries, and the posterior precision is ``P = H / T + P₀`` with
``P₀ = diag(δ_m)`` (one prior precision per module, or one scalar) and prior mean 0.

A subclass stores one curvature representation (Kronecker eigenbases, a diagonal, a dense matrix) and
implements the small hooks marked "subclass" below; everything else is here, once.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, overload

import torch
from torch import Tensor, nn

from partialbayes.curvature._caller import user_stacklevel
from partialbayes.curvature._hooks import BatchObserver
from partialbayes.curvature._io import load_posterior, save_posterior
from partialbayes.curvature._laplace_data import MapLoss, eval_mode
from partialbayes.curvature._laplace_predict import (
    LINKS,
    classification_predictive,
    linearised_logit_samples,
    regression_predictive,
)
from partialbayes.curvature._likelihood import check_labels
from partialbayes.curvature._marglik import MarglikFit, gradient_marglik
from partialbayes.curvature._outputs import (
    Outputs,
    output_rows,
    read_batch,
    resolve_shift_labels,
    split_chunks,
)
from partialbayes.curvature._prior import (
    PriorSpec,
    check_positive,
    gaussian_log_marglik,
    prior_vector,
)
from partialbayes.predictive import (
    check_count,
    gaussian_nll,
    gaussian_predictive,
    nll,
    probit,
    resolve_link,
)
from partialbayes.selection import Subset

LIKELIHOODS = ("classification", "regression")
FISHERS = ("exact", "mc", "empirical")
SHARINGS = ("reduce", "expand")


def owner_module(param_name: str) -> str:
    """Module owning a parameter: ``"a.b.weight" -> "a.b"`` (``""`` for a top-level parameter)."""
    return param_name.rpartition(".")[0]


class LaplaceBase:
    """Shared machinery of `KronLaplace`, `DiagLaplace` and `DenseLaplace` (not used directly).

    Batches, everywhere (``fit``, ``logit_mean_cov``, ``predict``, ``optimize_prior_precision``): a tensor
    ``x``, a pair ``(inputs, labels)``, or any mapping of keyword inputs (``dict``, the ``BatchEncoding``
    of ``DataCollatorWithPadding``) with labels under ``"labels"`` or ``"label"``.

    Outputs: logits ``[B, C]`` give one output per example; token-level logits ``[B, T, C]`` (token
    classification, causal LMs) one per kept position — positions where the attention mask is 0 or the
    label is -100 are dropped, in the curvature, the training loss, ``n_data`` and the predictive alike.

    Args:
        model: The fine-tuned model (its current weights are the MAP).
        subset: Which entries get a posterior; the rest stay at their MAP values.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian, ``sigma_noise``).
        prior_precision: ``δ > 0``: a scalar, a tensor with one value per module, or ``{module: δ}``.
        temperature: ``T > 0``; the posterior precision is ``H / T + δ``.
        sigma_noise: Observation noise of the regression likelihood.
        fisher: ``"exact"`` (GGN), ``"mc"`` or ``"empirical"``; passed to the curvature routine.
        mc_samples: Sampled labels per example for ``fisher="mc"`` (a positive ``int``; seed the sampling with
            ``fit(..., generator=...)``).
        num_classes: Expected number of logits (checked during `fit`); ``None`` to skip the check.
        dtype: dtype of the stored curvature: ``torch.float64`` (default) or ``torch.float32``.
        shift_labels: Token-level outputs of a causal language model: the output at position ``t`` is
            scored against ``labels[t + 1]`` (Hugging Face shifts the labels inside the model; this makes
            the same convention explicit) and is kept when the tokens ``t`` and ``t + 1`` are real and that
            label is not -100. ``None`` (default): ``True`` exactly when the model's class name ends with
            ``ForCausalLM`` or ``LMHeadModel``. Stored by `save`.
    """

    #: Links `predict` accepts: the linearised probit (default), Monte Carlo over the linearised
    #: Gaussian logits, and the Laplace bridge.
    links: ClassVar[tuple[str, ...]] = LINKS

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(subset, Subset):
            raise TypeError(
                f"subset must be a partialbayes.selection.Subset, got {type(subset).__name__}"
            )
        if len(subset.names) == 0:
            raise ValueError("subset is empty: select at least one parameter")
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
        if fisher not in FISHERS:
            raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int):
            raise TypeError(
                f"mc_samples must be a positive int, got {type(mc_samples).__name__} {mc_samples!r}"
            )
        if mc_samples < 1:
            raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
        if dtype not in (torch.float32, torch.float64):  # what the factors and eigh support
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
        check_positive("temperature", temperature)
        check_positive("sigma_noise", sigma_noise)
        params = dict(model.named_parameters())
        self.model = model
        self.subset = subset
        self.likelihood = likelihood
        self.temperature = float(temperature)
        self.sigma_noise = float(sigma_noise)
        self.fisher = fisher
        self.mc_samples = mc_samples
        self.num_classes = num_classes
        self.dtype = dtype
        self.shift_labels = resolve_shift_labels(model, shift_labels)
        self.device = next(iter(params.values())).device
        self._check_subset()
        self.modules: tuple[str, ...] = self._module_names()
        self._prior = prior_vector(prior_precision, self.modules, dtype=dtype, device=self.device)
        self._param_module = {n: self.modules.index(self._module_of(n)) for n in subset.names}
        self._map: dict[str, Tensor] = {}
        self._fitted = False
        self.n_data = 0
        self.n_outputs = 0
        self.map_loss = 0.0
        self._sigma_fit = self.sigma_noise

    # ------------------------------------------------------------------ subclass hooks
    def _check_subset(self) -> None:
        """Subclass: raise if the subset has the wrong structure."""

    def _module_of(self, param_name: str) -> str:
        """Prior group of a parameter (subclass may override)."""
        return owner_module(param_name)

    def _module_names(self) -> tuple[str, ...]:
        """Prior groups, in order (default: the owning modules of the subset's parameters)."""
        return tuple(dict.fromkeys(self._module_of(n) for n in self.subset.names))

    def _curvature_options(
        self,
        progress: bool,
        generator: torch.Generator | None = None,
        on_batch: BatchObserver | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments every curvature routine (kfac, diag, dense) takes from the posterior."""
        return {
            "likelihood": self.likelihood,
            "fisher": self.fisher,
            "mc_samples": self.mc_samples,
            "sigma_noise": self.sigma_noise,
            "dtype": self.dtype,
            "generator": generator,
            "progress": progress,
            "num_classes": self.num_classes,
            "on_batch": on_batch,
            "shift_labels": self.shift_labels,
        }

    def _compute_curvature(self, loader: Iterable[Any], options: Mapping[str, Any]) -> Any:
        """Subclass: run the matching curvature routine over ``loader`` with ``**options``."""
        raise NotImplementedError

    def _set_curvature(self, curvature: Any) -> None:
        raise NotImplementedError

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        raise NotImplementedError

    def _sample_centered(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        raise NotImplementedError

    def _jacobians(
        self, inputs: Tensor | Mapping[str, Any], outputs: Outputs
    ) -> tuple[Tensor, Tensor | None, Any]:
        """Subclass: ``(logits, keep, Jacobians of the N output rows)`` (see ``subset_jacobians``)."""
        raise NotImplementedError

    def _prepare(self, jac: Any) -> Any:
        """Prior-independent preprocessing of Jacobians (default: none)."""
        return jac

    def _functional_cov(self, prepared: Any, prior: Tensor, scale: Tensor | float) -> Tensor:
        raise NotImplementedError

    def _mean_covs(
        self,
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Tensor],
        scale: Tensor | float,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """Logits, kept positions and one functional covariance per prior setting (subclass may stream).

        Default: Jacobians once (`_jacobians`, `_prepare`), then `_functional_cov` per prior.

        Returns:
            ``(logits [B, C] | [B, T, C], keep [B, T] | None, [Σ_f [N, C, C] per prior])``.
        """
        with eval_mode(self.model):
            logits, keep, jac = self._jacobians(inputs, outputs)
        with torch.no_grad():
            prepared = self._prepare(jac)
            return logits.detach(), keep, [self._functional_cov(prepared, p, scale) for p in priors]

    def _read(self, batch: Any) -> tuple[Tensor | dict[str, Any], Outputs]:
        """The one place a batch is read: model inputs on the posterior's device and its `Outputs`."""
        return read_batch(batch, self.device, likelihood=self.likelihood, shift=self.shift_labels)

    def _curvature_state(self) -> dict[str, Tensor]:
        """Subclass: the stored curvature tensors (saved; counted by `num_floats`)."""
        raise NotImplementedError

    def _load_curvature_state(self, tensors: Mapping[str, Tensor]) -> None:
        raise NotImplementedError

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        """Subclass: ``(module, structure, floats)`` per module."""
        raise NotImplementedError

    # ------------------------------------------------------------------ prior and fitting
    @property
    def prior_precision(self) -> Tensor:
        """Prior precision per module, shape ``[len(modules)]``."""
        return self._prior

    @prior_precision.setter
    def prior_precision(self, value: PriorSpec) -> None:
        self._prior = prior_vector(value, self.modules, dtype=self.dtype, device=self.device)

    def _resolve_prior(self, prior_precision: PriorSpec | None) -> Tensor:
        if prior_precision is None:
            return self._prior
        return prior_vector(prior_precision, self.modules, dtype=self.dtype, device=self.device)

    def _scale(self, sigma_noise: float | Tensor | None) -> Tensor | float:
        """Curvature rescaling ``σ_fit² / σ²`` (regression; 1 for classification)."""
        if self.likelihood != "regression":
            return 1.0
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        check_positive("sigma_noise", sigma)
        return self._sigma_fit**2 / sigma**2

    def fit(
        self,
        loader: Iterable[Any],
        *,
        progress: bool = False,
        generator: torch.Generator | None = None,
    ) -> LaplaceBase:
        """Compute the curvature of the subset over ``loader`` and the training loss at the MAP, in one pass.

        The model's current weights are taken as the MAP. The model is evaluated in eval mode. ``loader`` is
        read exactly once (a generator or any one-shot iterable works): the training loss is accumulated from
        the logits of the curvature's forward passes. Under ``torch.distributed`` each rank passes its own
        shard; the curvature, the training loss, ``n_data`` and ``n_outputs`` are reduced over the ranks, so
        every rank gets the posterior of the union of the shards.

        Args:
            loader: Iterable of labelled batches: pairs ``(inputs, labels)`` or mappings (``dict``,
                ``BatchEncoding``) with ``"labels"`` / ``"label"``. Token-level outputs count one example
                per kept position (``n_data`` is their number).
            progress: Show a progress bar while accumulating the curvature.
            generator: Source of randomness of the sampled labels for ``fisher="mc"`` (on the model's device
                or the CPU); same seed, same curvature. Unused by the other fisher types.

        Returns:
            ``self``.

        Raises:
            TypeError: If ``generator`` is not a ``torch.Generator``, or a batch is of an unknown kind.
            ValueError: On an empty loader, a batch without labels, labels of the wrong dtype / shape or out
                of range (naming the batch), non-finite curvature (naming the module).
            RuntimeError: Under ``torch.distributed``, when another rank failed on its shard.
        """
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        loss = MapLoss(self.likelihood)
        curvature = self._compute_curvature(
            loader, self._curvature_options(progress, generator, loss)
        )
        total, n, n_out = loss.result(self.device)
        return self.fit_curvature(curvature, map_loss=total, n_data=n, n_outputs=n_out)

    def fit_curvature(
        self, curvature: Any, *, map_loss: float, n_data: int, n_outputs: int
    ) -> LaplaceBase:
        """Fit from precomputed curvature (the output of the matching curvature routine).

        Args:
            curvature: ``kfac(...)`` factors (`KronLaplace`), ``diag_curvature(...)`` (`DiagLaplace`) or
                ``dense_curvature(...)`` (`DenseLaplace`), computed on the model's current weights.
            map_loss: Training loss at the MAP summed over the data: cross-entropy in nats
                (classification) or the sum of squared errors over all outputs (regression).
            n_data: Number of training examples ``N``.
            n_outputs: Number of model outputs ``C``.

        Returns:
            ``self``.
        """
        if n_data < 1:
            raise ValueError(f"n_data must be positive, got {n_data}")
        if not math.isfinite(map_loss):
            raise ValueError(f"map_loss must be finite, got {map_loss}")
        params = dict(self.model.named_parameters())
        self._map = {
            n: self.subset.gather(n, params[n].detach()).to(self.dtype).clone()
            for n in self.subset.names
        }
        self._set_curvature(curvature)
        self.map_loss, self.n_data, self.n_outputs = float(map_loss), int(n_data), int(n_outputs)
        self._sigma_fit = self.sigma_noise
        self._fitted = True
        return self

    def _require_fit(self) -> None:
        if not self._fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(loader) first")

    # ------------------------------------------------------------------ evidence
    def log_det(
        self, prior_precision: PriorSpec | None = None, sigma_noise: float | None = None
    ) -> Tensor:
        """``log det P`` of the posterior precision ``P = H / T + δ`` (differentiable in δ and σ)."""
        self._require_fit()
        return self._log_det(self._resolve_prior(prior_precision), self._scale(sigma_noise))

    def _module_sizes(self) -> Tensor:
        sizes = torch.zeros(len(self.modules), dtype=self.dtype, device=self.device)
        for n, m in self._param_module.items():
            sizes[m] += self.subset.num_entries(n)
        return sizes

    def _module_sq_norms(self) -> Tensor:
        sq = torch.zeros(len(self.modules), dtype=self.dtype, device=self.device)
        for n, m in self._param_module.items():
            sq[m] += (self._map[n].to(self.device) ** 2).sum()
        return sq

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
        """Laplace evidence ``log p(D|θ*)/T - ½ (log det P - log det P₀) - ½ θ*ᵀ P₀ θ*``.

        Differentiable in ``prior_precision`` and ``sigma_noise`` (pass tensors that require grad).

        Args:
            prior_precision: Overrides the stored prior precision (scalar, per module tensor, or dict).
            sigma_noise: Overrides the regression noise (the curvature is rescaled by ``σ_fit² / σ²``).

        Returns:
            Scalar tensor.
        """
        self._require_fit()
        prior = self._resolve_prior(prior_precision)
        scale = self._scale(sigma_noise)
        log_det_prior = (self._module_sizes() * prior.log()).sum()
        scatter = (self._module_sq_norms() * prior).sum()
        return gaussian_log_marglik(
            self.log_likelihood(sigma_noise), self._log_det(prior, scale), log_det_prior, scatter
        )

    @overload
    def optimize_prior_precision(
        self,
        method: str = ...,
        *,
        optimizer: Literal["grid"] = ...,
        val_loader: Iterable[Any] | None = ...,
        grid: Tensor | Sequence[float] | None = ...,
    ) -> float: ...

    @overload
    def optimize_prior_precision(
        self,
        method: Literal["marglik"] = ...,
        *,
        optimizer: Literal["gradient"],
        init_prior_precision: PriorSpec | None = ...,
        fit_sigma_noise: bool | None = ...,
        per_module: bool | None = ...,
        lr: float | None = ...,
        max_steps: int | None = ...,
        tol: float | None = ...,
    ) -> MarglikFit: ...

    @overload
    def optimize_prior_precision(
        self,
        method: str = ...,
        *,
        optimizer: str,
        val_loader: Iterable[Any] | None = ...,
        grid: Tensor | Sequence[float] | None = ...,
        init_prior_precision: PriorSpec | None = ...,
        fit_sigma_noise: bool | None = ...,
        per_module: bool | None = ...,
        lr: float | None = ...,
        max_steps: int | None = ...,
        tol: float | None = ...,
    ) -> float | MarglikFit: ...

    def optimize_prior_precision(
        self,
        method: str = "marglik",
        *,
        optimizer: str = "grid",
        val_loader: Iterable[Any] | None = None,
        grid: Tensor | Sequence[float] | None = None,
        init_prior_precision: PriorSpec | None = None,
        fit_sigma_noise: bool | None = None,
        per_module: bool | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
        tol: float | None = None,
    ) -> float | MarglikFit:
        """Choose the prior precision (a scalar on a grid, or one per module by gradient ascent) and set it.

        Two optimizers:

        * ``"grid"`` (default): one scalar prior for every module, the best of ``grid``. Each candidate
          costs one evidence evaluation (``method="marglik"``) or one linearised predictive per validation
          batch and candidate, with the Jacobians shared (``method="val_nll"``).
        * ``"gradient"`` (``method="marglik"`` only): Adam on ``log δ_m``, one prior per module (or one
          shared value with ``per_module=False``), and on ``log σ`` for regression, until the evidence is
          stationary: every scaled gradient (``|∂L/∂log δ_m| / d_m`` with ``d_m`` the module's entries,
          ``|∂L/∂log σ| / (N C)``) is at most ``tol``. Each step is one evidence evaluation and its
          gradient (no data pass). Not converging within ``max_steps`` warns and returns
          ``converged=False``; the last values are set anyway.

        Args:
            method: ``"marglik"`` (maximise `log_marginal_likelihood`) or ``"val_nll"`` (minimise the NLL of
                the linearised probit predictive, or of the Gaussian predictive for regression, on
                ``val_loader``).
            optimizer: ``"grid"`` or ``"gradient"``.
            val_loader: Validation batches (``method="val_nll"`` only).
            grid: Candidate values of the grid, default ``torch.logspace(-1, 3, 21)``.
            init_prior_precision: Gradient start (scalar, per module tensor or dict); default the current
                prior precision.
            fit_sigma_noise: Also fit ``σ`` (gradient; default: for regression). The fitted value becomes
                ``sigma_noise``; the curvature is rescaled by ``σ_fit² / σ²``.
            per_module: One prior precision per module (gradient; default ``True``) or one shared value.
            lr: Adam step size on the log scale (gradient; default 0.1).
            max_steps: Most Adam steps (gradient; default 1000).
            tol: Stationarity tolerance on the scaled gradients (gradient; default 1e-4).

        Returns:
            ``"grid"``: the chosen scalar prior precision. ``"gradient"``: a `MarglikFit` with the prior
            precision per module, the fitted ``σ`` (or ``None``), the evidence, the steps taken, whether it
            converged and the evidence history. Either way the values are also stored on the posterior.

        Raises:
            ValueError: On a bad ``method`` / ``optimizer`` / ``grid``, gradient options (non-positive
                start, ``lr``, ``tol`` or ``max_steps``; ``fit_sigma_noise`` for classification; a
                non-finite evidence), and (``"val_nll"``) an empty ``val_loader`` or labels of the wrong
                dtype / shape or out of range (naming the batch).
        """
        self._require_fit()
        if optimizer not in ("grid", "gradient"):
            raise ValueError(f"optimizer must be 'grid' or 'gradient', got {optimizer!r}")
        if optimizer == "gradient":
            if method != "marglik":
                raise ValueError(
                    f"optimizer='gradient' needs method='marglik' (got {method!r}); "
                    "method='val_nll' is offered on a grid"
                )
            if val_loader is not None or grid is not None:
                raise ValueError("val_loader and grid are not used with optimizer='gradient'")
            options = {"per_module": per_module, "lr": lr, "max_steps": max_steps, "tol": tol}
            return gradient_marglik(
                self,
                init_prior_precision=init_prior_precision,
                fit_sigma_noise=fit_sigma_noise,
                **{k: v for k, v in options.items() if v is not None},
            )
        gradient_only = {
            "init_prior_precision": init_prior_precision,
            "fit_sigma_noise": fit_sigma_noise,
            "per_module": per_module,
            "lr": lr,
            "max_steps": max_steps,
            "tol": tol,
        }
        given = [k for k, v in gradient_only.items() if v is not None]
        if given:
            raise ValueError(f"{given} are options of optimizer='gradient', not of the grid")
        return self._grid_prior_precision(method, val_loader, grid)

    def _grid_prior_precision(
        self,
        method: str,
        val_loader: Iterable[Any] | None,
        grid: Tensor | Sequence[float] | None,
    ) -> float:
        """The grid search of `optimize_prior_precision` (one scalar prior for every module)."""
        if grid is None:
            values = torch.logspace(-1, 3, 21, dtype=torch.float64)
        elif isinstance(grid, Tensor):
            values = grid.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        else:  # Python floats straight to float64 (as_tensor would round them to float32 first)
            values = torch.tensor(list(grid), dtype=torch.float64).reshape(-1)
        if values.numel() == 0 or not bool(((values > 0) & torch.isfinite(values)).all()):
            raise ValueError(f"grid must hold positive finite values, got {values.tolist()}")
        if method == "marglik":
            if val_loader is not None:
                raise ValueError("val_loader is only used with method='val_nll'")
            with torch.no_grad():
                scores = torch.stack(
                    [self.log_marginal_likelihood(prior_precision=float(v)) for v in values]
                )
            best = int(torch.argmax(scores))
        elif method == "val_nll":
            if val_loader is None:
                raise ValueError("method='val_nll' needs val_loader")
            best = int(torch.argmin(self.grid_val_nll(val_loader, values)))
        else:
            raise ValueError(f"method must be 'marglik' or 'val_nll', got {method!r}")
        chosen = float(values[best])
        self.prior_precision = chosen
        return chosen

    def grid_val_nll(self, val_loader: Iterable[Any], grid: Tensor) -> Tensor:
        """Mean validation NLL of the linearised predictive for each scalar prior precision in ``grid``.

        Classification scores the probit predictive (``partialbayes.predictive.probit``), regression the
        Gaussian predictive with the observation noise (``gaussian_predictive``). Jacobians are computed
        once per batch and reused for every grid value. Token-level outputs count one example per kept
        position.

        Returns:
            ``[len(grid)]`` mean NLL per example.

        Raises:
            ValueError: On an empty ``val_loader``, a batch without labels, or labels of the wrong dtype /
                shape or out of range (naming the batch).
        """
        self._require_fit()
        totals = torch.zeros(len(grid), dtype=torch.float64)
        count = 0
        priors = [self._resolve_prior(float(v)) for v in grid]
        scale = self._scale(None)
        with torch.no_grad():
            for batch_index, batch in enumerate(val_loader):
                inputs, outputs = self._read(batch)
                with torch.enable_grad():
                    logits, keep, covs = self._mean_covs(inputs, outputs, priors, scale)
                f = output_rows(logits, keep).to(self.dtype)
                labels = outputs.targets(logits, keep)
                if labels is None:
                    raise ValueError(
                        f"batch {batch_index}: val_loader batches need labels to score the predictive"
                    )
                labels = check_labels(labels, f, self.likelihood, batch_index)
                for i, cov in enumerate(covs):
                    cov = cov.to(self.dtype)
                    if self.likelihood == "classification":
                        score = nll(probit(f, cov), labels, reduction="sum")
                    else:
                        mean, var = gaussian_predictive(
                            f, cov.diagonal(dim1=-2, dim2=-1), self.sigma_noise**2
                        )
                        score = gaussian_nll(mean, var, labels.to(f.dtype), reduction="sum")
                    totals[i] += float(score)
                count += f.shape[0]
        if count == 0:
            raise ValueError("val_loader is empty")
        return totals / count

    # ------------------------------------------------------------------ samples
    def sample(
        self,
        n: int = 1,
        *args: torch.Generator | None,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """Draw weight samples ``θ ~ N(θ*, P⁻¹)`` of the subset.

        Args:
            n: Number of samples.
            *args: Deprecated: the generator given positionally (``sample(n, gen)``); pass
                ``generator=gen`` instead. Still accepted, with a ``DeprecationWarning``, for one minor
                version.
            generator: Source of randomness (on the model's device or the CPU); same seed, same samples.

        Returns:
            ``{param name: [n, k]}`` with the ``k`` entries of each parameter in ``subset.gather`` order,
            parameters in ``subset.names`` order.

        Raises:
            ValueError: If ``n`` is not a positive int.
            TypeError: If the generator is given twice or more than one extra positional argument.
        """
        generator = _generator_argument("sample", args, generator)
        self._require_fit()
        n = check_count("n", n)
        centered = self._sample_centered(n, generator)
        return {name: self._map[name] + centered[name] for name in self.subset.names}

    def _noise(self, shape: Sequence[int], generator: torch.Generator | None) -> Tensor:
        device = generator.device if generator is not None else self.device
        eps = torch.randn(*shape, generator=generator, dtype=self.dtype, device=device)
        return eps.to(self.device)

    @contextmanager
    def swapped(self, sample: Mapping[str, Tensor]) -> Iterator[nn.Module]:
        """Write one weight sample into the model; restore the MAP weights on exit, even on error.

        Args:
            sample: ``{param name: [k]}`` (or ``[1, k]``) for every parameter of the subset, e.g. one row of
                `sample`.

        Yields:
            The model, carrying the sample.
        """
        self._require_fit()
        missing = [n for n in self.subset.names if n not in sample]
        extra = [n for n in sample if n not in self.subset.names]
        if missing or extra:
            raise ValueError(
                f"sample must cover the subset exactly; missing {missing}, unknown {extra}"
            )
        params = dict(self.model.named_parameters())
        try:
            with torch.no_grad():
                for name in self.subset.names:
                    values = sample[name].reshape(-1)
                    p = params[name]
                    p.copy_(self.subset.scatter(name, values, p.detach()))
            yield self.model
        finally:
            with torch.no_grad():
                for name in self.subset.names:
                    p = params[name]
                    p.copy_(self.subset.scatter(name, self._map[name], p.detach()))

    @contextmanager
    def sampled(
        self, *args: torch.Generator | None, generator: torch.Generator | None = None
    ) -> Iterator[nn.Module]:
        """Draw one sample and swap it into the model (see `swapped`); the MAP is restored on exit.

        Args:
            *args: Deprecated: the generator given positionally; pass ``generator=`` (a
                ``DeprecationWarning`` for one minor version).
            generator: Source of randomness.

        Yields:
            The model, carrying the sample.
        """
        generator = _generator_argument("sampled", args, generator)
        one = {k: v[0] for k, v in self.sample(1, generator=generator).items()}
        with self.swapped(one) as model:
            yield model

    # ------------------------------------------------------------------ predictive
    def _linearised(
        self, batch: Any, chunk_size: int | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(logits [B, C] | [B, T, C], keep [B, T] | None, Σ_f [N, C, C])`` of one batch at the prior."""
        self._require_fit()
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        inputs, outputs = self._read(batch)
        logits, keeps, covs = [], [], []
        for part, part_outputs in split_chunks(inputs, outputs, chunk_size):
            f, keep, (cov,) = self._mean_covs(part, part_outputs, [self._prior], self._scale(None))
            logits.append(f.detach())
            keeps.append(keep)
            covs.append(cov.to(self.dtype))
        keep_all = None if keeps[0] is None else torch.cat([k for k in keeps if k is not None])
        return torch.cat(logits), keep_all, torch.cat(covs)

    def logit_mean_cov(self, batch: Any, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
        """Linearised predictive: ``f_MAP`` and the functional covariance ``J Σ Jᵀ`` per output.

        Args:
            batch: A tensor ``x``, a pair ``(inputs, labels)`` or a mapping batch (``dict``,
                ``BatchEncoding``). Label values are ignored; for token-level outputs labels of -100 (and
                an attention mask of 0) mark the positions that are skipped.
            chunk_size: Process at most this many examples at a time (bounds the memory of the recorded
                activations and output gradients); ``None`` = the whole batch at once.

        Returns:
            ``(f [N, C], Σ_f [N, C, C])`` in the dtype of the logits: ``N = B`` for ``[B, C]`` logits; for
            token-level logits ``[B, T, C]`` the ``N`` kept positions in row-major ``(b, t)`` order (as
            ``partialbayes.predictive.flatten_outputs`` orders them). Each kept position costs ``C``
            backward passes and a ``[C, C]`` covariance: with a large vocabulary, keep only the positions
            you need (labels -100 elsewhere) or use `predictive_samples` on few positions.

        Raises:
            TypeError: A batch of an unknown kind (the message names its type and the accepted ones).
            ValueError: Token-level logits with neither an attention mask nor labels.
        """
        logits, keep, cov = self._linearised(batch, chunk_size)
        f = output_rows(logits, keep)
        return f, cov.to(f.dtype)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The linearised predictive of a batch, at the model's output shape.

        The logits are linearised around the MAP, ``f ~ N(f_MAP, Σ_f)`` with ``Σ_f = J Σ Jᵀ`` (see
        `logit_mean_cov`), and integrated against the likelihood with
        ``partialbayes.predictive``'s approximations.

        Args:
            batch: A tensor ``x``, a pair ``(inputs, labels)`` or a mapping batch (``dict``,
                ``BatchEncoding``); label values are ignored (for token-level outputs, -100 marks a
                position to skip).
            link: Classification: ``"probit"`` (default; ``softmax(κ ⊙ f_MAP)`` with
                ``κ_c = (1 + π/8 Σ_f,cc)^(-1/2)``), ``"mc"`` (``n_samples`` draws of ``f``, averaged
                softmax) or ``"bridge"`` (the Laplace bridge). Regression: every link gives the closed-form
                Gaussian predictive.
            n_samples: Draws for ``link="mc"``.
            generator: Source of randomness for ``link="mc"`` (on the model's device); same seed, same
                result.

        Returns:
            Classification: probabilities with the logits' shape and dtype, ``[B, C]`` or ``[B, T, C]``.
            Regression: ``(mean, variance)`` of a new target, each ``[B, C]`` (or ``[B, T, C]``); the
            variance is ``diag Σ_f + σ²``, the observation noise included. Token-level positions that are
            skipped (attention mask 0, label -100) hold the MAP prediction: ``softmax(f_MAP)``, or
            ``(f_MAP, σ²)``; never NaN.

        Raises:
            ValueError: A link the posterior does not offer (the message lists `links`), a bad
                ``n_samples``, token-level logits with neither an attention mask nor labels.
            TypeError: A batch of an unknown kind.
        """
        link = resolve_link(link, self.links, type(self).__name__)
        n_samples = check_count("n_samples", n_samples)
        logits, keep, cov = self._linearised(batch)
        if self.likelihood == "regression":
            return regression_predictive(logits, keep, cov, self.sigma_noise**2)
        return classification_predictive(
            logits, keep, cov, link=link, n_samples=n_samples, generator=generator
        )

    def predictive_samples(
        self, batch: Any, n: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``n`` draws of the linearised logits ``f ~ N(f_MAP, Σ_f)`` for a batch.

        The input of ``partialbayes.predictive``'s uncertainty decomposition. Outputs are drawn
        independently of each other (``Σ_f`` is per output); regression draws the function, without the
        observation noise. Token-level positions that are skipped hold ``f_MAP``.

        Args:
            batch: Any accepted batch (label values are ignored).
            n: Number of draws.
            generator: Source of randomness (on the model's device).

        Returns:
            ``[n, B, C]`` (or ``[n, B, T, C]``) in the logits' dtype.
        """
        n = check_count("n", n)
        logits, keep, cov = self._linearised(batch)
        return linearised_logit_samples(logits, keep, cov, n, generator=generator)

    # ------------------------------------------------------------------ size, summary, io
    @property
    def num_floats(self) -> int:
        """Floats stored for the posterior covariance (curvature representation; MAP excluded)."""
        self._require_fit()
        return sum(t.numel() for t in self._curvature_state().values())

    def summary(self) -> str:
        """A readable table: module, stored structure, floats; with totals."""
        self._require_fit()
        rows = self._summary_rows()
        width = max([len("module"), *(len(m) for m, _, _ in rows)])
        lines = [
            f"{type(self).__name__}: {len(self.modules)} modules, {self.subset.num_entries()} parameters, "
            f"likelihood={self.likelihood}, fisher={self.fisher}, T={self.temperature:g}, N={self.n_data}",
            f"{'module'.ljust(width)}  {'structure':<40}  floats",
        ]
        lines += [f"{m.ljust(width)}  {s:<40}  {f}" for m, s, f in rows]
        lines.append(f"{'total'.ljust(width)}  {'':<40}  {self.num_floats}")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save to one ``.safetensors`` file (tensors) with JSON metadata (options, subset, model structure)."""
        save_posterior(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> LaplaceBase:
        """Load a posterior saved with `save` onto ``model``.

        ``LaplaceBase.load`` loads whichever posterior class the file holds.

        Raises:
            ValueError: If ``model``'s parameter names / shapes or the saved subset do not match, or the file
                holds another posterior type than ``cls``.
        """
        post: LaplaceBase = load_posterior(path, model, cls)
        return post

    def __repr__(self) -> str:
        state = f"{self.num_floats} floats" if self._fitted else "not fitted"
        return f"{type(self).__name__}({len(self.modules)} modules, {state})"


def _generator_argument(
    method: str, args: tuple[Any, ...], generator: torch.Generator | None
) -> torch.Generator | None:
    """The generator of `sample` / `sampled`, accepting the deprecated positional form with a warning."""
    if not args:
        return generator
    if len(args) > 1 or generator is not None:
        raise TypeError(
            f"{method}() takes the generator once, as the keyword generator=; got {len(args)} extra "
            f"positional argument(s){' and generator=' if generator is not None else ''}"
        )
    warnings.warn(
        f"passing the generator to {method}() positionally is deprecated and will be removed in the "
        f"next minor version; use {method}(..., generator=...)",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
    return args[0]
