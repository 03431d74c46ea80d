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
    """Draw SWAG samples ``w = w_swa + √scale (Σ_diag^½ z₁ / √2 + D z₂ / √(2(k−1)))`` (``z₁`` drawn first).

    ``mean`` and ``variance`` (clamped) are ``(d,)``, ``deviations`` ``(d, k ≥ 2)`` or ``None`` (SWAG-Diag:
    ``w_swa + √scale Σ_diag^½ z₁``). ``scale`` multiplies the covariance, as in Maddox et al.'s code. Noise
    is drawn on the generator's device. Returns ``(d,)`` for ``n_samples=None``, else ``(n_samples, d)``.
    """
    d = mean.shape[0]
    s = 1 if n_samples is None else n_samples
    device = generator.device if generator is not None else mean.device
    z1 = torch.randn(s, d, generator=generator, device=device, dtype=mean.dtype).to(mean.device)
    if deviations is None:
        noise = variance.sqrt() * z1
    else:
        k = deviations.shape[1]
        z2 = torch.randn(s, k, generator=generator, device=device, dtype=mean.dtype).to(mean.device)
        noise = variance.sqrt() * z1 / math.sqrt(2.0) + (z2 @ deviations.T) / math.sqrt(
            2.0 * (k - 1)
        )
    out = mean + math.sqrt(scale) * noise
    return out[0] if n_samples is None else out
