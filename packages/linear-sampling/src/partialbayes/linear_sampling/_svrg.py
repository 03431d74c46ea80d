"""Variance-reduced minibatch solver (SVRG with Nesterov momentum) for ``Hx = c``, ``H = ΦᵀBΦ + A``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from partialbayes.linear_sampling._ops import Problem
from partialbayes.linear_sampling._sgd import (
    DivergenceError,
    SGDConfig,
    SolveInfo,
    diverged,
    error_bound,
)
from partialbayes.predictive.internal import check_finite

_MAX_HALVINGS = 30


def shuffled_batches(
    n: int, n_batches: int, device: torch.device, generator: torch.Generator | None
) -> Iterator[Tensor]:
    """Endless ``[b]`` index batches: each epoch a fresh permutation split into ``n_batches`` parts."""
    while True:
        order = torch.randperm(n, generator=generator).to(device)
        yield from torch.tensor_split(order, n_batches)


def svrg_minimise(
    problem: Problem,
    x0: Tensor,
    batch_size: int,
    config: SGDConfig,
    lr: float,
    adapt_lr: bool,
    generator: torch.Generator | None,
) -> tuple[Tensor, SolveInfo]:
    """Minimise ``½xᵀHx − cᵀx`` (columns jointly) with variance-reduced minibatch Nesterov steps.

    Every ``check_every`` steps a full pass gives the next snapshot's gradient, the objective and the certified
    error bound (stop at ``config.tol``). With ``adapt_lr`` a check without progress halves the step and
    restarts from the best snapshot. Returns ``(x [d, k], info)``; raises `DivergenceError`.
    """
    residual_fn, c, a, n = problem.residual, problem.c, problem.a, problem.features.n
    steps_per_epoch = math.ceil(n / batch_size)
    check_every = config.check_every or steps_per_epoch
    total = config.max_epochs * steps_per_epoch
    batches = shuffled_batches(n, steps_per_epoch, x0.device, generator)
    mu = config.momentum
    info = SolveInfo("sgd", 0, False, lr=lr)

    x = x0.clone()
    r = residual_fn(x)
    objective, bound, first = error_bound(r, x, c, a)
    check_finite(first, "the residual at the initial point is not finite")
    info.record(0, 0.0, objective, bound, lr)
    best = (objective, x, r, bound)
    vel = torch.zeros_like(x)
    step = halvings = 0
    while bound > config.tol and step < total:
        snap, grad_snap = x, r
        finite = True
        for _ in range(min(check_every, total - step)):
            grad = problem.batch_matvec(x - snap, next(batches)) + grad_snap
            vel = mu * vel + grad
            x = x - lr * (grad + mu * vel)
            step += 1
            if not bool(torch.isfinite(x).all()):
                finite = False
                break
        if finite:
            r = residual_fn(x)
            objective, bound, num = error_bound(r, x, c, a)
            finite = math.isfinite(num) and math.isfinite(objective)
        else:
            objective, bound, num = math.inf, math.inf, math.inf
        info.record(step, step / steps_per_epoch, objective, bound, lr)
        slack = 64 * torch.finfo(x.dtype).eps * abs(best[0])
        if finite and objective <= best[0] + slack:
            best = (objective, x, r, bound)
            continue
        if not adapt_lr:
            if not finite or num > config.divergence_factor**2 * max(first, 1e-300):
                what = "the iterate is no longer finite" if not finite else "the residual grew"
                raise diverged(what, step, lr, mu)
            best = (objective, x, r, bound)
            continue
        halvings += 1
        if halvings > _MAX_HALVINGS:
            raise DivergenceError(
                f"SGD made no progress: the objective did not decrease although the step was halved "
                f"{_MAX_HALVINGS} times (now lr={lr:.3g}); check the features (a non-linear or "
                "inconsistent jvp / vjp pair) or use method='cg'"
            )
        lr /= 2
        objective, x, r, bound = best
        vel = torch.zeros_like(x)
    info.steps, info.lr, info.error_bound = step, lr, bound
    info.converged = bound <= config.tol
    return x, info
