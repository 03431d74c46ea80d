"""Minibatch SGD with Nesterov momentum, Polyak (exponential) iterate averaging and monitoring."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

GradFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""``(x [d, k], idx [b]) -> (stochastic gradient [d, k], stochastic objective [k])``."""


class DivergenceError(ValueError):
    """The optimiser diverged; the message says which setting to lower."""


@dataclass(frozen=True)
class SGDConfig:
    """Settings of the minibatch optimiser.

    Attributes:
        lr: Step size; ``None`` sets ``lr_scale / λ̂`` with ``λ̂`` a power-iteration estimate of the
            largest eigenvalue of the minibatch curvature.
        lr_scale: Fraction of ``1/λ̂`` used when ``lr`` is ``None``.
        momentum: Nesterov momentum in ``[0, 1)``.
        polyak: Decay of the exponential iterate average in ``[0, 1)`` (0 disables averaging); the
            average is bias-corrected as in Adam.
        batch_size: Observations per step (default ``min(n, 256)``).
        max_epochs: Passes over the data at most.
        tol: Stop when the averaged iterate moves by less than ``tol`` (relative, every column) over
            one check interval.
        check_every: Steps between convergence checks (default one epoch).
        divergence_factor: Stop with [`DivergenceError`][partialbayes.linear_sampling.DivergenceError]
            when the minibatch objective exceeds this multiple of its initial value.
    """

    lr: float | None = None
    lr_scale: float = 0.5
    momentum: float = 0.9
    polyak: float = 0.99
    batch_size: int | None = None
    max_epochs: int = 100
    tol: float = 1e-4
    check_every: int | None = None
    divergence_factor: float = 1e4

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not self.lr_scale > 0:
            raise ValueError(f"lr_scale must be positive, got {self.lr_scale}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.polyak < 1:
            raise ValueError(f"polyak must be in [0, 1), got {self.polyak}")
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {self.max_epochs}")
        if self.divergence_factor <= 1:
            raise ValueError(f"divergence_factor must exceed 1, got {self.divergence_factor}")


@dataclass
class SolveInfo:
    """What an iterative solve did.

    Attributes:
        method: ``"cg"`` or ``"sgd"``.
        steps: Iterations (CG) or optimiser steps (SGD).
        converged: Whether the tolerance was met.
        lr: Step size used (SGD only).
        history: One entry per check: ``step``, minibatch ``objective`` (mean over columns) and relative
            ``change`` of the averaged iterate (SGD), or the final relative ``residual`` (CG).
    """

    method: str
    steps: int
    converged: bool
    lr: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def sgd_minimise(
    grad_fn: GradFn,
    x0: Tensor,
    n: int,
    batch_size: int,
    config: SGDConfig,
    lr: float,
    generator: torch.Generator | None,
) -> tuple[Tensor, SolveInfo]:
    """Minimise a sum over ``n`` observations by minibatch Nesterov SGD with iterate averaging.

    Args:
        grad_fn: Minibatch gradient and objective estimates (already scaled to the full sum).
        x0: Initial iterate ``[d, k]``.
        n: Number of observations.
        batch_size: Observations per step.
        config: Optimiser settings.
        lr: Step size.
        generator: CPU generator for the minibatch order.

    Returns:
        ``(averaged iterate [d, k], info)``.

    Raises:
        DivergenceError: If the objective grows beyond ``divergence_factor`` times its initial value or
            becomes non-finite.
    """
    x = x0.clone()
    vel = torch.zeros_like(x)
    avg = torch.zeros_like(x)
    steps_per_epoch = math.ceil(n / batch_size)
    check_every = config.check_every or steps_per_epoch
    info = SolveInfo("sgd", 0, False, lr=lr)
    prev = x.clone()
    first: float | None = None
    step = 0
    mu, rho = config.momentum, config.polyak
    for _ in range(config.max_epochs):
        order = torch.randperm(n, generator=generator).to(x.device)
        for start in range(0, n, batch_size):
            grad, obj = grad_fn(x, order[start : start + batch_size])
            value = float(obj.mean())
            if first is None:
                first = abs(value)
            if not math.isfinite(value) or abs(value) > config.divergence_factor * max(
                first, 1e-30
            ):
                raise DivergenceError(
                    f"SGD diverged at step {step} (objective {value:.3g}, initially {first:.3g}): "
                    f"lower the learning rate (lr={lr:.3g}; lower lr or lr_scale) or the momentum "
                    f"(momentum={mu}), or use a smaller batch-size-to-n imbalance"
                )
            vel = mu * vel + grad
            x = x - lr * (grad + mu * vel)
            step += 1
            avg = rho * avg + (1 - rho) * x
            if step % check_every:
                continue
            current = avg / (1 - rho**step)
            change = ((current - prev).norm(dim=0) / current.norm(dim=0).clamp_min(1e-30)).max()
            prev = current
            info.history.append({"step": step, "objective": value, "change": float(change)})
            if float(change) < config.tol:
                info.steps, info.converged = step, True
                return current, info
    info.steps = step
    return avg / (1 - rho**step), info


def power_max_eigenvalue(
    matvec: Callable[[Tensor, int], Tensor],
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    iters: int = 20,
    generator: torch.Generator | None = None,
) -> float:
    """Largest eigenvalue of a PSD operator by power iteration (matvec may vary with the iteration).

    Args:
        matvec: ``(v [d, 1], iteration) -> H v``.
        d: Dimension.
        dtype: Floating dtype.
        device: Device.
        iters: Iterations.
        generator: CPU generator for the start vector.

    Returns:
        The largest Rayleigh quotient seen (an estimate from below).
    """
    v = torch.randn(d, 1, generator=generator, dtype=dtype).to(device)
    v = v / v.norm()
    best = 0.0
    for i in range(iters):
        hv = matvec(v, i)
        best = max(best, float((v * hv).sum()))
        norm = hv.norm()
        if not bool(norm > 0):
            break
        v = hv / norm
    return best
