"""Dense (full GGN) Laplace posterior over a small `Subset`; last-layer Laplace is the last-layer subset."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._dense import dense_curvature
from partialbayes.curvature._kron_algebra import clamped_eigh
from partialbayes.curvature._laplace_base import LaplaceBase
from partialbayes.curvature._laplace_data import subset_jacobians
from partialbayes.curvature._outputs import Outputs


class DenseLaplace(LaplaceBase):
    """Laplace posterior with the full precision ``P = H / T + diag(δ)`` over a small subset.

    ``H`` (``[P, P]``, entries in ``subset.names`` order, each parameter in ``subset.gather`` order) is the
    summed GGN / Fisher (``dense_curvature``). Only its eigendecomposition ``H = Q diag(λ) Qᵀ`` (λ clamped at
    0) is stored: with one scalar prior everything is diagonal in ``Q`` (prior added exactly); with
    per-module priors a Cholesky factor of ``P`` is used. Use ``selection.last_layer(model)`` for
    last-layer Laplace. Token-level outputs are exact per position (see ``dense_curvature``).

    Args:
        model: The fine-tuned model.
        subset: Any subset with at most ``max_entries`` entries.
        max_entries: Refuse larger subsets (``P²`` floats are stored).
        **kwargs: See `LaplaceBase`.
    """

    def __init__(
        self, model: Any, subset: Any, *, max_entries: int = 20_000, **kwargs: Any
    ) -> None:
        self.max_entries = max_entries
        self._eigvals: Tensor | None = None
        self._eigvecs: Tensor | None = None
        super().__init__(model, subset, **kwargs)

    def _check_subset(self) -> None:
        n = self.subset.num_entries()
        if n > self.max_entries:
            raise ValueError(
                f"subset has {n} entries; DenseLaplace stores {n}² floats and refuses more than "
                f"max_entries={self.max_entries}: use KronLaplace or DiagLaplace, or raise max_entries"
            )

    def _offsets(self) -> dict[str, slice]:
        out, start = {}, 0
        for n in self.subset.names:
            k = self.subset.num_entries(n)
            out[n] = slice(start, start + k)
            start += k
        return out

    def _entry_prior(self, prior: Tensor) -> Tensor:
        """``[P]`` prior precision of every entry."""
        return torch.cat(
            [
                prior[self._param_module[n]].expand(self.subset.num_entries(n))
                for n in self.subset.names
            ]
        )

    def _compute_curvature(self, loader: Iterable[Any], options: Mapping[str, Any]) -> Any:
        return dense_curvature(
            self.model,
            loader,
            self.subset,
            **options,
        )

    def _set_curvature(self, curvature: Tensor) -> None:
        """``curvature``: ``H [P, P]`` in ``subset.names`` order."""
        p = self.subset.num_entries()
        if not isinstance(curvature, Tensor) or curvature.shape != (p, p):
            got = (
                tuple(curvature.shape)
                if isinstance(curvature, Tensor)
                else type(curvature).__name__
            )
            raise ValueError(f"dense curvature must have shape ({p}, {p}), got {got}")
        try:
            vals, vecs = clamped_eigh(curvature.to(device=self.device, dtype=self.dtype))
        except ValueError as err:
            raise ValueError(f"dense curvature of modules {list(self.modules)}: {err}") from err
        self._eigvals, self._eigvecs = vals, vecs

    def _eig(self) -> tuple[Tensor, Tensor]:
        """``(λ, Q)`` of ``H``, set by `fit` / `load` (callers check `_require_fit` first)."""
        if self._eigvals is None or self._eigvecs is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(loader) first")
        return self._eigvals, self._eigvecs

    def _uniform(self, prior: Tensor) -> bool:
        return not prior.requires_grad and bool((prior == prior[0]).all())

    def _eig_precision(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        return self._eig()[0] * (scale / self.temperature) + prior[0]

    def _cholesky(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        vals, q = self._eig()
        precision = (q * (vals * (scale / self.temperature))) @ q.T
        precision = precision + torch.diag(self._entry_prior(prior))
        chol, info = torch.linalg.cholesky_ex(precision)
        if int(info) != 0:
            raise ValueError(
                f"posterior precision is not positive definite (prior {prior.tolist()})"
            )
        return chol

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        if self._uniform(prior):
            return self._eig_precision(prior, scale).log().sum()
        return 2 * torch.diagonal(self._cholesky(prior, scale)).log().sum()

    def _split(self, flat: Tensor) -> dict[str, Tensor]:
        return {n: flat[..., s] for n, s in self._offsets().items()}

    def _sample_centered(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        vals, vecs = self._eig()
        eps = self._noise((n, vals.numel()), generator)
        scale = self._scale(None)
        if self._uniform(self._prior):
            flat = (eps * self._eig_precision(self._prior, scale).rsqrt()) @ vecs.T
        else:
            chol = self._cholesky(self._prior, scale)
            flat = torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T
        return self._split(flat)

    def _jacobians(
        self, inputs: Tensor | Mapping[str, Any], outputs: Outputs
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        logits, keep, jac = subset_jacobians(self.model, inputs, outputs, self.subset)
        return logits, keep, torch.cat([jac[n] for n in self.subset.names], dim=-1)

    def _prepare(self, jac: Tensor) -> Tensor:
        """``J Q``: Jacobians in the eigenbasis of ``H``, ``[B, C, P]``."""
        return jac.to(device=self.device, dtype=self.dtype) @ self._eig()[1]

    def _functional_cov(self, prepared: Tensor, prior: Tensor, scale: Tensor | float) -> Tensor:
        if self._uniform(prior):
            m = prepared * self._eig_precision(prior, scale).rsqrt()
            return m @ m.transpose(1, 2)
        chol = self._cholesky(prior, scale)
        jac = prepared @ self._eig()[1].T
        v = torch.linalg.solve_triangular(chol, jac.transpose(1, 2), upper=False)
        return v.transpose(1, 2) @ v

    def _curvature_state(self) -> dict[str, Tensor]:
        vals, vecs = self._eig()
        return {"eigvals": vals, "eigvecs": vecs}

    def _load_curvature_state(self, tensors: Mapping[str, Tensor]) -> None:
        self._eigvals = tensors["eigvals"].to(device=self.device, dtype=self.dtype)
        self._eigvecs = tensors["eigvecs"].to(device=self.device, dtype=self.dtype)

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        p = self.subset.num_entries()
        return [(", ".join(self.modules), f"dense {p}x{p} (eigendecomposition)", p * p + p)]
