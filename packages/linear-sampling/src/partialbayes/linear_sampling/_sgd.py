"""Settings, diagnostics and the plain minibatch SGD solver of ``½ xᵀHx − cᵀx`` (Nesterov, Polyak averaging)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from partialbayes.linear_sampling._ops import Problem
from partialbayes.predictive.internal import check_bool, check_fields, ranged

GradFn = Callable[[Tensor, Tensor], Tensor]
"""``(x [d, k], idx [b]) -> stochastic gradient [d, k]`` (already scaled to the full sum)."""


class DivergenceError(ValueError):
    """The optimiser diverged; the message says which setting to lower."""


@dataclass(frozen=True)
class SGDConfig:
    """Settings of the minibatch solvers: variance-reduced SVRG (default) or the plain SGD of Antorán et al.

    Attributes:
        lr: Fixed step size; ``None`` sets ``lr_scale / λ̂`` with ``λ̂`` a power-iteration estimate of the
            largest eigenvalue of the minibatch curvature, and halves it (restarting from the best
            snapshot) whenever a check finds that the objective did not decrease.
        lr_scale: Fraction of ``1/λ̂`` used when ``lr`` is ``None``.
        momentum: Nesterov momentum in ``[0, 1)``.
        variance_reduction: Use the variance-reduced solver (default) instead of plain SGD.
        polyak: Plain SGD only: decay of the exponential iterate average in ``[0, 1)`` (0 disables
            averaging); the average is bias-corrected as in Adam.
        batch_size: Observations per step (default ``min(n, 256)``). The variance-reduced solver
            splits each shuffled epoch into ``ceil(n / batch_size)`` batches of equal size (±1); plain
            SGD draws each batch of exactly ``batch_size`` observations independently, with replacement.
        max_epochs: Passes over the data at most (the checks' full passes not counted).
        tol: Stop when the certified bound on the relative error of the solution, in the norm of
            ``H`` and over all columns together, is at most ``tol``; ``SolveInfo.converged`` says
            whether it was met.
        check_every: Steps between checks (each one full pass over the data; default one epoch).
        divergence_factor: Stop with [`DivergenceError`][partialbayes.linear_sampling.DivergenceError]
            when, at a fixed ``lr``, the residual grows to this multiple of its initial size.
    """

    lr: float | None = ranged(None, "(0, inf)", optional=True)
    lr_scale: float = ranged(0.5, "(0, inf)")
    momentum: float = ranged(0.5, "[0, 1)")
    variance_reduction: bool = True
    polyak: float = ranged(0.99, "[0, 1)")
    batch_size: int | None = ranged(None, "[1, inf)", int, optional=True)
    max_epochs: int = ranged(100, "[1, inf)", int)
    tol: float = ranged(1e-2, "[0, inf)")
    check_every: int | None = ranged(None, "[1, inf)", int, optional=True)
    divergence_factor: float = ranged(1e4, "(1, inf)")

    def __post_init__(self) -> None:
        check_fields(self)
        check_bool("SGDConfig.variance_reduction", self.variance_reduction)


@dataclass
class SolveInfo:
    """What an iterative solve did.

    Attributes:
        method: ``"cg"`` or ``"sgd"``.
        steps: Iterations (CG) or optimiser steps (SGD).
        converged: Whether the tolerance was met.
        lr: Final step size (SGD only; smaller than the first one when it was halved).
        history: One entry per check. SGD: ``step``, ``epoch``, ``objective``, ``error_bound`` and ``lr``;
            CG: the final relative ``residual``.
        error_bound: SGD: the certified bound on the relative error (see ``SGDConfig.tol``); CG: ``None``.
    """

    method: str
    steps: int
    converged: bool
    lr: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    error_bound: float | None = None

    def record(self, step: int, epoch: float, objective: float, bound: float, lr: float) -> None:
        """Append one SGD check to ``history``."""
        entry = {"step": step, "epoch": epoch, "objective": objective, "error_bound": bound}
        self.history.append({**entry, "lr": lr})


def error_bound(r: Tensor, x: Tensor, c: Tensor, a: Tensor) -> tuple[float, float, float]:
    """Objective and certified relative error of ``x`` for ``Hx = c``, from the residual ``r = Hx − c``.

    With ``x* = H⁻¹c`` and ``H ⪰ A`` (the data term is positive semi-definite),
    ``‖x − x*‖²_H = rᵀH⁻¹r ≤ rᵀA⁻¹r``, and by Cauchy–Schwarz in the ``H`` inner product
    ``‖x*‖²_H ≥ (cᵀx)² / xᵀHx``. Summed over the ``k`` columns, the returned bound ``ε`` satisfies
    ``Σ_j ‖x_j − x_j*‖²_H ≤ ε² Σ_j ‖x_j*‖²_H``. It is pessimistic by up to ``sqrt(λ_max(H) / α)`` in
    the directions the data determine well. ``r, x, c`` are ``[d, k]``, ``a = diag(A)`` is ``[d]``.

    Returns:
        ``(objective ½xᵀHx − cᵀx averaged over columns, bound ε, ‖r‖²_{A⁻¹} summed over columns)``;
        ``ε`` is 0 when ``r = 0`` and ``inf`` when nothing bounds ``‖x*‖_H`` from below.
    """
    hx = r + c
    xhx = (x * hx).sum(0)
    cx = (c * x).sum(0)
    objective = float((0.5 * xhx - cx).mean())
    num = float((r * r / a.unsqueeze(1)).sum())
    den = float(torch.where(xhx > 0, cx * cx / xhx.clamp_min(torch.finfo(x.dtype).tiny), 0).sum())
    if num == 0:
        return objective, 0.0, num
    if not (math.isfinite(num) and den > 0):
        return objective, math.inf, num
    return objective, math.sqrt(num / den), num


def diverged(what: str, step: int, lr: float, mu: float) -> DivergenceError:
    """A [`DivergenceError`][partialbayes.linear_sampling.DivergenceError] with the usual advice."""
    return DivergenceError(
        f"SGD diverged at step {step} ({what}): lower the learning rate (lr={lr:.3g}; lower lr, "
        f"or leave lr=None for an automatic step that is halved when it fails) or the momentum "
        f"(momentum={mu})"
    )


def sgd_minimise(
    problem: Problem,
    grad_fn: GradFn,
    x0: Tensor,
    batch_size: int,
    config: SGDConfig,
    lr: float,
    generator: torch.Generator | None,
) -> tuple[Tensor, SolveInfo]:
    """Plain minibatch Nesterov SGD with exponential iterate averaging (Antorán et al., 2023).

    Minibatches are drawn with replacement (unbiased gradients); every ``check_every`` steps one full pass
    checks the averaged iterate. Returns ``(x [d, k], info)``; raises `DivergenceError`.
    """
    residual_fn, c, a, n = problem.residual, problem.c, problem.a, problem.features.n
    x = x0.clone()
    vel = torch.zeros_like(x)
    avg = torch.zeros_like(x)
    steps_per_epoch = math.ceil(n / batch_size)
    check_every = config.check_every or steps_per_epoch
    info = SolveInfo("sgd", 0, False, lr=lr)
    mu, rho = config.momentum, config.polyak
    _, _, first = error_bound(residual_fn(x), x, c, a)
    current = x
    bound = math.inf
    full = torch.arange(n, device=x.device)
    for step in range(1, config.max_epochs * steps_per_epoch + 1):
        if batch_size >= n:
            idx = full
        else:
            idx = torch.randint(n, (batch_size,), generator=generator).to(x.device)
        grad = grad_fn(x, idx)
        vel = mu * vel + grad
        x = x - lr * (grad + mu * vel)
        if not bool(torch.isfinite(x).all()):
            raise diverged("the iterate is no longer finite", step, lr, mu)
        avg = rho * avg + (1 - rho) * x
        if step % check_every and step != config.max_epochs * steps_per_epoch:
            continue
        current = avg / (1 - rho**step)
        objective, bound, num = error_bound(residual_fn(current), current, c, a)
        info.steps = step
        info.record(step, step / steps_per_epoch, objective, bound, lr)
        if not math.isfinite(num) or num > config.divergence_factor**2 * max(first, 1e-300):
            raise diverged(f"residual grew from {math.sqrt(first):.3g}", step, lr, mu)
        if bound <= config.tol:
            info.converged = True
            break
    info.error_bound = bound
    return current, info
