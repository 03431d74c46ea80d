"""Kronecker-factored Laplace posterior (KFAC / S-KFAC blocks) over a Kronecker-structured `Subset`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._kron_algebra import (
    clamped_eigh,
    kron_functional_covariance_projected,
    kron_log_det,
    kron_project_jacobian,
    kron_sample,
    precision_eigenvalues,
)
from partialbayes.curvature._laplace_base import LaplaceBase
from partialbayes.curvature._laplace_data import block_to_params, param_jacobians, params_to_block
from partialbayes.curvature._laplace_projected import projected_jacobians


class _Projected(dict):
    """Block Jacobians already rotated into the eigenbases (``{module: M [B, C, r, c]}``)."""


class KronLaplace(LaplaceBase):
    """Laplace posterior with one Kronecker-factored block per linear map of the subset.

    Each block covers ``vec(W[R][:, C] | b[R])`` (row-major, bias folded as the last column) with precision
    ``P = (G ⊗ A) / T + δ_m I``, ``G = G[R, R]`` summed over the data and ``A = A[C, C]`` averaged (KFAC on
    whole modules, S-KFAC on row / column blocks). Only the eigendecompositions of ``G`` and ``A`` are
    stored; the prior is added exactly in their eigenbasis, and inverse, log-determinant, samples and the
    functional covariance never form a dense covariance. Prior precision: scalar or one per module
    (keys: module names of ``subset.kron_modules()``).

    Args:
        model: The fine-tuned model.
        subset: A Kronecker-structured subset (``KronBlock`` blocks on linear maps).
        sharing: Weight sharing over tokens for KFAC, ``"reduce"`` or ``"expand"``.
        **kwargs: See `LaplaceBase` (likelihood, prior_precision, temperature, sigma_noise, fisher, ...).

    Raises:
        TypeError: If the subset holds elementwise ``MaskBlock`` blocks (use `DiagLaplace` or
            `DenseLaplace`).
    """

    def __init__(self, model: Any, subset: Any, *, sharing: str = "reduce", **kwargs: Any) -> None:
        if sharing not in ("reduce", "expand"):
            raise ValueError(f"sharing must be 'reduce' or 'expand', got {sharing!r}")
        self.sharing = sharing
        self._eig: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        super().__init__(model, subset, **kwargs)

    # ------------------------------------------------------------------ structure
    def _check_subset(self) -> None:
        try:
            self._kmods = self.subset.kron_modules()
        except TypeError as err:
            raise TypeError(
                f"KronLaplace needs a Kronecker-structured subset: {err}. For elementwise subsets use "
                "DiagLaplace (diagonal GGN) or DenseLaplace (full GGN, small subsets)"
            ) from err

    def _module_names(self) -> tuple[str, ...]:
        return tuple(self._kmods)

    def _module_of(self, param_name: str) -> str:
        for m, km in self._kmods.items():
            if param_name in (km.weight_name, km.bias_name):
                return m
        raise KeyError(param_name)

    def _dims(self, module: str) -> tuple[int, int, int]:
        """``(r, c_w, c)``: block rows, weight columns, block columns (``c_w + 1`` with a bias)."""
        km = self._kmods[module]
        r = km.n_out if km.rows is None else int(km.rows.numel())
        cw = km.n_in if km.cols is None else int(km.cols.numel())
        return r, cw, cw + (km.bias_name is not None)

    def block_to_params(self, module: str, block: Tensor) -> dict[str, Tensor]:
        """Split block matrices ``[..., r, c]`` into the module's parameters in ``subset.gather`` order.

        Returns:
            ``{weight name: [..., r·c_w], bias name: [..., r]}`` (storage order, Conv1D transposed).
        """
        return block_to_params(self._kmods[module], block)

    def params_to_block(self, module: str, values: Mapping[str, Tensor]) -> Tensor:
        """Inverse of `block_to_params`: ``{param: [..., k]}`` -> ``[..., r, c]``."""
        return params_to_block(self._kmods[module], values)

    # ------------------------------------------------------------------ curvature
    def _compute_curvature(self, loader: Iterable[Any], progress: bool) -> Any:
        from partialbayes.curvature._kfac import kfac

        return kfac(
            self.model,
            loader,
            self.subset,
            sharing=self.sharing,
            **self._curvature_options(progress),
        )

    def _set_curvature(self, curvature: Mapping[str, Any]) -> None:
        """``curvature``: ``{module: factors}`` with ``.G [r, r]`` (summed) and ``.A [c, c]`` (averaged)."""
        missing = [m for m in self.modules if m not in curvature]
        extra = [m for m in curvature if m not in self.modules]
        if missing or extra:
            raise ValueError(f"factors do not match the subset: missing {missing}, unknown {extra}")
        eig = {}
        for m in self.modules:
            r, _, c = self._dims(m)
            G = curvature[m].G.to(device=self.device, dtype=self.dtype)
            A = curvature[m].A.to(device=self.device, dtype=self.dtype)
            if G.shape != (r, r) or A.shape != (c, c):
                raise ValueError(
                    f"factors of module {m!r} have G {tuple(G.shape)} and A {tuple(A.shape)}, "
                    f"expected ({r}, {r}) and ({c}, {c}) for its block"
                )
            try:
                eg, qg = clamped_eigh(G)
                ea, qa = clamped_eigh(A)
            except ValueError as err:
                raise ValueError(f"curvature of module {m!r}: {err}") from err
            eig[m] = (eg, qg, ea, qa)
        self._eig = eig

    def _eigenvalues(self, i: int, m: str, prior: Tensor, scale: Tensor | float) -> Tensor:
        eg, _, ea, _ = self._eig[m]
        return precision_eigenvalues(eg, ea, prior[i], self.temperature, scale)

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        return sum(
            kron_log_det(self._eigenvalues(i, m, prior, scale)) for i, m in enumerate(self.modules)
        )

    def _sample_centered(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, m in enumerate(self.modules):
            _, qg, _, qa = self._eig[m]
            r, _, c = self._dims(m)
            E = self._eigenvalues(i, m, self._prior, self._scale(None))
            out.update(
                self.block_to_params(m, kron_sample(qg, qa, E, self._noise((n, r, c), generator)))
            )
        return out

    # ------------------------------------------------------------------ predictive
    def _jacobians(self, inputs: Any) -> tuple[Tensor, _Projected]:
        """Per-example logit Jacobians of each block, already in the eigenbases: ``M = Q_Gᵀ J Q_A``.

        Hooks and ``C`` backward passes; ``J`` itself is never formed (see `projected_jacobians`).
        """
        bases = {m: (self._eig[m][1], self._eig[m][3]) for m in self.modules}
        f, projected = projected_jacobians(self.model, inputs, self._kmods, bases, self.dtype)
        return f, _Projected(projected)

    def _autograd_jacobians(self, inputs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Block Jacobians by generic reverse mode over all logits (reference path)."""
        f, jac = param_jacobians(self.model, inputs, self.subset)
        blocks = {m: self.params_to_block(m, jac) for m in self.modules}
        return f, blocks

    def _prepare(self, jac: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if isinstance(jac, _Projected):
            return jac
        out = {}
        for m in self.modules:
            _, qg, _, qa = self._eig[m]
            out[m] = kron_project_jacobian(qg, qa, jac[m].to(device=self.device, dtype=self.dtype))
        return out

    def _functional_cov(
        self, prepared: Mapping[str, Tensor], prior: Tensor, scale: Tensor | float
    ) -> Tensor:
        return sum(
            kron_functional_covariance_projected(prepared[m], self._eigenvalues(i, m, prior, scale))
            for i, m in enumerate(self.modules)
        )

    # ------------------------------------------------------------------ state
    def _curvature_state(self) -> dict[str, Tensor]:
        state = {}
        for m, (eg, qg, ea, qa) in self._eig.items():
            state.update({f"{m}:eig_g": eg, f"{m}:q_g": qg, f"{m}:eig_a": ea, f"{m}:q_a": qa})
        return state

    def _load_curvature_state(self, tensors: Mapping[str, Tensor]) -> None:
        self._eig = {
            m: tuple(
                tensors[f"{m}:{k}"].to(device=self.device, dtype=self.dtype)
                for k in ("eig_g", "q_g", "eig_a", "q_a")
            )
            for m in self.modules
        }

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        rows = []
        for m in self.modules:
            r, _, c = self._dims(m)
            rows.append((m, f"G {r}x{r} ⊗ A {c}x{c}", r * r + r + c * c + c))
        return rows
