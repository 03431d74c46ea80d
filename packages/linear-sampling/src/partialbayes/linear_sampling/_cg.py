"""Conjugate gradients for symmetric positive-definite operators, several right-hand sides jointly."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from partialbayes.predictive.internal import (
    check_finite,
    check_int,
    check_number,
    check_tensor,
    check_type,
)


def check_options(tol: object, max_iter: object) -> None:
    """Raise unless ``tol`` is a finite number >= 0 and ``max_iter`` a positive int or ``None``."""
    check_number("tol", tol, "[0, inf)")
    if max_iter is not None:
        check_int("max_iter", max_iter)


def cg_solve(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    tol: float = 1e-8,
    max_iter: int | None = None,
    x0: Tensor | None = None,
) -> tuple[Tensor, int, Tensor]:
    """`conjugate_gradients` on ``b [d, k]`` from ``x0``: ``(x [d, k], iterations, relative residual [k])``.

    Columns that have converged are frozen (no division by a zero residual).
    """
    check_finite(b, "conjugate gradients: the right-hand side b has non-finite entries")
    x = torch.zeros_like(b) if x0 is None else x0.clone()
    r = b - matvec(x) if x0 is not None else b.clone()
    check_finite(r, "conjugate gradients: the initial residual b - H x0 is not finite")
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
        check_finite(rs_new, "conjugate gradients produced a non-finite residual")
        beta = torch.where(active, rs_new / torch.where(active, rs, 1.0), 0.0)
        p = torch.where(active, r + beta * p, p)
        rs = torch.where(active, rs_new, rs)
    else:
        it += 1
    return x, it, rs.sqrt() / b_norm


def conjugate_gradients(
    matvec: Callable[[Tensor], Tensor], b: Tensor, tol: float = 1e-8, max_iter: int | None = None
) -> Tensor:
    """Solve ``H x = b`` (``b``: ``[d]`` or ``[d, k]``, columns jointly) for a symmetric positive-definite ``H``.

    ``matvec`` is ``v -> H v`` on ``b``'s shape; ``tol`` bounds ``‖r‖ / ‖b‖`` per column; ``max_iter``
    defaults to ``d``. Returns ``x`` of ``b``'s shape.

    Raises:
        TypeError: If ``b`` is not a floating tensor, ``matvec`` is not callable or ``tol`` no number.
        ValueError: If ``b`` has NaN or inf entries or the wrong rank, ``tol`` or ``max_iter`` are
            out of range, ``matvec`` returns the wrong shape or non-finite values, or the operator
            is not positive definite along a search direction.
    """
    check_type("matvec", matvec, Callable, "callable")
    check_tensor("b", b, finite=False, what="a floating tensor")
    if b.ndim not in (1, 2) or b.numel() == 0:
        raise ValueError(f"b must have shape [d] or [d, k] with d, k >= 1, got {tuple(b.shape)}")
    check_options(tol, max_iter)

    def checked(v: Tensor) -> Tensor:
        arg = v[:, 0] if b.ndim == 1 else v
        out = matvec(arg)
        if not isinstance(out, Tensor) or out.shape != arg.shape:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"matvec returned {shape} for an input of shape {tuple(arg.shape)}; "
                "it must return the shape of its input"
            )
        check_finite(out, "matvec returned NaN or inf")
        return out.unsqueeze(1) if b.ndim == 1 else out

    if b.ndim == 1:
        x, _, _ = cg_solve(checked, b.unsqueeze(1), tol, max_iter)
        return x[:, 0]
    return cg_solve(checked, b, tol, max_iter)[0]
