"""Prior precision (and regression noise) by gradient ascent on the Laplace evidence.

Adam on ``log δ`` (and ``log σ``) until first-order optimality in size-free units: every
``|∂L/∂log δ_m| / d_m`` (``d_m`` the module's entries; it lies in ``[-½ δ_m ‖θ*_m‖²/d_m, ½]``) and
``|∂L/∂log σ| / (N C)`` is at most ``tol``. Running out of steps is reported (``converged=False``, a warning).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.curvature._prior import check_positive
from partialbayes.predictive.internal import check_bool, check_int, check_number


@dataclass(frozen=True)
class MarglikFit:
    """Result of the gradient ascent on the Laplace evidence (``optimize_prior_precision(optimizer="gradient")``).

    Attributes:
        prior_precision: Fitted prior precision per module, ``[M]`` (float64, cpu), in ``modules`` order.
        modules: The posterior's modules (prior groups).
        sigma_noise: Fitted observation noise (regression with ``fit_sigma_noise``), else ``None``.
        log_marginal_likelihood: Evidence at the returned values.
        steps: Adam steps taken.
        converged: Whether every scaled gradient fell to ``tol`` or below within ``max_steps``.
        max_scaled_gradient: The largest scaled gradient at the returned values (see the module notes).
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


def _check_options(per_module: bool, lr: float, max_steps: int, tol: float) -> None:
    check_bool("per_module", per_module)
    check_number("lr", lr)
    check_number("tol", tol)
    check_int("max_steps", max_steps)


def maximize_evidence(
    evidence: Callable[[Tensor, Tensor | None], Tensor],
    init_prior: Tensor,
    prior_scale: Tensor,
    modules: tuple[str, ...],
    *,
    init_sigma: float | None = None,
    sigma_scale: float = 1.0,
    per_module: bool = True,
    lr: float = 0.1,
    max_steps: int = 1000,
    tol: float = 1e-4,
) -> MarglikFit:
    """Adam on ``log δ`` ``[M]`` (or one shared value) and optionally ``log σ`` of ``evidence(δ, σ)``, to a stationary point.

    ``prior_scale`` ``[M]`` and ``sigma_scale`` scale the gradients (``d_m``, ``N C``); the shared start is the
    geometric mean of ``init_prior``.
    """
    _check_options(per_module, lr, max_steps, tol)
    with torch.no_grad():
        if not bool(((init_prior > 0) & torch.isfinite(init_prior)).all()):
            raise ValueError(
                f"init prior precision must be positive and finite, got {init_prior.tolist()}"
            )
    if init_sigma is not None:
        check_positive("init sigma_noise", init_sigma)
    n = init_prior.shape[0]
    start = init_prior.detach().log()
    scale = prior_scale.detach().to(start)
    if not per_module:
        start, scale = start.mean().reshape(1), scale.sum().reshape(1)
    log_prior = start.clone().requires_grad_(True)
    params = [log_prior]
    log_sigma = None
    if init_sigma is not None:
        log_sigma = torch.tensor(math.log(init_sigma), dtype=start.dtype, device=start.device)
        params.append(log_sigma.requires_grad_(True))
    opt = torch.optim.Adam(params, lr=lr)
    history: list[float] = []
    converged = False
    worst = math.inf
    for step in range(max_steps + 1):
        prior = log_prior.exp().expand(n)
        sigma = None if log_sigma is None else log_sigma.exp()
        value = evidence(prior, sigma)
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
            UserWarning,
            stacklevel=3,  # the user's call of optimize_prior_precision
        )
    return MarglikFit(
        prior_precision=log_prior.detach().exp().expand(n).to("cpu", torch.float64).clone(),
        modules=modules,
        sigma_noise=None if log_sigma is None else float(log_sigma.detach().exp()),
        log_marginal_likelihood=history[-1],
        steps=len(history) - 1,
        converged=converged,
        max_scaled_gradient=worst,
        history=tuple(history),
    )
