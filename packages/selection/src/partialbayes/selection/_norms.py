"""Operator norms (largest singular values) of linear maps: exact SVD, Gram eigenvalues, power iteration."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from partialbayes.selection._modules import Grouping, grouped_linear_modules


def spectral_norm_svd(weight: Tensor) -> Tensor:
    """Exact largest singular value of each matrix.

    Args:
        weight: (..., n, m) matrices.

    Returns:
        (...) largest singular values (``torch.linalg.svdvals``), in the dtype of ``weight``.

    Raises:
        ValueError: If ``weight`` has fewer than 2 dimensions or non-finite entries.
    """
    _check_matrices(weight)
    return torch.linalg.svdvals(weight)[..., 0]


def _check_matrices(weight: Tensor) -> None:
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight must be a floating tensor, got {type(weight).__name__}")
    if weight.ndim < 2:
        raise ValueError(f"weight must have shape (..., n, m), got {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight has non-finite entries")


def spectral_norm_gram(weight: Tensor) -> Tensor:
    """Exact largest singular value from the symmetric eigenproblem of the smaller Gram matrix.

    σ₁(W)² is the largest eigenvalue of ``W Wᵀ`` (or ``Wᵀ W``, whichever is smaller). Forming the Gram
    matrix is one matrix product (BLAS-3) and ``eigvalsh`` is much cheaper than an SVD; by Weyl's
    inequality the largest eigenvalue is accurate to about machine precision relative to σ₁², so σ₁ is
    too (small singular values would not be, but they are not needed).

    Args:
        weight: (..., n, m) matrices.

    Returns:
        (...) largest singular values, in the dtype of ``weight``.

    Raises:
        ValueError: If ``weight`` has fewer than 2 dimensions or non-finite entries.
    """
    _check_matrices(weight)
    wt = weight.transpose(-1, -2)
    gram = weight @ wt if weight.shape[-2] <= weight.shape[-1] else wt @ weight
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()


def spectral_norm_power(
    weight: Tensor,
    n_iter: int = 300,
    tol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Largest singular value by power iteration on ``W^T W``, batched over leading dimensions.

    Converges geometrically with ratio (σ₂/σ₁)²; the estimate ``||W v||`` is a lower bound that is
    quadratically accurate in the error of ``v``. Stops when every relative change (checked every 8 iterations) is below ``tol``.

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
    _check_matrices(weight)
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
        raise ValueError(f"n_iter must be an int >= 1, got {n_iter!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < float("inf"):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    v = torch.randn(*weight.shape[:-2], weight.shape[-1], 1, generator=gen, dtype=weight.dtype)
    v = v.to(weight.device)
    v = v / v.norm(dim=-2, keepdim=True).clamp_min(torch.finfo(weight.dtype).tiny)
    wt = weight.transpose(-1, -2)
    sigma = torch.zeros(weight.shape[:-2], dtype=weight.dtype, device=weight.device)
    tiny = torch.finfo(weight.dtype).tiny
    for i in range(n_iter):
        u = weight @ v
        new = u.norm(dim=(-2, -1))
        v = wt @ u
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(tiny)
        # checking convergence synchronises the device: do it every 8 iterations only
        if tol > 0 and i % 8 == 7 and bool(((new - sigma).abs() <= tol * new).all()):
            return new
        sigma = new
    return sigma


def logical_weight(module: nn.Module) -> Tensor:
    """The (n_out x n_in) weight of a linear map (transposing Hugging Face ``Conv1D`` storage)."""
    w = module.weight
    if not isinstance(w, Tensor):
        raise TypeError(f"module {type(module).__name__} has no weight tensor")
    return w.detach().t() if type(module).__name__ == "Conv1D" else w.detach()


def operator_norms(
    model: nn.Module,
    group: str = "all",
    method: str = "svd",
    grouping: Grouping | None = None,
    n_iter: int = 300,
    tol: float = 1e-6,
    modules: Iterable[str] | None = None,
) -> dict[str, float]:
    """Operator norm (largest singular value) of every linear map in ``group``, in model order.

    Matrices of equal shape are stacked and processed in one batched call.

    Args:
        model: The model.
        group: ``"attention"``, ``"mlp"``, ``"other"``, ``"all"`` or a group of the user ``grouping``.
        method: ``"svd"`` (exact, ``svdvals``), ``"gram"`` (exact, ``eigvalsh`` of the smaller Gram
            matrix; faster) or ``"power"`` (power iteration).
        grouping: Optional user grouping (see :func:`module_group`).
        n_iter: Maximum power iterations (``method="power"``).
        tol: Relative tolerance of power iteration.
        modules: Only these linear maps are candidates (e.g. ``lora_modules(model)`` for the LoRA
            adapters); default every linear map not tied to another module.

    Returns:
        Module name -> operator norm.

    Raises:
        ValueError: Unknown ``method``, no linear map in ``group``, non-finite weights (naming the module),
            unknown or tied names in ``modules``.
    """
    if method not in ("svd", "gram", "power"):
        raise ValueError(f"method must be 'svd', 'gram' or 'power', got {method!r}")
    mods = grouped_linear_modules(model, group, grouping, modules)
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
        elif method == "gram":
            vals = spectral_norm_gram(stack)
        else:
            vals = spectral_norm_power(stack, n_iter=n_iter, tol=tol)
        out.update(zip(names, vals.tolist(), strict=True))
    return {n: out[n] for n in mods}
