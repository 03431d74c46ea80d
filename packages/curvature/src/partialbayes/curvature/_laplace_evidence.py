"""The Laplace evidence of a fitted posterior and the choice of its prior precision (grid or gradient).

``log p(D) ≈ log p(D | θ*) / T − ½ (log det P − log det P₀) − ½ θ*ᵀ P₀ θ*`` (`_prior.gaussian_log_marglik`),
differentiable in the prior precision and the regression noise; `optimize_prior_precision` maximises it on a
grid or by gradient ascent (`_marglik.maximize_evidence`), or minimises a validation NLL of the linearised
predictive on a grid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from partialbayes.curvature._laplace_core import LaplaceCore
from partialbayes.curvature._likelihood import check_labels, check_logits
from partialbayes.curvature._marglik import MarglikFit, maximize_evidence
from partialbayes.curvature._outputs import output_rows
from partialbayes.curvature._prior import PriorSpec, gaussian_log_marglik, prior_vector
from partialbayes.predictive import gaussian_nll, gaussian_predictive, nll, probit


class LaplaceEvidence(LaplaceCore):
    """Evidence and prior tuning of a Laplace posterior (part of `LaplaceBase`)."""

    def log_det(
        self, prior_precision: PriorSpec | None = None, sigma_noise: float | None = None
    ) -> Tensor:
        """``log det P`` of the posterior precision ``P = H / T + δ`` (differentiable in δ and σ)."""
        self._require_fit()
        return self._log_det(self._resolve_prior(prior_precision), self._scale(sigma_noise))

    def _module_sizes(self) -> Tensor:
        sizes = torch.zeros(len(self.modules), dtype=self.dtype, device=self.device)
        for n, m in self._param_module.items():
            sizes[m] += self.subset.num_entries(n)
        return sizes

    def _module_sq_norms(self) -> Tensor:
        sq = torch.zeros(len(self.modules), dtype=self.dtype, device=self.device)
        for n, m in self._param_module.items():
            sq[m] += (self._map[n].to(self.device) ** 2).sum()
        return sq

    def log_likelihood(self, sigma_noise: float | Tensor | None = None) -> Tensor:
        """Tempered training log-likelihood at the MAP, ``log p(D | θ*) / T``.

        Classification: ``-Σ CE / T``. Regression: ``-(SSE / (2σ²) + N C log(σ √(2π))) / T``.
        """
        self._require_fit()
        if self.likelihood == "classification":
            return torch.tensor(
                -self.map_loss / self.temperature, dtype=self.dtype, device=self.device
            )
        sigma = self.sigma_noise if sigma_noise is None else sigma_noise
        sigma = torch.as_tensor(sigma, dtype=self.dtype, device=self.device)
        norm = self.n_data * self.n_outputs * torch.log(sigma * math.sqrt(2 * math.pi))
        return -(self.map_loss / (2 * sigma**2) + norm) / self.temperature

    def log_marginal_likelihood(
        self, prior_precision: PriorSpec | None = None, sigma_noise: float | Tensor | None = None
    ) -> Tensor:
        """Laplace evidence ``log p(D|θ*)/T - ½ (log det P - log det P₀) - ½ θ*ᵀ P₀ θ*``.

        Differentiable in ``prior_precision`` and ``sigma_noise`` (pass tensors that require grad).

        Args:
            prior_precision: Overrides the stored prior precision (scalar, per module tensor, or dict).
            sigma_noise: Overrides the regression noise (the curvature is rescaled by ``σ_fit² / σ²``).

        Returns:
            Scalar tensor.
        """
        self._require_fit()
        prior = self._resolve_prior(prior_precision)
        scale = self._scale(sigma_noise)
        log_det_prior = (self._module_sizes() * prior.log()).sum()
        scatter = (self._module_sq_norms() * prior).sum()
        return gaussian_log_marglik(
            self.log_likelihood(sigma_noise), self._log_det(prior, scale), log_det_prior, scatter
        )

    @overload
    def optimize_prior_precision(
        self,
        method: str = ...,
        *,
        optimizer: Literal["grid"] = ...,
        val_loader: Iterable[Any] | None = ...,
        grid: Tensor | Sequence[float] | None = ...,
    ) -> float: ...

    @overload
    def optimize_prior_precision(
        self,
        method: Literal["marglik"] = ...,
        *,
        optimizer: Literal["gradient"],
        init_prior_precision: PriorSpec | None = ...,
        fit_sigma_noise: bool | None = ...,
        per_module: bool | None = ...,
        lr: float | None = ...,
        max_steps: int | None = ...,
        tol: float | None = ...,
    ) -> MarglikFit: ...

    @overload
    def optimize_prior_precision(
        self,
        method: str = ...,
        *,
        optimizer: str,
        val_loader: Iterable[Any] | None = ...,
        grid: Tensor | Sequence[float] | None = ...,
        init_prior_precision: PriorSpec | None = ...,
        fit_sigma_noise: bool | None = ...,
        per_module: bool | None = ...,
        lr: float | None = ...,
        max_steps: int | None = ...,
        tol: float | None = ...,
    ) -> float | MarglikFit: ...

    def optimize_prior_precision(
        self,
        method: str = "marglik",
        *,
        optimizer: str = "grid",
        val_loader: Iterable[Any] | None = None,
        grid: Tensor | Sequence[float] | None = None,
        init_prior_precision: PriorSpec | None = None,
        fit_sigma_noise: bool | None = None,
        per_module: bool | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
        tol: float | None = None,
    ) -> float | MarglikFit:
        """Choose the prior precision (a scalar on a grid, or one per module by gradient ascent) and set it.

        Two optimizers:

        * ``"grid"`` (default): one scalar prior for every module, the best of ``grid``. Each candidate
          costs one evidence evaluation (``method="marglik"``) or one linearised predictive per validation
          batch and candidate, with the Jacobians shared (``method="val_nll"``).
        * ``"gradient"`` (``method="marglik"`` only): Adam on ``log δ_m``, one prior per module (or one
          shared value with ``per_module=False``), and on ``log σ`` for regression, until the evidence is
          stationary: every scaled gradient (``|∂L/∂log δ_m| / d_m`` with ``d_m`` the module's entries,
          ``|∂L/∂log σ| / (N C)``) is at most ``tol``. Each step is one evidence evaluation and its
          gradient (no data pass). Not converging within ``max_steps`` warns and returns
          ``converged=False``; the last values are set anyway.

        Args:
            method: ``"marglik"`` (maximise `log_marginal_likelihood`) or ``"val_nll"`` (minimise the NLL of
                the linearised probit predictive, or of the Gaussian predictive for regression, on
                ``val_loader``).
            optimizer: ``"grid"`` or ``"gradient"``.
            val_loader: Validation batches (``method="val_nll"`` only).
            grid: Candidate values of the grid, default ``torch.logspace(-1, 3, 21)``.
            init_prior_precision: Gradient start (scalar, per module tensor or dict); default the current
                prior precision.
            fit_sigma_noise: Also fit ``σ`` (gradient; default: for regression). The fitted value becomes
                ``sigma_noise``; the curvature is rescaled by ``σ_fit² / σ²``.
            per_module: One prior precision per module (gradient; default ``True``) or one shared value.
            lr: Adam step size on the log scale (gradient; default 0.1).
            max_steps: Most Adam steps (gradient; default 1000).
            tol: Stationarity tolerance on the scaled gradients (gradient; default 1e-4).

        Returns:
            ``"grid"``: the chosen scalar prior precision. ``"gradient"``: a `MarglikFit` with the prior
            precision per module, the fitted ``σ`` (or ``None``), the evidence, the steps taken, whether it
            converged and the evidence history. Either way the values are also stored on the posterior.

        Raises:
            ValueError: On a bad ``method`` / ``optimizer`` / ``grid``, gradient options (non-positive
                start, ``lr``, ``tol`` or ``max_steps``; ``fit_sigma_noise`` for classification; a
                non-finite evidence), and (``"val_nll"``) an empty ``val_loader`` or labels of the wrong
                dtype / shape or out of range (naming the batch).
        """
        self._require_fit()
        if optimizer not in ("grid", "gradient"):
            raise ValueError(f"optimizer must be 'grid' or 'gradient', got {optimizer!r}")
        if optimizer == "gradient":
            if method != "marglik":
                raise ValueError(
                    f"optimizer='gradient' needs method='marglik' (got {method!r}); "
                    "method='val_nll' is offered on a grid"
                )
            if val_loader is not None or grid is not None:
                raise ValueError("val_loader and grid are not used with optimizer='gradient'")
            options: dict[str, Any] = {
                "per_module": per_module,
                "lr": lr,
                "max_steps": max_steps,
                "tol": tol,
            }
            fit = self._gradient_prior_precision(
                init_prior_precision=init_prior_precision,
                fit_sigma_noise=fit_sigma_noise,
                **{k: v for k, v in options.items() if v is not None},
            )
            self.prior_precision = fit.prior_precision
            if fit.sigma_noise is not None:
                self.sigma_noise = fit.sigma_noise
            return fit
        gradient_only = {
            "init_prior_precision": init_prior_precision,
            "fit_sigma_noise": fit_sigma_noise,
            "per_module": per_module,
            "lr": lr,
            "max_steps": max_steps,
            "tol": tol,
        }
        given = [k for k, v in gradient_only.items() if v is not None]
        if given:
            raise ValueError(f"{given} are options of optimizer='gradient', not of the grid")
        return self._grid_prior_precision(method, val_loader, grid)

    def _gradient_prior_precision(
        self,
        *,
        init_prior_precision: PriorSpec | None = None,
        fit_sigma_noise: bool | None = None,
        per_module: bool = True,
        lr: float = 0.1,
        max_steps: int = 1000,
        tol: float = 1e-4,
    ) -> MarglikFit:
        """The gradient ascent of `optimize_prior_precision`: per-module δ (and σ) by Adam on the evidence.

        Returns the fit without setting it (the caller does).
        """
        if not isinstance(per_module, bool):
            raise TypeError(f"per_module must be a bool, got {type(per_module).__name__}")
        if fit_sigma_noise is None:
            fit_sigma_noise = self.likelihood == "regression"
        elif not isinstance(fit_sigma_noise, bool):
            raise TypeError(
                f"fit_sigma_noise must be a bool or None, got {type(fit_sigma_noise).__name__}"
            )
        elif fit_sigma_noise and self.likelihood != "regression":
            raise ValueError(
                "fit_sigma_noise=True needs likelihood='regression' (classification has no noise)"
            )
        init = self.prior_precision if init_prior_precision is None else init_prior_precision
        start = prior_vector(init, self.modules, dtype=self.dtype, device=self.device)

        def evidence(prior: Tensor, sigma: Tensor | None) -> Tensor:
            return self.log_marginal_likelihood(prior_precision=prior, sigma_noise=sigma)

        with torch.enable_grad():
            return maximize_evidence(
                evidence,
                start.detach(),
                self._module_sizes(),
                self.modules,
                init_sigma=self.sigma_noise if fit_sigma_noise else None,
                sigma_scale=float(self.n_data * max(self.n_outputs, 1)),
                per_module=per_module,
                lr=lr,
                max_steps=max_steps,
                tol=tol,
            )

    def _grid_prior_precision(
        self,
        method: str,
        val_loader: Iterable[Any] | None,
        grid: Tensor | Sequence[float] | None,
    ) -> float:
        """The grid search of `optimize_prior_precision` (one scalar prior for every module)."""
        if grid is None:
            values = torch.logspace(-1, 3, 21, dtype=torch.float64)
        elif isinstance(grid, Tensor):
            values = grid.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        else:  # Python floats straight to float64 (as_tensor would round them to float32 first)
            values = torch.tensor(list(grid), dtype=torch.float64).reshape(-1)
        if values.numel() == 0 or not bool(((values > 0) & torch.isfinite(values)).all()):
            raise ValueError(f"grid must hold positive finite values, got {values.tolist()}")
        if method == "marglik":
            if val_loader is not None:
                raise ValueError("val_loader is only used with method='val_nll'")
            with torch.no_grad():
                scores = torch.stack(
                    [self.log_marginal_likelihood(prior_precision=float(v)) for v in values]
                )
            best = int(torch.argmax(scores))
        elif method == "val_nll":
            if val_loader is None:
                raise ValueError("method='val_nll' needs val_loader")
            best = int(torch.argmin(self.grid_val_nll(val_loader, values)))
        else:
            raise ValueError(f"method must be 'marglik' or 'val_nll', got {method!r}")
        chosen = float(values[best])
        self.prior_precision = chosen
        return chosen

    def grid_val_nll(self, val_loader: Iterable[Any], grid: Tensor) -> Tensor:
        """Mean validation NLL of the linearised predictive for each scalar prior precision in ``grid``.

        Classification scores the probit predictive (``partialbayes.predictive.probit``), regression the
        Gaussian predictive with the observation noise (``gaussian_predictive``). Jacobians are computed
        once per batch and reused for every grid value. Token-level outputs count one example per kept
        position.

        Returns:
            ``[len(grid)]`` mean NLL per example.

        Raises:
            ValueError: On an empty ``val_loader``, a batch without labels, or labels of the wrong dtype /
                shape or out of range (naming the batch).
        """
        self._require_fit()
        totals = torch.zeros(len(grid), dtype=torch.float64)
        count = 0
        priors = [self._resolve_prior(float(v)) for v in grid]
        scale = self._scale(None)
        with torch.no_grad():
            for batch_index, batch in enumerate(val_loader):
                inputs, outputs = self._read(batch)
                with torch.enable_grad():
                    logits, keep, covs = self._mean_covs(inputs, outputs, priors, scale)
                f = output_rows(logits, keep).to(self.dtype)
                check_logits(f, None, batch_index)
                labels = outputs.targets(logits, keep)
                if labels is None:
                    raise ValueError(
                        f"batch {batch_index}: val_loader batches need labels to score the predictive"
                    )
                labels = check_labels(labels, f, self.likelihood, batch_index)
                for i, cov in enumerate(covs):
                    cov = cov.to(self.dtype)
                    if self.likelihood == "classification":
                        score = nll(probit(f, cov), labels, reduction="sum")
                    else:
                        mean, var = gaussian_predictive(
                            f, cov.diagonal(dim1=-2, dim2=-1), self.sigma_noise**2
                        )
                        score = gaussian_nll(mean, var, labels.to(f.dtype), reduction="sum")
                    totals[i] += float(score)
                count += f.shape[0]
        if count == 0:
            raise ValueError("val_loader is empty")
        return totals / count
