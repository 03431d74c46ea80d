"""Conjugate gradients for symmetric positive-definite operators."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


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
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = (r * r).sum(0)
    b_norm = b.norm(dim=0).clamp_min(torch.finfo(b.dtype).tiny)
    for _ in range(max_iter or b.shape[0]):
        if bool((rs.sqrt() / b_norm <= tol).all()):
            break
        hp = matvec(p)
        curv = (p * hp).sum(0)
        if bool((curv <= 0).any()):
            raise ValueError(
                "matvec is not positive definite: p^T H p <= 0 met in conjugate gradients"
            )
        alpha = rs / curv
        x = x + alpha * p
        r = r - alpha * hp
        rs_new = (r * r).sum(0)
        p = r + (rs_new / rs) * p
        rs = rs_new
    return x
