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
    check_dtype,
    check_generator,
    check_int,
    check_likelihood,
    check_number,
    read_posterior_file,
    resolve_link,
    write_posterior_file,
)
from partialbayes.selection import Subset
from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._moments import diagonal_variance, ring_append, ring_ordered, update_moments_
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

    A ``partialbayes.predictive.Posterior`` (link ``"mc"``). Only the ``d`` stochastic entries
    (``subset.gather`` order) are stored: running mean and mean of squares (``2d`` floats) and, unless
    ``diagonal_only``, the last ``max_rank`` deviation columns ``w_i − w̄_i`` (``K·d``), ``w̄_i`` the running
    mean after snapshot ``i``. Everything outside the subset stays at the MAP.

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
        self.dtype = check_dtype("dtype", dtype, " (the moments' dtype)")
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
        """Floats stored: ``(2 + K)·d``, or ``2d`` for the diagonal only (the layout's int64 positions not counted)."""
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
        """Deviation matrix ``D`` ``(d, min(n_snapshots, K))``, oldest column first; ``None`` for SWAG-Diag."""
        if self._buffer is None:
            return None
        return ring_ordered(self._buffer, self._n_columns)

    def spread(self) -> tuple[float, float]:
        """``(median σ, median |w̄|)``: a sample's standard deviation per entry against the weights' size."""
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
        """Warn when median σ is below ``NEGLIGIBLE_SPREAD`` of median |w̄|: the posterior predicts as its mean."""
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
        """Fold the current stochastic entries of ``model`` (default ``self.model``) in as one snapshot."""
        params = self.subset.parameters_of(self.model if model is None else model)
        w = self.layout.gather(params, dtype=self.dtype).to(self.device)
        if not bool(torch.isfinite(w).all()):
            bad = [n for n in self.layout.names if not bool(torch.isfinite(params[n]).all())]
            raise ValueError(f"snapshot {self.n_snapshots + 1} has non-finite entries in {bad}")
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
        """Draw samples of the stochastic entries as flat vectors ``(d,)`` (one) or ``(n_samples, d)``.

        Uses the ``k = min(n_snapshots, K)`` columns collected so far; ``scale`` multiplies the covariance
        (``0``: the SWA mean). ``swag.swapped(swag.unflatten(w))`` swaps a flat vector in.

        Raises:
            ValueError: Before any snapshot, or with fewer than two snapshots and the low-rank part.
            TypeError: If ``generator`` is not a ``torch.Generator``.
        """
        check_generator(generator)
        check_number("scale", scale, "[0, inf)")
        if n_samples is not None:
            check_int("n_samples", n_samples)
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
        """``n`` weight samples ``{param name: [n, k]}``: ``unflatten(sample_flat(n, scale=scale, generator=g))``.

        A sample is ``w = w_swa + √scale (Σ_diag^½ z₁ / √2 + D z₂ / √(2(k−1)))``.
        """
        check_int("n", n)
        return self.layout.unflatten(self.sample_flat(n, scale=scale, generator=generator))

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split a flat vector ``(..., d)`` into per-parameter entry vectors (``Subset.gather`` order)."""
        return self.layout.unflatten(flat)

    def flatten(self, sample: Mapping[str, Tensor]) -> Tensor:
        """Concatenate one sample ``{param name: [k]}`` into the flat vector ``(d,)`` (inverse of `unflatten`)."""
        one = self.subset.check_values(sample)
        return torch.cat([one[n].to(self.device, self.dtype) for n in self.layout.names])

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into ``self.model``; restore what was there on exit, even on error.

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
        """Swap one SWAG sample (covariance ``scale``) into ``self.model``; its weights come back on exit.

        Example:
            >>> with swag.sampled(generator=g) as m:  # doctest: +SKIP
            ...     logits = m(**inputs).logits
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
        """Monte Carlo predictive over ``n_samples`` weight samples (``partialbayes.predictive.sampled_predict``).

        Classification: ``(1/S) Σ_s softmax(f(x; w_s))`` of the logits' shape (token-level outputs include padded
        positions: keep the rows of ``partialbayes.predictive.kept_positions``). Regression: ``(mean, variance)``
        of the outputs, plus ``sigma_noise²``. ``link`` is ``"mc"`` only; ``scale`` is the covariance scale;
        ``target_ids`` gives the answer tokens' distribution at the answer positions, ``[P, K]``.
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
        """Save to one safetensors file, atomically: ``mean``, ``sq_mean``, ``deviations`` ``(d, k)`` and metadata.

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
        """Load a SWAG saved by `save` onto ``model`` (``subset``, if given, must select the saved entries).

        Moments saved in half precision come back in float32, on the model's device.

        Raises:
            FileNotFoundError: If there is no file at ``path``.
            ValueError: Naming the file: not a SWAG file of this version (re-save an earlier one), a missing or
                mistyped field or tensor, NaN / inf entries, a model or ``subset`` that does not match.
        """
        file = read_posterior_file(path, formats=FORMAT, version=VERSION, fields=_FIELDS)
        file.check_model(model)
        with file.reraised("the saved subset does not fit the model"):
            saved = Subset.from_json(file.meta["subset"], model)
        if subset is not None and not FlatLayout.from_subset(subset).same_entries(
            FlatLayout.from_subset(saved)
        ):
            raise file.error("subset does not match the saved SWAG: it selects different entries")
        with file.reraised("invalid SWAG settings"):
            n = check_int("n_snapshots", file.meta["n_snapshots"])
            swag = cls(
                model,
                saved if subset is None else subset,
                max_rank=file.meta["max_rank"],
                diagonal_only=file.meta["diagonal_only"],
                dtype=torch.promote_types(file.dtype(), torch.float32),
                likelihood=file.meta["likelihood"],
                sigma_noise=file.meta["sigma_noise"],
            )
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
