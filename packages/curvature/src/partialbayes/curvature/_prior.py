"""The prior precision's search: the grid (`optimize_prior_precision`) and the evidence's ascent (`maximize_evidence`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from partialbayes.curvature._memory import sized
from partialbayes.predictive import gaussian_nll, nll
from partialbayes.predictive.internal import (
    check_bool,
    check_int,
    check_number,
    prefixed,
    probit_kernel,
)

if TYPE_CHECKING:
    from partialbayes.curvature._laplace import LaplaceBase

PriorSpec = float | int | Tensor | Mapping[str, float]


@dataclass(frozen=True)
class MarglikFit:
    """Result of the gradient ascent on the Laplace evidence (`LaplaceBase.maximize_evidence`).

    Attributes:
        prior_precision: Fitted prior precision per module, ``[M]`` (float64, cpu), in ``modules`` order.
        modules: The posterior's modules (prior groups).
        sigma_noise: Fitted observation noise (regression with ``fit_sigma_noise``), else ``None``.
        log_marginal_likelihood: Evidence at the returned values.
        steps: Adam steps taken.
        converged: Whether every scaled gradient fell to ``tol`` or below within ``max_steps``.
        max_scaled_gradient: The largest scaled gradient at the returned values (``|∂L/∂log δ_m| / d_m``,
            ``|∂L/∂log σ| / (N C)``).
        history: Evidence before each step (length ``steps``), then at the returned values.
    """

    prior_precision: Tensor
    modules: tuple[str, ...]
    sigma_noise: float | None
    log_marginal_likelihood: float
    steps: int
    converged: bool
    max_scaled_gradient: float
    history: tuple[float, ...]

    def as_dict(self) -> dict[str, float]:
        """``{module: prior precision}``."""
        return dict(zip(self.modules, self.prior_precision.tolist(), strict=True))


def grid_search(
    post: LaplaceBase,
    method: str,
    val_loader: Iterable[Any] | None,
    grid: Tensor | Sequence[float] | None,
) -> float:
    """`LaplaceBase.optimize_prior_precision`: the best scalar prior of ``grid`` by ``method``, set on ``post``."""
    if grid is None:
        values = torch.logspace(-1, 3, 21, dtype=torch.float64)
    elif isinstance(grid, Tensor):
        values = grid.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    else:  # Python floats straight to float64 (as_tensor would round them to float32 first)
        values = torch.tensor(list(grid), dtype=torch.float64).reshape(-1)
    if values.numel() == 0 or not bool(((values > 0) & torch.isfinite(values)).all()):
        raise ValueError(f"grid must hold positive finite values, got {values.tolist()}")
    if (method == "val_nll") != (val_loader is not None):
        raise ValueError(
            "method='val_nll' needs val_loader"
            if val_loader is None
            else "val_loader is only used with method='val_nll'"
        )
    if method == "val_nll":
        best = int(torch.argmin(post.grid_val_nll(val_loader, values)))
    else:
        with torch.no_grad():
            scores = torch.stack([post.log_marginal_likelihood(float(v)) for v in values])
        best = int(torch.argmax(scores))
    post.prior_precision = float(values[best])
    return float(values[best])


def evidence_ascent(
    post: LaplaceBase,
    init_prior_precision: PriorSpec | None,
    fit_sigma_noise: bool | None,
    per_module: bool,
    lr: float,
    max_steps: int,
    tol: float,
) -> MarglikFit:
    """`LaplaceBase.maximize_evidence`: Adam on ``log δ`` (per module or shared) and ``log σ``, set on ``post``."""
    if fit_sigma_noise is None:
        fit_sigma_noise = post.likelihood == "regression"
    elif check_bool("fit_sigma_noise", fit_sigma_noise) and post.likelihood != "regression":
        raise ValueError("fit_sigma_noise=True needs likelihood='regression' (no noise to fit)")
    check_bool("per_module", per_module)
    check_number("lr", lr)
    check_number("tol", tol)
    check_int("max_steps", max_steps)
    n = len(post.modules)
    start = post._resolve_prior(init_prior_precision).detach().log()
    scale = post._module_sums(None).to(start)
    if not per_module:  # one shared δ, from the geometric mean
        start, scale = start.mean().reshape(1), scale.sum().reshape(1)
    log_prior = start.clone().requires_grad_(True)
    params = [log_prior]
    log_sigma = None
    if fit_sigma_noise:
        log_sigma = torch.tensor(math.log(post.sigma_noise), dtype=start.dtype, device=start.device)
        params.append(log_sigma.requires_grad_(True))
    sigma_scale = float(post.n_data * max(post.n_outputs, 1))
    opt = torch.optim.Adam(params, lr=lr)
    history: list[float] = []
    converged, worst = False, math.inf
    with torch.enable_grad():
        for step in range(max_steps + 1):
            prior = log_prior.exp().expand(n)
            sigma = None if log_sigma is None else log_sigma.exp()
            value = post.log_marginal_likelihood(prior, sigma)
            if not bool(torch.isfinite(value)):
                raise ValueError(
                    f"the evidence became non-finite at step {step} (prior precision "
                    f"{prior.detach().tolist()}, sigma_noise {None if sigma is None else float(sigma)}); "
                    "start closer to a sensible value or lower lr"
                )
            history.append(float(value.detach()))
            opt.zero_grad()
            (-value).backward()
            assert log_prior.grad is not None
            worst = float((log_prior.grad.abs() / scale).max())
            if log_sigma is not None:
                assert log_sigma.grad is not None
                worst = max(worst, float(log_sigma.grad.abs()) / sigma_scale)
            if worst <= tol:
                converged = True
                break
            if step < max_steps:
                opt.step()
    if not converged:
        warnings.warn(
            f"gradient marginal likelihood did not converge in max_steps={max_steps} steps: the largest "
            f"scaled gradient is {worst:.3g} > tol={tol:g}. The last values are set; raise max_steps or "
            "lr, or loosen tol",
            stacklevel=3,  # the user's call of maximize_evidence
        )
    fit = MarglikFit(
        prior_precision=log_prior.detach().exp().expand(n).to("cpu", torch.float64).clone(),
        modules=post.modules,
        sigma_noise=None if log_sigma is None else float(log_sigma.detach().exp()),
        log_marginal_likelihood=history[-1],
        steps=len(history) - 1,
        converged=converged,
        max_scaled_gradient=worst,
        history=tuple(history),
    )
    post.prior_precision = fit.prior_precision
    if fit.sigma_noise is not None:
        post.sigma_noise = fit.sigma_noise
    return fit


def grid_val_nlls(
    posteriors: Sequence[LaplaceBase], val_loader: Iterable[Any], grid: Tensor
) -> list[Tensor]:
    """`LaplaceBase.grid_val_nll` of each posterior, the network's passes shared (warning at the caller's caller)."""
    first = posteriors[0]
    first._require_fit()
    totals = torch.zeros(len(posteriors), len(grid), dtype=torch.float64)
    count = batches = skipped = 0
    priors = [[p._resolve_prior(float(v)) for v in grid] for p in posteriors]
    with torch.no_grad():
        for index, batch in enumerate(val_loader):
            batches += 1
            inputs, outputs = first._read(batch)
            if outputs.labels is None:
                raise ValueError(f"batch {index}: val_loader batches need labels for the NLL")
            if outputs.unlabelled:
                skipped += 1
                continue
            with sized(posteriors, outputs):
                logits, keep, covs = first._covariances_of(posteriors, inputs, outputs, priors)
            with prefixed(f"batch {index}"):
                rows, y = outputs.rows(logits, keep)
            if rows.shape[0] == 0:
                skipped += 1
                continue
            assert y is not None
            for i, (p, p_covs) in enumerate(zip(posteriors, covs, strict=True)):
                f = rows.to(p.dtype)
                for j, cov in enumerate(p_covs):  # our own covariances: nothing to check
                    var = cov.to(p.dtype).diagonal(dim1=-2, dim2=-1)
                    if p.likelihood == "classification":
                        score = nll(probit_kernel(f, var), y, reduction="sum")
                    else:
                        var = var + p.sigma_noise**2  # our own covariance: added unchecked
                        score = gaussian_nll(f, var, y.to(f.dtype), reduction="sum")
                    totals[i, j] += float(score)
            count += rows.shape[0]
    for p in posteriors:  # the grid's inverse eigenvalues (`KronLaplace._blocks`) are done with
        if hasattr(p, "_memo"):
            p._memo = None
    if skipped == batches:  # none usable: an empty loader, or only unlabelled batches
        raise ValueError(
            f"every batch of val_loader ({batches}) has no labelled output (every label -100)"
            if batches
            else "val_loader is empty"
        )
    if skipped:
        warnings.warn(
            f"skipped {skipped} of {batches} validation batches with no labelled outputs "
            "(every label -100)",
            stacklevel=3,
        )
    return list(totals / count)
