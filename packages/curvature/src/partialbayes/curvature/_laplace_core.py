"""The state every Laplace posterior holds and the hooks a curvature representation implements; fitting.

Conventions (DESIGN): the log-likelihood is summed over the N training examples, the curvature ``H`` is the
summed GGN / Fisher of the subset's entries, and the posterior precision is ``P = H / T + P₀`` with
``P₀ = diag(δ_m)`` (one prior precision per module, or one scalar) and prior mean 0.

A subclass stores one curvature representation (Kronecker eigenbases, a diagonal, a dense matrix) and
implements the small hooks marked "subclass" below. What is built on them lives by concern:
``_laplace_evidence`` (evidence and prior tuning), ``_laplace_sampling`` (samples and swapping),
``_laplace_predict`` (the linearised predictive); ``_laplace_base.LaplaceBase`` puts them together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import BatchObserver
from partialbayes.curvature._laplace_data import MapLoss
from partialbayes.curvature._likelihood import (
    FISHERS,
    LIKELIHOODS,
    check_dtype,
    check_num_classes,
)
from partialbayes.curvature._outputs import Outputs, read_batch, resolve_shift_labels
from partialbayes.curvature._prior import PriorSpec, check_positive, prior_vector
from partialbayes.predictive import check_generator, eval_mode
from partialbayes.selection import Subset

_Posterior = TypeVar("_Posterior", bound="LaplaceCore")


def owner_module(param_name: str) -> str:
    """Module owning a parameter: ``"a.b.weight" -> "a.b"`` (``""`` for a top-level parameter)."""
    return param_name.rpartition(".")[0]


class LaplaceCore:
    """State, subclass hooks, prior and fitting of a Laplace posterior (the constructor of `LaplaceBase`).

    See `LaplaceBase` for the arguments.
    """

    model: nn.Module
    subset: Subset
    likelihood: str
    temperature: float
    sigma_noise: float
    fisher: str
    mc_samples: int
    num_classes: int | None
    dtype: torch.dtype
    shift_labels: bool
    device: torch.device
    #: Prior groups (modules), in the order of `prior_precision`.
    modules: tuple[str, ...]
    n_data: int
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
        check_dtype(dtype)
        check_num_classes(num_classes)
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
        self.modules = self._module_names()
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
        self: _Posterior,
        loader: Iterable[Any],
        *,
        progress: bool = False,
        generator: torch.Generator | None = None,
    ) -> _Posterior:
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
        check_generator(generator)
        loss = MapLoss(self.likelihood)
        curvature = self._compute_curvature(
            loader, self._curvature_options(progress, generator, loss)
        )
        total, n, n_out = loss.result(self.device)
        return self.fit_curvature(curvature, map_loss=total, n_data=n, n_outputs=n_out)

    def fit_curvature(
        self: _Posterior, curvature: Any, *, map_loss: float, n_data: int, n_outputs: int
    ) -> _Posterior:
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
