"""The SWAG posterior on a stochastic subset: collect snapshots, draw samples, swap them into a model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._moments import (
    diagonal_variance,
    ring_append,
    ring_ordered,
    update_moments_,
)
from partialbayes.swag._sample import swag_sample


class SWAG:
    """SWAG (Maddox et al., 2019) restricted to the stochastic entries of a ``Subset``.

    Only the ``d`` stochastic entries (``subset.gather`` order, parameters in model order) are stored: the
    running mean and mean of squares (``2d`` floats) and, unless ``diagonal_only``, the last ``max_rank``
    deviation columns ``w_i − w̄_i`` (``K·d`` floats), where ``w̄_i`` is the running mean after snapshot ``i``
    was folded in. Everything outside the subset stays at the MAP.

    Args:
        model: The model the subset belongs to; fixes the device and (by default) the dtype of the moments.
        subset: A ``partialbayes.selection.Subset`` of ``model``.
        max_rank: ``K``, the number of deviation columns kept (the paper: 20). Must be ``>= 2`` unless
            ``diagonal_only``.
        diagonal_only: Keep only the diagonal (SWAG-Diag).
        dtype: dtype of the stored moments (default: dtype of the first stochastic parameter). float64
            reduces cancellation in ``sq_mean − mean²``.

    Raises:
        TypeError: If ``subset`` is not a ``Subset`` or ``model`` not a module.
        ValueError: If the subset does not match the model, is empty, or ``max_rank < 2`` with the low-rank
            part.
    """

    def __init__(
        self,
        model: nn.Module,
        subset: Any,
        *,
        max_rank: int = 20,
        diagonal_only: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(max_rank, bool) or not isinstance(max_rank, int):
            raise TypeError(f"max_rank must be an int, got {type(max_rank).__name__}")
        if not diagonal_only and max_rank < 2:
            raise ValueError(
                f"max_rank must be >= 2 for the low-rank part of SWAG, got {max_rank} "
                "(use diagonal_only=True for SWAG-Diag)"
            )
        self.subset = subset
        self.layout = FlatLayout.from_subset(subset)
        params = self.layout.parameters(model)
        first = params[self.layout.names[0]]
        self.dtype = first.dtype if dtype is None else dtype
        if not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating point dtype, got {self.dtype}")
        self.device = first.device
        self.layout = self.layout.to(self.device)
        self.max_rank = max_rank
        self.diagonal_only = diagonal_only
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
    def collect(self, model: nn.Module) -> None:
        """Fold the model's current stochastic entries in as one snapshot.

        Raises:
            ValueError: If the model does not match the subset or the entries are not finite.
        """
        params = self.layout.parameters(model)
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

    def current(self, model: nn.Module) -> Tensor:
        """The model's current stochastic entries, shape ``(d,)`` (dtype of the moments)."""
        return self.layout.gather(self.layout.parameters(model)).to(self.device, self.dtype)

    # --------------------------------------------------------------- sampling
    def sample(
        self,
        n_samples: int | None = None,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Draw samples of the stochastic entries (see `swag_sample`).

        Uses the ``k = min(n_snapshots, K)`` deviation columns collected so far.

        Args:
            n_samples: Number of samples; ``None`` for one sample of shape ``(d,)``.
            scale: Covariance scale (``1`` is plain SWAG; ``0`` returns the SWA mean).
            generator: Source of randomness (same generator state, same sample).

        Returns:
            Shape ``(d,)`` or ``(n_samples, d)``.

        Raises:
            ValueError: Before any snapshot, or with fewer than two snapshots and the low-rank part.
        """
        self._require_snapshots(1 if self.diagonal_only else 2)
        return swag_sample(
            self._mean,
            self.variance,
            self.deviations,
            n_samples=n_samples,
            scale=scale,
            generator=generator,
        )

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Split a flat vector ``(..., d)`` into per-parameter entry vectors (``Subset.gather`` order)."""
        return self.layout.unflatten(flat)

    @contextmanager
    def swapped(self, model: nn.Module, weights: Tensor) -> Iterator[Tensor]:
        """Write ``weights`` (shape ``(d,)``) into the stochastic entries; restore the old values on exit.

        The values present on entry (normally the MAP) come back even when the body raises. Entries outside
        the subset are never touched.
        """
        params = self.layout.parameters(model)
        saved = self.layout.gather(params)
        self.layout.scatter_(params, weights)
        try:
            yield weights
        finally:
            self.layout.scatter_(params, saved)

    @contextmanager
    def sampled(
        self,
        model: nn.Module,
        *,
        scale: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Iterator[Tensor]:
        """Swap one SWAG sample into ``model``; the MAP comes back on exit, also on error.

        Example:
            >>> with swag.sampled(model, generator=g):  # doctest: +SKIP
            ...     logits = model(**batch).logits

        Yields:
            The sampled flat vector, shape ``(d,)``.
        """
        w = self.sample(scale=scale, generator=generator)
        with self.swapped(model, w):
            yield w

    # ------------------------------------------------------------------ io
    def save(self, path: str | Path) -> None:
        """Save to a safetensors file with JSON metadata (see `save_swag`)."""
        from partialbayes.swag._io import save_swag

        save_swag(self, path)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, subset: Any | None = None) -> SWAG:
        """Load a saved SWAG onto ``model`` (see `load_swag`)."""
        from partialbayes.swag._io import load_swag

        return load_swag(path, model, subset)

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
