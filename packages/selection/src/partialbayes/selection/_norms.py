"""Operator norms (largest singular values) of linear maps: exact SVD, Gram eigenvalues, power iteration."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from partialbayes.selection._modules import Grouping, grouped_linear_modules, is_conv1d
from partialbayes.selection._validate import check_finite


def spectral_norm_svd(weight: Tensor) -> Tensor:
    """Largest singular values ``[...]`` of finite matrices ``[..., n, m]``, exact (``svdvals``)."""
    return torch.linalg.svdvals(weight)[..., 0]


def spectral_norm_gram(weight: Tensor) -> Tensor:
    """Largest singular values, exact, from ``eigvalsh`` of the smaller Gram matrix (``W Wᵀ`` or ``Wᵀ W``).

    One BLAS-3 product and a symmetric eigenproblem, cheaper than an SVD; by Weyl's inequality σ₁² (hence
    σ₁) is accurate to about machine precision.
    """
    wt = weight.transpose(-1, -2)
    gram = weight @ wt if weight.shape[-2] <= weight.shape[-1] else wt @ weight
    return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0).sqrt()


def spectral_norm_power(
    weight: Tensor, n_iter: int = 300, tol: float = 1e-6, generator: torch.Generator | None = None
) -> Tensor:
    """Largest singular values by power iteration on ``Wᵀ W`` (random start: ``generator``, else seed 0).

    Converges with ratio (σ₂/σ₁)²; ``||W v||`` is a lower bound. Stops after ``n_iter`` iterations, or when
    every relative change (checked every 8 iterations) is below ``tol``.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    v = torch.randn(*weight.shape[:-2], weight.shape[-1], 1, generator=gen, dtype=weight.dtype)
    tiny = torch.finfo(weight.dtype).tiny
    v = v.to(weight.device)
    v = v / v.norm(dim=-2, keepdim=True).clamp_min(tiny)
    wt = weight.transpose(-1, -2)
    sigma = torch.zeros(weight.shape[:-2], dtype=weight.dtype, device=weight.device)
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
    return module.weight.detach().t() if is_conv1d(module) else module.weight.detach()


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

    ``method``: ``"svd"`` (exact), ``"gram"`` (exact, faster) or ``"power"`` (``n_iter``, ``tol``); matrices
    of equal shape go through one batched call. ``group``, ``grouping`` and ``modules`` select the maps as
    in `grouped_linear_modules`. Non-finite weights raise, naming the module.
    """
    if method not in ("svd", "gram", "power"):
        raise ValueError(f"method must be 'svd', 'gram' or 'power', got {method!r}")
    mods = grouped_linear_modules(model, group, grouping, modules)
    by_shape: dict[tuple, list[str]] = defaultdict(list)
    weights = {}
    for name, mod in mods.items():
        w = logical_weight(mod)
        check_finite(f"weight of module {name!r}", w)
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
