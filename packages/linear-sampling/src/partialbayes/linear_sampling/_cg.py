"""Conjugate gradients for symmetric positive-definite operators, several right-hand sides jointly."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def cg_solve(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    tol: float = 1e-8,
    max_iter: int | None = None,
    x0: Tensor | None = None,
) -> tuple[Tensor, int, Tensor]:
    """Conjugate gradients returning the iterate, the iteration count and the relative residuals.

    Columns that have converged are frozen (no division by a zero residual).

    Args:
        matvec: ``v -> H v`` for ``v`` of shape ``[d, k]``.
        b: Right-hand sides ``[d, k]``.
        tol: Relative residual tolerance ``‖r‖ / ‖b‖`` per column.
        max_iter: Iteration cap, default ``d``.
        x0: Initial guess ``[d, k]`` (default zeros).

    Returns:
        ``(x [d, k], iterations, relative residual [k])``.

    Raises:
        ValueError: If the operator is not positive definite along a search direction, or a residual
            becomes non-finite.
    """
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - matvec(x) if x0 is not None else b.clone()
    p = r.clone()
    rs = (r * r).sum(0)
    b_norm = b.norm(dim=0).clamp_min(torch.finfo(b.dtype).tiny)
    it = 0
    for it in range(max_iter or b.shape[0]):  # noqa: B007
        active = rs.sqrt() / b_norm > tol
        if not bool(active.any()):
            break
        hp = matvec(p)
        curv = (p * hp).sum(0)
        if bool((curv[active] <= 0).any()):
            raise ValueError(
                "matvec is not positive definite: pᵀ H p <= 0 met in conjugate gradients "
                "(check that the precisions are positive)"
            )
        alpha = torch.where(active, rs / torch.where(active, curv, 1.0), 0.0)
        x = x + alpha * p
        r = r - alpha * hp
        rs_new = (r * r).sum(0)
        if not bool(torch.isfinite(rs_new).all()):
            raise ValueError("conjugate gradients produced a non-finite residual")
        beta = torch.where(active, rs_new / torch.where(active, rs, 1.0), 0.0)
        p = torch.where(active, r + beta * p, p)
        rs = torch.where(active, rs_new, rs)
    else:
        it += 1
    return x, it, rs.sqrt() / b_norm


def conjugate_gradients(
    matvec: Callable[[Tensor], Tensor], b: Tensor, tol: float = 1e-8, max_iter: int | None = None
) -> Tensor:
    """Solve ``H x = b`` for a symmetric positive-definite ``H`` given as ``matvec``.

    Args:
        matvec: ``v -> H v`` for ``v`` of shape ``[d]`` or ``[d, k]`` (k right-hand sides solved jointly).
        b: Right-hand side(s), ``[d]`` or ``[d, k]``.
        tol: Relative residual tolerance ``‖r‖ / ‖b‖`` per column.
        max_iter: Iteration cap, default ``d``.

    Returns:
        ``x`` with the shape of ``b``.

    Raises:
        ValueError: If the operator is not positive definite along a search direction.
    """
    if b.ndim == 1:
        x, _, _ = cg_solve(lambda v: matvec(v[:, 0]).unsqueeze(1), b.unsqueeze(1), tol, max_iter)
        return x[:, 0]
    return cg_solve(matvec, b, tol, max_iter)[0]
