"""Diagonal Laplace posterior over any `Subset` (elementwise masks included)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._diag_dense import diagonal
from partialbayes.curvature._hooks import Run
from partialbayes.curvature._jacobians import subset_jacobians
from partialbayes.curvature._laplace import LaplaceBase
from partialbayes.curvature._likelihood import Outputs
from partialbayes.predictive.internal import PosteriorFile, check_finite, check_keys


class DiagLaplace(LaplaceBase):
    """Laplace posterior with a diagonal precision ``P = diag(h) / T + δ_m`` per entry.

    ``h`` is the diagonal of the summed GGN / Fisher of the subset's entries (``diag_curvature``). Works for
    any subset, elementwise ``MaskBlock`` ones included. Prior precision: scalar or one per module (the
    module owning each parameter, e.g. ``"encoder.layer.0.output.dense"``). Token-level outputs are exact
    per position: ``fisher="exact"`` costs ``C`` backward passes per kept position and batch (see
    ``diag_curvature``). Arguments: see `LaplaceBase`.
    """

    _h: dict[str, Tensor]

    def _compute_curvature(self, loader: Iterable[Any], run: Run) -> Any:
        return diagonal(self.model, loader, self.subset, self._options, run)

    def _set_curvature(self, curvature: Mapping[str, Tensor]) -> None:
        """``curvature``: ``{param name: h [k]}`` in ``subset.gather`` order, ``h ≥ 0`` up to round-off."""
        names = self.subset.names
        check_keys("diagonal curvature", curvature, names, names, "parameters")
        h = {}
        for n in self.subset.names:
            v = curvature[n].to(device=self.device, dtype=self.dtype).reshape(-1)
            where = f"diagonal curvature of {n!r} (module {self.modules[self._param_module[n]]!r})"
            if v.numel() != self.subset.num_entries(n):
                raise ValueError(
                    f"{where} has {v.numel()} entries, the subset selects {self.subset.num_entries(n)}"
                )
            check_finite(v, f"{where} is not finite")
            low, tol = (float(v.min()), float(v.abs().max())) if v.numel() else (0.0, 0.0)
            if low < -(torch.finfo(v.dtype).eps ** 0.5) * tol:
                raise ValueError(
                    f"{where} has negative entries down to {low:.3g}: a diagonal GGN / Fisher is a sum "
                    "of squares"
                )
            h[n] = v.clamp(min=0.0)
        self._h = h

    def _precision(self, name: str, prior: Tensor, scale: Tensor | float) -> Tensor:
        return self._h[name] * (scale / self.temperature) + prior[self._param_module[name]]

    def _accumulate(
        self, curvature: Mapping[str, Tensor], previous: Any, n_data: int
    ) -> dict[str, Tensor]:
        return {
            n: curvature[n].to(self.device, self.dtype).reshape(-1) + previous._h[n]
            for n in self.subset.names
        }

    def _quad(self, delta: Mapping[str, Tensor], prior: Tensor, scale: Tensor | float) -> Tensor:
        terms = [
            (self._precision(n, prior, scale) * delta[n] ** 2).sum() for n in self.subset.names
        ]
        return torch.stack(terms).sum()

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        first, *rest = [self._precision(n, prior, scale).log().sum() for n in self.subset.names]
        return sum(rest, first)

    def _sample(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        scale = self._scale(None)
        return {
            name: self._noise((n, self._h[name].numel()), generator)
            * self._precision(name, self._prior, scale).rsqrt()
            for name in self.subset.names
        }

    def _covariances(
        self,
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Tensor],
        scale: Tensor | float,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """``J diag(1/P) Jᵀ`` from the Jacobians of the subset's entries (computed once for every prior)."""
        logits, keep, jac = subset_jacobians(self.model, inputs, outputs, self.subset)
        with torch.no_grad():
            jac = {n: j.to(device=self.device, dtype=self.dtype) for n, j in jac.items()}
            covs = []
            for prior in priors:
                scaled = [
                    jac[n] * self._precision(n, prior, scale).rsqrt() for n in self.subset.names
                ]
                covs.append(sum((j @ j.mT for j in scaled[1:]), scaled[0] @ scaled[0].mT))
        return logits.detach(), keep, covs

    def _state(self) -> dict[str, Tensor]:
        return {f"{n}:diag": h for n, h in self._h.items()}

    def _load_state(self, file: PosteriorFile) -> None:
        sizes = {n: (self.subset.num_entries(n),) for n in self.subset.names}
        self._h = {
            n: file.tensor(f"curv:{n}:diag", k).to(self.device, self.dtype)
            for n, k in sizes.items()
        }

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        rows: dict[str, int] = {}
        for n in self.subset.names:
            m = self.modules[self._param_module[n]]
            rows[m] = rows.get(m, 0) + self._h[n].numel()
        return [(m, f"diagonal, {k} entries", k) for m, k in rows.items()]
