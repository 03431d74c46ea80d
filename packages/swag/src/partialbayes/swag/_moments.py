"""Running moments and the deviation matrix of SWAG snapshots (pure functions on flat vectors)."""

from __future__ import annotations

import torch
from torch import Tensor


def update_moments(mean: Tensor, sq_mean: Tensor, w: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Fold snapshot number ``n + 1`` into running moments (Maddox et al., Eq. 1).

    ``mean_{n+1} = n/(n+1) mean_n + w/(n+1)`` and likewise for the mean of squares.

    Args:
        mean: Running mean of the ``n`` snapshots so far, shape ``(d,)`` (any shape works).
        sq_mean: Running mean of the squares, same shape.
        w: The new snapshot, same shape.
        n: Number of snapshots already folded in (``>= 0``).

    Returns:
        The updated ``(mean, sq_mean)``, new tensors.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a = n / (n + 1)
    return a * mean + w / (n + 1), a * sq_mean + w * w / (n + 1)


def update_moments_(mean: Tensor, sq_mean: Tensor, w: Tensor, n: int) -> None:
    """In-place `update_moments`: no temporaries of size ``d`` (used by `SWAG.collect`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    mean.mul_(n / (n + 1)).add_(w, alpha=1 / (n + 1))
    sq_mean.mul_(n / (n + 1)).addcmul_(w, w, value=1 / (n + 1))


def diagonal_variance(mean: Tensor, sq_mean: Tensor) -> Tensor:
    """Diagonal variance ``Σ_diag = max(sq_mean − mean², 0)``, shape ``(d,)``.

    The clamp removes the small negative values that cancellation produces in floating point.
    """
    return (sq_mean - mean * mean).clamp_min(0.0)


def ring_append(buffer: Tensor, count: int, column: Tensor) -> int:
    """Write ``column`` into a ring buffer of the last ``K`` deviation columns, in place.

    Args:
        buffer: Shape ``(K, d)``; row ``j`` holds one deviation column.
        count: Columns appended so far (before this one).
        column: Shape ``(d,)``.

    Returns:
        The new count, ``count + 1``.
    """
    buffer[count % buffer.shape[0]].copy_(column)
    return count + 1


def ring_ordered(buffer: Tensor, count: int) -> Tensor:
    """Return the stored deviation columns oldest to newest as a ``(d, k)`` matrix, ``k = min(count, K)``."""
    k_max = buffer.shape[0]
    if count <= k_max:
        return buffer[:count].T
    start = count % k_max
    return torch.cat([buffer[start:], buffer[:start]]).T
