"""Input validation shared by every public function: clear errors that name the argument at fault."""

from __future__ import annotations

import torch
from torch import Tensor

#: Absolute tolerance on ``sum(p) == 1`` and ``p >= 0`` for probability inputs (any dtype).
PROB_ATOL = 1e-4


def check_tensor(name: str, x: object, *, floating: bool = True) -> Tensor:
    """Check that ``x`` is a tensor (floating point when asked) with only finite entries."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {n_bad} NaN or infinite value(s)")
    return x


def check_same_device(**tensors: Tensor) -> None:
    """Check that every tensor lives on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_ndim(name: str, x: Tensor, ndim: int, shape_doc: str) -> None:
    """Check the number of dimensions of ``x``."""
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(x.shape)}")


def check_probs(name: str, probs: object) -> Tensor:
    """Check categorical probabilities ``[..., C]``: finite, non-negative, rows sum to one."""
    p = check_tensor(name, probs)
    if p.ndim < 1 or p.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., C] with C >= 1, got {tuple(p.shape)}")
    if bool((p < -PROB_ATOL).any()):
        raise ValueError(f"{name} has negative probabilities (min {float(p.min()):.3g})")
    err = (p.sum(-1) - 1).abs()
    if p.numel() and bool((err > PROB_ATOL).any()):
        raise ValueError(
            f"{name} rows must sum to 1 over the last dimension "
            f"(largest deviation {float(err.max()):.3g}); pass probabilities, not logits"
        )
    return p


def check_nonneg(name: str, x: object) -> Tensor:
    """Check a variance-like tensor: finite and non-negative."""
    v = check_tensor(name, x)
    if bool((v < 0).any()):
        raise ValueError(f"{name} must be non-negative (min {float(v.min()):.3g})")
    return v


def check_labels(name: str, labels: object, n: int, n_classes: int | None) -> Tensor:
    """Check integer labels ``[N]`` with values in ``[0, n_classes)``."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(labels.shape)}")
    if n_classes is not None and n > 0:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(f"{name} must lie in [0, {n_classes}); got values in [{lo}, {hi}]")
    return labels


def gaussian_logits(mean: object, cov: object) -> tuple[Tensor, Tensor, bool]:
    """Validate Gaussian logits ``N(mean, cov)``.

    Args:
        mean: ``[..., C]``.
        cov: ``[..., C]`` (diagonal variances) or ``[..., C, C]`` (full covariance).

    Returns:
        ``(mean, cov, is_full)``; a full ``cov`` is symmetrised.
    """
    mu = check_tensor("mean", mean)
    var = check_tensor("cov", cov)
    check_same_device(mean=mu, cov=var)
    if mu.ndim < 1:
        raise ValueError(f"mean must have shape [..., C], got {tuple(mu.shape)}")
    if var.dtype != mu.dtype:
        raise TypeError(f"mean and cov must share a dtype, got {mu.dtype} and {var.dtype}")
    if var.shape == mu.shape:
        return mu, check_nonneg("cov", var), False
    c = mu.shape[-1]
    if var.shape != (*mu.shape, c):
        raise ValueError(
            f"cov must have shape {tuple(mu.shape)} (variances) or {(*mu.shape, c)} "
            f"(covariances) to match mean {tuple(mu.shape)}, got {tuple(var.shape)}"
        )
    scale = var.diagonal(dim1=-2, dim2=-1).abs().amax(-1, keepdim=True).unsqueeze(-1)
    asym = (var - var.mT).abs()
    tol = 1e3 * torch.finfo(var.dtype).eps * scale.clamp_min(torch.finfo(var.dtype).tiny)
    if bool((asym > tol).any()):
        raise ValueError(f"cov must be symmetric (largest asymmetry {float(asym.max()):.3g})")
    diag = var.diagonal(dim1=-2, dim2=-1)
    if bool((diag < 0).any()):
        raise ValueError(
            f"cov is not positive semi-definite: negative variance {float(diag.min()):.3g} "
            "on its diagonal"
        )
    return mu, 0.5 * (var + var.mT), True
