"""Dense (full GGN) Laplace posterior over a small `Subset`; last-layer Laplace is the last-layer subset."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.curvature._diag_dense import dense
from partialbayes.curvature._hooks import Run
from partialbayes.curvature._jacobians import subset_jacobians
from partialbayes.curvature._kfac import whole_factor
from partialbayes.curvature._laplace import LaplaceBase
from partialbayes.curvature._likelihood import Outputs
from partialbayes.predictive.internal import PosteriorFile, prefixed
from partialbayes.selection import Subset


class DenseLaplace(LaplaceBase):
    """Laplace posterior with the full precision ``P = H / T + diag(δ)`` over a small subset.

    ``H`` ``[P, P]`` (``dense_curvature``; entries in ``subset.names`` then ``subset.gather`` order) is stored
    as its eigendecomposition: one scalar prior is diagonal in its eigenbasis, per-module priors go through a
    Cholesky factor of ``P``. ``selection.last_layer(model)`` gives last-layer Laplace.

    Args:
        model: The fine-tuned model.
        subset: Any subset with at most ``max_entries`` entries.
        max_entries: Refuse larger subsets (``P²`` floats are stored).
        **kwargs: See `LaplaceBase`.
    """

    _dense_curvature = True

    _SAVED: ClassVar[tuple[str, ...]] = ("max_entries",)
    _eig: tuple[Tensor, Tensor]

    def __init__(
        self, model: nn.Module, subset: Subset, *, max_entries: int = 20_000, **kwargs: Any
    ) -> None:
        self.max_entries = max_entries
        super().__init__(model, subset, **kwargs)

    def _groups(self) -> dict[str, str]:
        n = self.subset.num_entries()
        if n > self.max_entries:
            raise ValueError(
                f"subset has {n} entries; DenseLaplace stores {n}² floats and refuses more than "
                f"max_entries={self.max_entries}: use KronLaplace or DiagLaplace, or raise max_entries"
            )
        return super()._groups()

    def _compute_curvature(self, loader: Iterable[Any], run: Run) -> Any:
        return dense(self.model, loader, self.subset, self._options, run)

    def _set_curvature(self, curvature: Tensor) -> None:
        """``curvature``: ``H [P, P]`` in ``subset.names`` order."""
        p = self.subset.num_entries()
        got = tuple(curvature.shape) if isinstance(curvature, Tensor) else type(curvature).__name__
        if got != (p, p):
            raise ValueError(f"dense curvature must have shape ({p}, {p}), got {got}")
        with prefixed(f"dense curvature of modules {list(self.modules)}"):
            f = whole_factor(curvature, self.dtype, self.device, "H")
            self._eig = f.s, f.U

    def _entry_prior(self, prior: Tensor) -> Tensor:
        """``[P]`` prior precision of every entry."""
        sizes = {n: self.subset.num_entries(n) for n in self.subset.names}
        return torch.cat([prior[self._param_module[n]].expand(k) for n, k in sizes.items()])

    def _uniform(self, prior: Tensor) -> bool:
        return not prior.requires_grad and bool((prior == prior[0]).all())

    def _eig_precision(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        return self._eig[0] * (scale / self.temperature) + prior[0]

    def _cholesky(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        vals, q = self._eig
        precision = (q * (vals * (scale / self.temperature))) @ q.T
        precision = precision + torch.diag(self._entry_prior(prior))
        chol, info = torch.linalg.cholesky_ex(precision)
        if int(info) != 0:
            raise ValueError(f"posterior precision not positive definite (prior {prior.tolist()})")
        return chol

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        if self._uniform(prior):
            return self._eig_precision(prior, scale).log().sum()
        return 2 * torch.diagonal(self._cholesky(prior, scale)).log().sum()

    def _sample(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        vals, vecs = self._eig
        eps = self._noise((n, vals.numel()), generator)
        scale = self._scale(None)
        if self._uniform(self._prior):
            flat = (eps * self._eig_precision(self._prior, scale).rsqrt()) @ vecs.T
        else:
            chol = self._cholesky(self._prior, scale)
            flat = torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T
        sizes = [self.subset.num_entries(n) for n in self.subset.names]
        return dict(zip(self.subset.names, flat.split(sizes, dim=1), strict=True))

    def _covariances(
        self,
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Tensor],
        scale: Tensor | float,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """``J P⁻¹ Jᵀ`` from the Jacobians ``[N, C, P]``: in ``H``'s eigenbasis (one scalar prior), else by Cholesky."""
        logits, keep, parts = subset_jacobians(self.model, inputs, outputs, self.subset)
        with torch.no_grad():
            jac = torch.cat([parts[n] for n in self.subset.names], dim=-1)
            jac = jac.to(device=self.device, dtype=self.dtype)
            rotated = jac @ self._eig[1]
            covs = []
            for prior in priors:
                if self._uniform(prior):
                    m = rotated * self._eig_precision(prior, scale).rsqrt()
                    covs.append(m @ m.mT)
                else:
                    chol = self._cholesky(prior, scale)
                    v = torch.linalg.solve_triangular(chol, jac.mT, upper=False)
                    covs.append(v.mT @ v)
        return logits.detach(), keep, covs

    def _state(self) -> dict[str, Tensor]:
        return {"eigvals": self._eig[0], "eigvecs": self._eig[1]}

    def _load_state(self, file: PosteriorFile) -> None:
        p = self.subset.num_entries()
        self._eig = (
            file.tensor("curv:eigvals", (p,)).to(self.device, self.dtype),
            file.tensor("curv:eigvecs", (p, p)).to(self.device, self.dtype),
        )

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        p = self.subset.num_entries()
        return [(", ".join(self.modules), f"dense {p}x{p} (eigendecomposition)", p * p + p)]
