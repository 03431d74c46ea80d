"""Operator norms (largest singular values) of linear maps: exact SVD and batched power iteration."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from partialbayes.selection._modules import Grouping, grouped_linear_modules


def spectral_norm_svd(weight: Tensor) -> Tensor:
    """Exact largest singular value of each matrix.

    Args:
        weight: (..., n, m) matrices.

    Returns:
        (...) largest singular values (``torch.linalg.svdvals``), in the dtype of ``weight``.
    """
    return torch.linalg.svdvals(weight)[..., 0]


def spectral_norm_power(
    weight: Tensor,
    n_iter: int = 300,
    tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Largest singular value by power iteration on ``W^T W``, batched over leading dimensions.

    Converges geometrically with ratio (σ₂/σ₁)²; the estimate ``||W v||`` is a lower bound that is
    quadratically accurate in the error of ``v``. Stops when every relative change is below ``tol``.

    Args:
        weight: (..., n, m) matrices.
        n_iter: Maximum number of iterations.
        tol: Relative tolerance on the change of the estimate.
        generator: Generator for the random start (cpu); default a fixed seed 0.

    Returns:
        (...) estimates of the largest singular values.

    Raises:
        ValueError: If ``weight`` has fewer than 2 dimensions or non-finite entries, or n_iter < 1.
    """
    if weight.ndim < 2:
        raise ValueError(f"weight must have shape (..., n, m), got {tuple(weight.shape)}")
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight has non-finite entries")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    v = torch.randn(*weight.shape[:-2], weight.shape[-1], 1, generator=gen, dtype=weight.dtype)
    v = v.to(weight.device)
    v = v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(weight.dtype).tiny)
    wt = weight.transpose(-1, -2)
    sigma = torch.zeros(weight.shape[:-2], dtype=weight.dtype, device=weight.device)
    for _ in range(n_iter):
        u = weight @ v
        new = u.norm(dim=(-2, -1))
        v = wt @ u
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(weight.dtype).tiny)
        done = bool(((new - sigma).abs() <= tol * new.abs()).all())
        sigma = new
        if done:
            break
    return sigma


def logical_weight(module: nn.Module) -> Tensor:
    """The (n_out x n_in) weight of a linear map (transposing Hugging Face ``Conv1D`` storage)."""
    w = module.weight.detach()
    return w.t() if type(module).__name__ == "Conv1D" else w


def operator_norms(
    model: nn.Module,
    group: str = "all",
    method: str = "svd",
    grouping: Grouping | None = None,
    n_iter: int = 300,
    tol: float = 1e-6,
) -> dict[str, float]:
    """Operator norm (largest singular value) of every linear map in ``group``, in model order.

    Matrices of equal shape are stacked and processed in one batched call.

    Args:
        model: The model.
        group: ``"attention"``, ``"mlp"``, ``"all"`` or a group of the user ``grouping``.
        method: ``"svd"`` (exact) or ``"power"`` (power iteration).
        grouping: Optional user grouping (see :func:`module_group`).
        n_iter: Maximum power iterations (``method="power"``).
        tol: Relative tolerance of power iteration.

    Returns:
        Module name -> operator norm.

    Raises:
        ValueError: Unknown ``method``, no linear map in ``group``, non-finite weights (naming the module).
    """
    if method not in ("svd", "power"):
        raise ValueError(f"method must be 'svd' or 'power', got {method!r}")
    mods = grouped_linear_modules(model, group, grouping)
    by_shape: dict[tuple, list[str]] = defaultdict(list)
    weights = {}
    for name, mod in mods.items():
        w = logical_weight(mod)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"weight of module {name!r} has non-finite entries")
        weights[name] = w
        by_shape[(tuple(w.shape), w.dtype, w.device)].append(name)
    out: dict[str, float] = {}
    for names in by_shape.values():
        stack = torch.stack([weights[n] for n in names])
        if method == "svd":
            vals = spectral_norm_svd(stack)
        else:
            vals = spectral_norm_power(stack, n_iter=n_iter, tol=tol)
        out.update(zip(names, vals.tolist(), strict=True))
    return {n: out[n] for n in mods}
