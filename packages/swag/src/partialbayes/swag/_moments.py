"""Running moments and the deviation matrix of SWAG snapshots (pure functions on flat vectors)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def update_moments_(mean: Tensor, sq_mean: Tensor, w: Tensor, n: int) -> None:
    """Fold finite snapshot number ``n + 1`` into the running moments, in place (Maddox et al., Eq. 1).

    ``mean ← n/(n+1)·mean + w/(n+1)``, likewise the mean of squares. A snapshot whose squares overflow the
    moments' dtype (float32: ``|w|`` above about ``1.8e19``) is refused and the moments stay untouched.
    """
    peak = float(w.detach().abs().max())
    limit = math.sqrt(torch.finfo(sq_mean.dtype).max)
    if peak > limit:
        raise ValueError(
            f"the snapshot has entries up to |w| = {peak:.3g}, whose squares overflow "
            f"{str(sq_mean.dtype).removeprefix('torch.')} (|w| <= {limit:.3g}): the second moment would "
            "become inf and the variance NaN; lower the learning rate, or keep the moments in "
            "float64 (dtype=torch.float64)"
        )
    mean.mul_(n / (n + 1)).add_(w, alpha=1 / (n + 1))
    sq_mean.mul_(n / (n + 1)).addcmul_(w, w, value=1 / (n + 1))


def diagonal_variance(mean: Tensor, sq_mean: Tensor) -> Tensor:
    """Diagonal variance ``Σ_diag = max(sq_mean − mean², 0)`` (the clamp undoes cancellation), ``(d,)``."""
    return (sq_mean - mean * mean).clamp_min(0.0)


def ring_append(buffer: Tensor, count: int, column: Tensor) -> int:
    """Write ``column`` ``(d,)`` into row ``count mod K`` of the ring ``buffer`` ``(K, d)``; return ``count + 1``."""
    buffer[count % buffer.shape[0]].copy_(column)
    return count + 1


def ring_ordered(buffer: Tensor, count: int) -> Tensor:
    """Return the stored deviation columns oldest to newest as a ``(d, k)`` matrix, ``k = min(count, K)``."""
    k_max = buffer.shape[0]
    if count <= k_max:
        return buffer[:count].T
    start = count % k_max
    return torch.cat([buffer[start:], buffer[:start]]).T
