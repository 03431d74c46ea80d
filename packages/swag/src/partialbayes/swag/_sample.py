"""Drawing SWAG samples on a flat vector of stochastic entries (pure function)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def swag_sample(
    mean: Tensor,
    variance: Tensor,
    deviations: Tensor | None,
    *,
    n_samples: int | None = None,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw SWAG samples ``w = w_swa + √scale (Σ_diag^½ z₁ / √2 + D z₂ / √(2(k−1)))``.

    With ``deviations=None`` (diagonal SWAG) the sample is ``w_swa + √scale Σ_diag^½ z₁``. The covariance
    of the samples is ``scale · (½ Σ_diag + D Dᵀ / (2(k−1)))`` (low rank plus diagonal) or
    ``scale · Σ_diag`` (diagonal only). ``scale`` multiplies the covariance, as in Maddox et al.'s code.

    Args:
        mean: SWA mean ``w_swa``, shape ``(d,)``.
        variance: Diagonal variance ``Σ_diag``, shape ``(d,)``, non-negative (clamp it first).
        deviations: Deviation matrix ``D``, shape ``(d, k)`` with ``k >= 2`` columns, or ``None``.
        n_samples: Number of samples; ``None`` returns a single sample of shape ``(d,)``.
        scale: Non-negative covariance scale.
        generator: Source of randomness; ``z₁`` is drawn before ``z₂``. Samples are drawn on the
            generator's device and moved to ``mean``'s device.

    Returns:
        Samples of shape ``(d,)`` or ``(n_samples, d)``, dtype and device of ``mean``.

    Raises:
        ValueError: On mismatching shapes, fewer than two deviation columns, a negative or non-finite
            ``scale``, ``n_samples < 1`` or negative variances.
    """
    if mean.ndim != 1 or variance.shape != mean.shape:
        raise ValueError(
            f"mean and variance must both have shape (d,), got {tuple(mean.shape)} and "
            f"{tuple(variance.shape)}"
        )
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    if n_samples is not None and n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if bool((variance < 0).any()):
        raise ValueError("variance has negative entries: clamp it at 0 (see diagonal_variance)")
    d = mean.shape[0]
    s = 1 if n_samples is None else n_samples
    device = generator.device if generator is not None else mean.device
    z1 = torch.randn(s, d, generator=generator, device=device, dtype=mean.dtype).to(mean.device)
    if deviations is None:
        noise = variance.sqrt() * z1
    else:
        if deviations.ndim != 2 or deviations.shape[0] != d:
            raise ValueError(f"deviations must have shape ({d}, k), got {tuple(deviations.shape)}")
        k = deviations.shape[1]
        if k < 2:
            raise ValueError(
                f"the low-rank part needs at least 2 deviation columns (snapshots), got {k}"
            )
        z2 = torch.randn(s, k, generator=generator, device=device, dtype=mean.dtype).to(mean.device)
        noise = variance.sqrt() * z1 / math.sqrt(2.0) + (z2 @ deviations.T) / math.sqrt(
            2.0 * (k - 1)
        )
    out = mean + math.sqrt(scale) * noise
    return out[0] if n_samples is None else out
