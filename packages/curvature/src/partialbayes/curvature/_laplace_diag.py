"""Diagonal Laplace posterior over any `Subset` (elementwise masks included)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._diag import diag_curvature
from partialbayes.curvature._laplace_base import LaplaceBase
from partialbayes.curvature._laplace_data import subset_jacobians
from partialbayes.curvature._outputs import Outputs


class DiagLaplace(LaplaceBase):
    """Laplace posterior with a diagonal precision ``P = diag(h) / T + δ_m`` per entry.

    ``h`` is the diagonal of the summed GGN / Fisher of the subset's entries (``diag_curvature``). Works for
    any subset, elementwise ``MaskBlock`` ones included. Prior precision: scalar or one per module (the
    module owning each parameter, e.g. ``"encoder.layer.0.output.dense"``). Token-level outputs are exact
    per position: ``fisher="exact"`` costs ``C`` backward passes per kept position and batch (see
    ``diag_curvature``).
    """

    def __init__(self, model: Any, subset: Any, **kwargs: Any) -> None:
        self._h: dict[str, Tensor] = {}
        super().__init__(model, subset, **kwargs)

    def _compute_curvature(self, loader: Iterable[Any], options: Mapping[str, Any]) -> Any:
        return diag_curvature(
            self.model,
            loader,
            self.subset,
            **options,
        )

    def _set_curvature(self, curvature: Mapping[str, Tensor]) -> None:
        """``curvature``: ``{param name: h [k]}`` in ``subset.gather`` order."""
        missing = [n for n in self.subset.names if n not in curvature]
        extra = [n for n in curvature if n not in self.subset.names]
        if missing or extra:
            raise ValueError(
                f"diagonal does not match the subset: missing {missing}, unknown {extra}"
            )
        h = {}
        for n in self.subset.names:
            v = curvature[n].to(device=self.device, dtype=self.dtype).reshape(-1)
            if v.numel() != self.subset.num_entries(n):
                raise ValueError(
                    f"diagonal of {n!r} has {v.numel()} entries, the subset selects {self.subset.num_entries(n)}"
                )
            if not torch.isfinite(v).all():
                raise ValueError(
                    f"diagonal curvature of {n!r} (module {self._module_of(n)!r}) is not finite"
                )
            h[n] = v.clamp(min=0.0)
        self._h = h

    def _precision(self, name: str, prior: Tensor, scale: Tensor | float) -> Tensor:
        return self._h[name] * (scale / self.temperature) + prior[self._param_module[name]]

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        first, *rest = [self._precision(n, prior, scale).log().sum() for n in self.subset.names]
        return sum(rest, first)

    def _sample_centered(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        scale = self._scale(None)
        return {
            name: self._noise((n, self._h[name].numel()), generator)
            * self._precision(name, self._prior, scale).rsqrt()
            for name in self.subset.names
        }

    def _jacobians(
        self, inputs: Tensor | Mapping[str, Any], outputs: Outputs
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        return subset_jacobians(self.model, inputs, outputs, self.subset)

    def _prepare(self, jac: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {n: j.to(device=self.device, dtype=self.dtype) for n, j in jac.items()}

    def _functional_cov(
        self, prepared: Mapping[str, Tensor], prior: Tensor, scale: Tensor | float
    ) -> Tensor:
        out: Tensor | None = None
        for n in self.subset.names:
            j = prepared[n] * self._precision(n, prior, scale).rsqrt()
            cov = j @ j.transpose(1, 2)
            out = cov if out is None else out + cov
        if out is None:
            raise ValueError("DiagLaplace: the subset has no parameters")
        return out

    def _curvature_state(self) -> dict[str, Tensor]:
        return {f"{n}:diag": h for n, h in self._h.items()}

    def _load_curvature_state(self, tensors: Mapping[str, Tensor]) -> None:
        self._h = {
            n: tensors[f"{n}:diag"].to(device=self.device, dtype=self.dtype)
            for n in self.subset.names
        }

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        rows: dict[str, int] = {}
        for n in self.subset.names:
            m = self._module_of(n)
            rows[m] = rows.get(m, 0) + self._h[n].numel()
        return [(m, f"diagonal, {k} entries", k) for m, k in rows.items()]
