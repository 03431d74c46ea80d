"""The SWAG posterior on a stochastic subset: collect snapshots, draw samples, swap them into the model."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.predictive import sampled_logits, sampled_predict
from partialbayes.predictive.internal import (
    check_generator,
    check_int,
    check_likelihood,
    read_posterior_file,
    resolve_link,
    write_posterior_file,
)
from partialbayes.selection import Subset
from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._moments import (
    diagonal_variance,
    ring_append,
    ring_ordered,
    update_moments_,
)
from partialbayes.swag._sample import swag_sample

FORMAT, VERSION = "partialbayes.swag.SWAG", 2
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "subset": str,
    "max_rank": int,
    "diagonal_only": bool,
    "n_snapshots": int,
    "dtype": str,
    "likelihood": str,
    "sigma_noise": (int, float),
}


#: A SWAG whose median σ is below this fraction of its median |w̄| is warned about (`SWAG.warn_if_negligible`):
#: samples that move the weights by less than 0.1 % leave the predictive at the MAP's to about 3 decimals.
NEGLIGIBLE_SPREAD = 1e-3


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
        ValueError: If the subset does not match the model, is empty, or its parameters are on the ``meta``
            device, ``max_rank < 2`` with the low-rank part, or the likelihood or noise is invalid.
    """

    links: ClassVar[tuple[str, ...]] = ("mc",)

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        *,
        max_rank: int = 20,
        diagonal_only: bool = False,
        dtype: torch.dtype | None = None,
        likelihood: str = "classification",
        sigma_noise: float = 1.0,
    ) -> None:
        if check_int("max_rank", max_rank, "[0, inf)") < 2 and not diagonal_only:
            raise ValueError(
                f"max_rank must be >= 2 for the low-rank part of SWAG, got {max_rank} "
                "(use diagonal_only=True for SWAG-Diag)"
            )
        self.sigma_noise = check_likelihood(likelihood, sigma_noise)
        self.layout = FlatLayout.from_subset(subset)
        params = subset.parameters_of(model)
        self.subset, self.model = subset, model
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

    def spread(self) -> tuple[float, float]:
        """``(median σ, median |w̄|)`` over the stochastic entries: spread against the weights' size.

        ``σ`` is a sample's standard deviation per entry, from the diagonal of the sampling covariance
        ``½ Σ_diag + D Dᵀ / (2(k−1))`` (``Σ_diag`` alone for SWAG-Diag).
        """
        self._require_snapshots(1 if self.diagonal_only else 2)
        var, dev = self.variance, self.deviations
        if dev is not None:
            var = 0.5 * var + dev.square().sum(1) / (2 * (dev.shape[1] - 1))
        return float(var.sqrt().median()), float(self._mean.abs().median())

    def summary(self) -> str:
        """What was collected, what it stores, and how wide the posterior is against the weights."""
        kind = "SWAG-Diag" if self.diagonal_only else f"SWAG (rank K={self.max_rank})"
        head = (
            f"{kind}: {self.num_entries} stochastic entries of {len(self.layout.names)} parameters, "
            f"{self.n_snapshots} snapshots, {self.num_floats} floats ({self.dtype})"
        )
        if self.n_snapshots < (1 if self.diagonal_only else 2):
            return f"{head}; too few snapshots to sample"
        sigma, size = self.spread()
        return f"{head}\nspread: median σ {sigma:.3g}, median |w| {size:.3g} (ratio {sigma / max(size, 1e-30):.2g})"

    def warn_if_negligible(self, where: str) -> None:
        """Warn when a sample's spread is below ``NEGLIGIBLE_SPREAD`` of the weights' size (median σ / median |w̄|).

        Such a posterior predicts as its mean does: the learning rate was too small (or the snapshots too few)
        for the weights to move.
        """
        if self.n_snapshots < (1 if self.diagonal_only else 2):
            return
        sigma, size = self.spread()
        if sigma < NEGLIGIBLE_SPREAD * size:
            warnings.warn(
                f"{where}: the SWAG spread is negligible (median σ {sigma:.2g} against median |w| "
                f"{size:.2g}): its predictive will equal the MAP's. Collect at a larger learning rate "
                "(sweep_learning_rate; the paper sweeps 1e-3 to 1e-1) or over more steps",
                RuntimeWarning,
                stacklevel=3,
            )

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
        params = self.subset.parameters_of(self.model if model is None else model)
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
        params = self.subset.parameters_of(self.model if model is None else model)
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

    def sample(
        self, n: int = 1, *, scale: float = 1.0, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """``n`` weight samples ``{param name: [n, k]}`` (``Subset.gather`` order, the protocol's layout).

        The samples are ``w = w_swa + √scale (Σ_diag^½ z₁ / √2 + D z₂ / √(2(k−1)))`` (see `swag_sample`),
        drawn with one call on the flat vector, so ``sample(n, generator=g)`` equals
        ``unflatten(sample_flat(n, generator=g))``.

        Args:
            n: Number of samples.
            scale: Covariance scale (SWAG-specific; ``1`` is plain SWAG).
            generator: Source of randomness (same generator state, same samples).

        Returns:
            ``{param name: [n, k]}`` on the model's device.

        Raises:
            ValueError: Before any snapshot, with fewer than two snapshots and the low-rank part, or if
                ``n`` is not a positive int.
        """
        check_int("n", n)
        return self.layout.unflatten(self.sample_flat(n, scale=scale, generator=generator))

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split a flat vector ``(..., d)`` into per-parameter entry vectors (``Subset.gather`` order)."""
        return self.layout.unflatten(flat)

    def flatten(self, sample: Mapping[str, Tensor]) -> Tensor:
        """Concatenate one sample ``{param name: [k]}`` into the flat vector ``(d,)`` (inverse of `unflatten`).

        Raises:
            ValueError: If the sample does not cover the subset exactly or has the wrong sizes.
        """
        one = self.subset.check_values(sample)
        return torch.cat([one[n].to(self.device, self.dtype) for n in self.layout.names])

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into ``self.model``; restore what was there on exit.

        The values present on entry come back even when the body raises (``Subset.swapped``), so nested
        swaps unwind correctly. Entries outside the subset are never touched. A flat vector ``w`` of shape
        ``(d,)`` goes in as ``swag.swapped(swag.unflatten(w))``.

        Args:
            sample: One row of `sample`, ``{param name: [k]}`` (``[1, k]`` also accepted).

        Returns:
            A context manager yielding the model.

        Raises:
            TypeError: If ``sample`` is a flat tensor (say ``swapped(unflatten(w))``) or not a mapping.
            ValueError: If the sample does not cover the subset exactly, has the wrong sizes or NaN / inf
                entries (the model is left untouched).
        """
        if isinstance(sample, Tensor):
            raise TypeError(
                f"swapped takes one sample {{param name: [k]}}, got a tensor of shape "
                f"{tuple(sample.shape)}; for a flat vector w use swag.swapped(swag.unflatten(w))"
            )
        return self.subset.swapped(self.model, sample)

    def sampled(
        self, *, scale: float = 1.0, generator: torch.Generator | None = None
    ) -> AbstractContextManager[nn.Module]:
        """Swap one SWAG sample into ``self.model``; its weights come back on exit, also on error.

        Example:
            >>> with swag.sampled(generator=g) as m:  # doctest: +SKIP
            ...     logits = m(**inputs).logits

        Args:
            scale: Covariance scale of the sample.
            generator: Source of randomness.

        Returns:
            A context manager yielding the model.
        """
        w = self.sample_flat(scale=scale, generator=generator)
        return self.subset.swapped(self.model, self.layout.unflatten(w))

    # ------------------------------------------------------------- predictive
    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        target_ids: Sequence[int] | Tensor | None = None,
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
            target_ids: Answer-only: the ``K`` answer tokens' distribution at the answer positions (the
                labelled ones, shifted for a causal LM), renormalised over them, ``[P, K]``
                (``partialbayes.predictive.sampled_predict``).

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
            sample_ctx=lambda s: self.sampled(scale=scale, generator=generator),
            regression=self.likelihood == "regression",
            noise_var=self.sigma_noise**2,
            target_ids=target_ids,
        )

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """Logits under ``n`` weight samples, ``[n, B, C]`` (or ``[n, B, T, C]``; ``[n, P, K]`` answer-only)."""
        sample_ctx = lambda s: self.sampled(scale=scale, generator=generator)  # noqa: E731
        return sampled_logits(self, batch, n, sample_ctx=sample_ctx, target_ids=target_ids)

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike[str]) -> None:
        """Save to one safetensors file (``partialbayes.predictive.internal.write_posterior_file``, atomic).

        The tensors are ``mean``, ``sq_mean`` and, for the low-rank variant, ``deviations`` (``(d, k)``,
        oldest column first). The metadata (format ``partialbayes.swag.SWAG``, version 2) records the
        model's structure, the subset (``Subset.to_json``), ``max_rank``, ``diagonal_only``,
        ``n_snapshots``, the dtype, the likelihood and ``sigma_noise``.

        Raises:
            ValueError: If no snapshot has been collected, or ``path`` is a folder.
        """
        self._require_snapshots(1)
        tensors = {"mean": self._mean, "sq_mean": self._sq_mean}
        if self.deviations is not None:
            tensors["deviations"] = self.deviations
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "subset": self.subset.to_json(),
            "max_rank": self.max_rank,
            "diagonal_only": self.diagonal_only,
            "n_snapshots": self.n_snapshots,
            "dtype": str(self.dtype).removeprefix("torch."),
            "likelihood": self.likelihood,
            "sigma_noise": self.sigma_noise,
        }
        write_posterior_file(path, tensors, meta, model=self.model)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], model: nn.Module, subset: Subset | None = None
    ) -> SWAG:
        """Load a SWAG saved by `save` onto ``model``.

        Args:
            path: The safetensors file.
            model: The model the posterior belongs to (same parameter names and shapes as when saved).
            subset: Optional ``Subset``; when given it must select exactly the saved entries. By default the
                saved subset is rebuilt with ``Subset.from_json(..., model)``.

        Returns:
            The SWAG posterior, on the model's device (moments saved in half precision come back in float32).

        Raises:
            FileNotFoundError: If there is no file at ``path``.
            ValueError: Naming the file: not a SWAG file of this version (garbage, truncated, an earlier
                format: re-save it), metadata that lacks or mistypes a field, a missing tensor, a tensor of
                the wrong shape or with NaN / inf entries, a model or ``subset`` that does not match.
        """
        file = read_posterior_file(path, formats=FORMAT, version=VERSION, fields=_FIELDS)
        file.check_model(model)
        try:
            saved = Subset.from_json(file.meta["subset"], model)
        except (TypeError, ValueError) as err:
            raise file.error(f"the saved subset does not fit the model: {err}") from err
        if subset is not None and not FlatLayout.from_subset(subset).same_entries(
            FlatLayout.from_subset(saved)
        ):
            raise file.error("subset does not match the saved SWAG: it selects different entries")
        n = file.meta["n_snapshots"]
        if n < 1:
            raise file.error(f"n_snapshots={n} (must be >= 1)")
        try:
            swag = cls(
                model,
                saved if subset is None else subset,
                max_rank=file.meta["max_rank"],
                diagonal_only=file.meta["diagonal_only"],
                dtype=torch.promote_types(file.dtype(), torch.float32),
                likelihood=file.meta["likelihood"],
                sigma_noise=file.meta["sigma_noise"],
            )
        except (TypeError, ValueError) as err:
            raise file.error(f"invalid SWAG settings: {err}") from err
        d = swag.num_entries
        mean, sq_mean = file.tensor("mean", (d,)), file.tensor("sq_mean", (d,))
        dev = None if swag.diagonal_only else file.tensor("deviations")
        if dev is not None and (
            dev.ndim != 2 or dev.shape[0] != d or dev.shape[1] > min(n, swag.max_rank)
        ):
            raise file.error(
                f"tensor 'deviations' has shape {tuple(dev.shape)}, expected ({d}, k) with "
                f"k <= {min(n, swag.max_rank)}"
            )
        swag._mean, swag._sq_mean = (t.to(swag.device, swag.dtype) for t in (mean, sq_mean))
        swag.n_snapshots = n
        if swag._buffer is not None and dev is not None:
            swag._buffer[: dev.shape[1]] = dev.T.to(swag.device, swag.dtype)
            swag._n_columns = dev.shape[1]
        return swag
