"""The SWAG posterior on a stochastic subset: collect snapshots, draw samples, swap them into the model."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, overload

import torch
from torch import Tensor, nn

from partialbayes.predictive import (
    check_count,
    check_generator,
    check_sample,
    resolve_link,
    sampled_logits,
    sampled_predict,
)
from partialbayes.swag._file import read_saved_swag, write_swag_file
from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._moments import (
    diagonal_variance,
    ring_append,
    ring_ordered,
    update_moments_,
)
from partialbayes.swag._sample import swag_sample

LIKELIHOODS = ("classification", "regression")
_UNSET: Any = object()


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"SWAG.{old} is deprecated and will be removed in partialbayes-swag 0.3; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


class SWAG:
    """SWAG (Maddox et al., 2019) restricted to the stochastic entries of a ``Subset``.

    Implements the ``partialbayes.predictive.Posterior`` protocol: `sample` gives ``{param name: [n, k]}``,
    `swapped` / `sampled` write samples into the model and restore its weights on exit (even on error),
    `predict` averages the softmax over weight samples (link ``"mc"``), `predictive_samples` stacks logit
    samples, `save` / `load` use safetensors + JSON.

    Only the ``d`` stochastic entries (``subset.gather`` order, parameters in model order) are stored: the
    running mean and mean of squares (``2d`` floats) and, unless ``diagonal_only``, the last ``max_rank``
    deviation columns ``w_i − w̄_i`` (``K·d`` floats), where ``w̄_i`` is the running mean after snapshot ``i``
    was folded in. Everything outside the subset stays at the MAP.

    Args:
        model: The model the subset belongs to (kept as ``self.model``); fixes the device and (by default)
            the dtype of the moments.
        subset: A ``partialbayes.selection.Subset`` of ``model``.
        max_rank: ``K``, the number of deviation columns kept (the paper: 20). Must be ``>= 2`` unless
            ``diagonal_only``.
        diagonal_only: Keep only the diagonal (SWAG-Diag).
        dtype: dtype of the stored moments, ``torch.float32`` or ``torch.float64`` (default: the dtype of
            the first stochastic parameter, float32 for a float16 / bfloat16 model). float64 reduces
            cancellation in ``sq_mean − mean²``.
        likelihood: ``"classification"`` (`predict` returns probabilities) or ``"regression"`` (`predict`
            returns the mean and variance of the outputs, plus ``sigma_noise²``).
        sigma_noise: Observation noise standard deviation σ of the regression likelihood.

    Raises:
        TypeError: If ``subset`` is not a ``Subset``, ``model`` not a module, or ``dtype`` not float32 /
            float64.
        ValueError: If the subset does not match the model, is empty, ``max_rank < 2`` with the low-rank
            part, or the likelihood or noise is invalid.
    """

    links: ClassVar[tuple[str, ...]] = ("mc",)

    def __init__(
        self,
        model: nn.Module,
        subset: Any,
        *,
        max_rank: int = 20,
        diagonal_only: bool = False,
        dtype: torch.dtype | None = None,
        likelihood: str = "classification",
        sigma_noise: float = 1.0,
    ) -> None:
        if isinstance(max_rank, bool) or not isinstance(max_rank, int):
            raise TypeError(f"max_rank must be an int, got {type(max_rank).__name__}")
        if not diagonal_only and max_rank < 2:
            raise ValueError(
                f"max_rank must be >= 2 for the low-rank part of SWAG, got {max_rank} "
                "(use diagonal_only=True for SWAG-Diag)"
            )
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
        if (
            isinstance(sigma_noise, bool)
            or not isinstance(sigma_noise, (int, float))
            or not math.isfinite(sigma_noise)
            or sigma_noise <= 0
        ):
            raise ValueError(f"sigma_noise must be a finite number > 0, got {sigma_noise!r}")
        self.subset = subset
        self.layout = FlatLayout.from_subset(subset)
        params = self.layout.parameters(model)
        self.model = model
        first = params[self.layout.names[0]]
        if dtype is None:  # half-precision models keep float32 moments (squares overflow float16)
            dtype = torch.promote_types(first.dtype, torch.float32)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"dtype must be torch.float32 or torch.float64 (the moments' dtype), got {dtype!r}"
            )
        self.dtype = dtype
        self.device = first.device
        self.layout = self.layout.to(self.device)
        self.max_rank = max_rank
        self.diagonal_only = diagonal_only
        self.likelihood = likelihood
        self.sigma_noise = float(sigma_noise)
        d = self.layout.size
        self.n_snapshots = 0
        self._mean = torch.zeros(d, dtype=self.dtype, device=self.device)
        self._sq_mean = torch.zeros(d, dtype=self.dtype, device=self.device)
        self._buffer: Tensor | None = (
            None
            if diagonal_only
            else torch.zeros(max_rank, d, dtype=self.dtype, device=self.device)
        )
        self._n_columns = 0

    # ------------------------------------------------------------------ state
    @property
    def num_entries(self) -> int:
        """Number ``d`` of stochastic entries."""
        return self.layout.size

    @property
    def num_floats(self) -> int:
        """Floats stored: ``(2 + K)·d``, or ``2d`` for the diagonal only.

        Not counted: the int64 positions of the ``d`` entries in their parameters (the flat layout).
        """
        return self.layout.size * (2 + (0 if self.diagonal_only else self.max_rank))

    @property
    def mean(self) -> Tensor:
        """SWA mean ``w_swa``, shape ``(d,)``; updated in place by `collect` (clone it to keep it)."""
        self._require_snapshots(1)
        return self._mean

    @property
    def sq_mean(self) -> Tensor:
        """Running mean of the squared snapshots, shape ``(d,)``."""
        self._require_snapshots(1)
        return self._sq_mean

    @property
    def variance(self) -> Tensor:
        """Diagonal variance ``Σ_diag = max(sq_mean − mean², 0)``, shape ``(d,)``."""
        return diagonal_variance(self.mean, self._sq_mean)

    @property
    def deviations(self) -> Tensor | None:
        """Deviation matrix ``D``, shape ``(d, k)`` with ``k = min(n_snapshots, K)`` columns, oldest first.

        ``None`` for diagonal-only SWAG.
        """
        if self._buffer is None:
            return None
        return ring_ordered(self._buffer, self._n_columns)

    def _require_snapshots(self, n: int) -> None:
        if self.n_snapshots < n:
            raise ValueError(
                f"SWAG has {self.n_snapshots} snapshot(s) but needs at least {n}: call collect() "
                "(or collect_swag) first"
            )

    # ------------------------------------------------------------- collecting
    def collect(self, model: nn.Module | None = None) -> None:
        """Fold the current stochastic entries of the model (default ``self.model``) in as one snapshot.

        Raises:
            ValueError: If the model does not match the subset or the entries are not finite.
        """
        params = self.layout.parameters(self.model if model is None else model)
        w = self.layout.gather(params, dtype=self.dtype).to(self.device)
        if not bool(torch.isfinite(w).all()):
            bad = [n for n in self.layout.names if not bool(torch.isfinite(params[n]).all())]
            raise ValueError(
                f"snapshot {self.n_snapshots + 1} has non-finite stochastic entries in {bad}"
            )
        update_moments_(self._mean, self._sq_mean, w, self.n_snapshots)
        self.n_snapshots += 1
        if self._buffer is not None:
            self._n_columns = ring_append(self._buffer, self._n_columns, w.sub_(self._mean))

    def current(self, model: nn.Module | None = None) -> Tensor:
        """The current stochastic entries of the model (default ``self.model``), ``(d,)``, moments' dtype."""
        params = self.layout.parameters(self.model if model is None else model)
        return self.layout.gather(params).to(self.device, self.dtype)

    # --------------------------------------------------------------- sampling
    def sample_flat(
        self,
        n_samples: int | None = None,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Draw samples of the stochastic entries as flat vectors (see `swag_sample`).

        Uses the ``k = min(n_snapshots, K)`` deviation columns collected so far. `unflatten` splits a flat
        vector per parameter; ``swag.swapped(swag.unflatten(w))`` swaps one in.

        Args:
            n_samples: Number of samples; ``None`` for one sample of shape ``(d,)``.
            scale: Covariance scale (``1`` is plain SWAG; ``0`` returns the SWA mean).
            generator: Source of randomness (same generator state, same sample).

        Returns:
            Shape ``(d,)`` or ``(n_samples, d)``.

        Raises:
            ValueError: Before any snapshot, or with fewer than two snapshots and the low-rank part.
            TypeError: If ``generator`` is not a ``torch.Generator``.
        """
        check_generator(generator)
        self._require_snapshots(1 if self.diagonal_only else 2)
        return swag_sample(
            self._mean,
            self.variance,
            self.deviations,
            n_samples=n_samples,
            scale=scale,
            generator=generator,
        )

    @overload
    def sample(
        self,
        n: int = 1,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]: ...

    @overload
    def sample(
        self,
        *,
        n_samples: int | None,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor: ...

    def sample(
        self,
        n: int = 1,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
        n_samples: Any = _UNSET,
    ) -> dict[str, Tensor] | Tensor:
        """``n`` weight samples ``{param name: [n, k]}`` (``Subset.gather`` order, the protocol's layout).

        The samples are ``w = w_swa + √scale (Σ_diag^½ z₁ / √2 + D z₂ / √(2(k−1)))`` (see `swag_sample`),
        drawn with one call on the flat vector, so ``sample(n, generator=g)`` equals
        ``unflatten(sample_flat(n, generator=g))``.

        Args:
            n: Number of samples.
            scale: Covariance scale (SWAG-specific; ``1`` is plain SWAG).
            generator: Source of randomness (same generator state, same samples).
            n_samples: Deprecated: ``sample(n_samples=...)`` returns flat vectors as before 0.2; use
                `sample_flat`.

        Returns:
            ``{param name: [n, k]}`` on the model's device.

        Raises:
            ValueError: Before any snapshot, with fewer than two snapshots and the low-rank part, or if
                ``n`` is not a positive int.
        """
        if n_samples is not _UNSET:
            _deprecated("sample(n_samples=...)", "SWAG.sample_flat(n_samples) for flat vectors")
            return self.sample_flat(n_samples, scale=scale, generator=generator)
        check_count("n", n)
        return self.layout.unflatten(self.sample_flat(n, scale=scale, generator=generator))

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split a flat vector ``(..., d)`` into per-parameter entry vectors (``Subset.gather`` order)."""
        return self.layout.unflatten(flat)

    def flatten(self, sample: Mapping[str, Tensor]) -> Tensor:
        """Concatenate one sample ``{param name: [k]}`` into the flat vector ``(d,)`` (inverse of `unflatten`).

        Raises:
            ValueError: If the sample does not cover the subset exactly or has the wrong sizes.
        """
        one = check_sample(self.subset, sample)
        return torch.cat([one[n].to(self.device, self.dtype) for n in self.layout.names])

    @contextmanager
    def _swap(self, model: nn.Module, flat: Tensor, yielded: Any) -> Iterator[Any]:
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(
                "the weights to swap in have NaN or inf entries: refusing to write them into the model"
            )
        params = self.layout.parameters(model)
        saved = self.layout.gather(params)
        self.layout.scatter_(params, flat)
        try:
            yield yielded
        finally:
            self.layout.scatter_(params, saved)

    def swapped(self, sample: Any, weights: Tensor | None = None) -> AbstractContextManager[Any]:
        """Write one sample ``{param name: [k]}`` into ``self.model``; restore the old values on exit.

        The values present on entry (the MAP) come back even when the body raises. Entries outside the
        subset are never touched. A flat vector ``w`` of shape ``(d,)`` goes in as
        ``swag.swapped(swag.unflatten(w))``.

        Args:
            sample: One row of `sample`, ``{param name: [k]}`` (``[1, k]`` also accepted).
            weights: Deprecated form ``swapped(model, weights)``: ``sample`` is then a model and ``weights`` a
                flat ``(d,)`` vector, and the context yields ``weights``.

        Returns:
            A context manager yielding the model.

        Raises:
            TypeError: If ``sample`` is a flat tensor (say ``swapped(unflatten(w))``) or not a mapping.
            ValueError: If the sample does not cover the subset exactly, has the wrong sizes or NaN / inf
                entries (the model is left untouched).
        """
        if isinstance(sample, nn.Module):
            if not isinstance(weights, Tensor):
                raise TypeError(
                    "the deprecated form is swapped(model, weights) with a flat (d,) tensor; the new form "
                    "is swapped(sample) with sample = {param name: [k]}"
                )
            _deprecated("swapped(model, weights)", "SWAG.swapped(swag.unflatten(weights))")
            return self._swap(sample, weights, weights)
        if weights is not None:
            raise TypeError("swapped(sample) takes one argument, {param name: [k]}")
        if isinstance(sample, Tensor):
            raise TypeError(
                f"swapped takes one sample {{param name: [k]}}, got a tensor of shape "
                f"{tuple(sample.shape)}; for a flat vector w use swag.swapped(swag.unflatten(w))"
            )
        return self._swap(self.model, self.flatten(sample), self.model)

    def sampled(
        self,
        model: nn.Module | None = None,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> AbstractContextManager[Any]:
        """Swap one SWAG sample into ``self.model``; its weights come back on exit, also on error.

        Example:
            >>> with swag.sampled(generator=g) as m:  # doctest: +SKIP
            ...     logits = m(**inputs).logits

        Args:
            model: Deprecated form ``sampled(model, ...)``: swap into ``model`` and yield the flat sample.
            scale: Covariance scale of the sample.
            generator: Source of randomness.

        Returns:
            A context manager yielding the model.
        """
        w = self.sample_flat(scale=scale, generator=generator)
        if model is not None:
            _deprecated("sampled(model, ...)", "SWAG.sampled(...), which yields swag.model")
            return self._swap(model, w, w)
        return self._swap(self.model, w, self.model)

    # ------------------------------------------------------------- predictive
    def _sample_ctx(
        self, scale: float, generator: torch.Generator | None
    ) -> Any:  # s -> context manager
        return lambda s: self.sampled(scale=scale, generator=generator)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Monte Carlo predictive over ``n_samples`` weight samples (eval mode, no gradients).

        Classification: ``(1/S) Σ_s softmax(f(x; w_s))``, probabilities of the logits' shape (``[B, C]``, or
        ``[B, T, C]`` for token-level outputs, where padded or ``-100`` positions are predicted too: drop
        them with ``partialbayes.predictive.flatten_outputs``). Regression: the mean of the outputs and
        their variance plus ``sigma_noise²``. One sample is held at a time.

        Args:
            batch: Any batch kind (tensor, ``(inputs, labels)``, dict / ``BatchEncoding``); labels ignored.
            link: ``"mc"`` (the only one).
            n_samples: Number of weight samples ``S``.
            generator: Source of randomness (same seed, same prediction).
            scale: Covariance scale of the samples.

        Returns:
            Probabilities, or ``(mean, variance)`` for regression.

        Raises:
            ValueError: For a link other than ``"mc"`` (the message lists the offered links).
        """
        resolve_link(link, self.links, "SWAG")
        return sampled_predict(
            self,
            batch,
            n_samples,
            sample_ctx=self._sample_ctx(scale, generator),
            regression=self.likelihood == "regression",
            noise_var=self.sigma_noise**2,
        )

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
    ) -> Tensor:
        """Logits under ``n`` weight samples, ``[n, B, C]`` (or ``[n, B, T, C]``); eval mode, no gradients."""
        return sampled_logits(self, batch, n, sample_ctx=self._sample_ctx(scale, generator))

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike[str]) -> None:
        """Save to one safetensors file with JSON metadata (see `save_swag`).

        Raises:
            ValueError: If no snapshot has been collected.
        """
        self._require_snapshots(1)
        tensors = {"mean": self.mean, "sq_mean": self.sq_mean}
        if self.deviations is not None:
            tensors["deviations"] = self.deviations
        meta = {
            "subset": self.subset.to_json(),
            "names": list(self.layout.names),
            "shapes": [list(s) for s in self.layout.shapes],
            "num_entries": self.num_entries,
            "max_rank": self.max_rank,
            "diagonal_only": self.diagonal_only,
            "n_snapshots": self.n_snapshots,
            "dtype": str(self.dtype).removeprefix("torch."),
            "likelihood": self.likelihood,
            "sigma_noise": self.sigma_noise,
        }
        write_swag_file(path, tensors, meta)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], model: nn.Module, subset: Any | None = None
    ) -> SWAG:
        """Load a saved SWAG onto ``model`` (see `load_swag`)."""
        subset, settings, tensors, n_snapshots = read_saved_swag(path, model, subset)
        swag = cls(model, subset, **settings)
        if swag.num_entries != tensors["mean"].shape[0]:
            raise ValueError(
                f"subset does not match the saved SWAG: {swag.num_entries} entries, saved "
                f"{tensors['mean'].shape[0]}"
            )
        swag._set_state(tensors["mean"], tensors["sq_mean"], tensors.get("deviations"), n_snapshots)
        return swag

    def _set_state(
        self, mean: Tensor, sq_mean: Tensor, deviations: Tensor | None, n_snapshots: int
    ) -> None:
        """Restore the state from saved tensors (``deviations`` shape ``(d, k)``, oldest first)."""
        self._mean = mean.to(self.device, self.dtype)
        self._sq_mean = sq_mean.to(self.device, self.dtype)
        self.n_snapshots = n_snapshots
        if self._buffer is not None and deviations is not None:
            k = deviations.shape[1]
            self._buffer.zero_()
            self._buffer[:k] = deviations.T.to(self.device, self.dtype)
            self._n_columns = k
