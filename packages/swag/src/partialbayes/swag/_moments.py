"""Running first and second moments of SWAG snapshots."""

from __future__ import annotations

from torch import Tensor


def update_moments(mean: Tensor, sq_mean: Tensor, w: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Fold snapshot number ``n + 1`` into running moments (Maddox et al., Eq. 1).

    Args:
        mean: Running mean of the ``n`` snapshots so far, any shape.
        sq_mean: Running mean of the squares, same shape.
        w: The new snapshot, same shape.
        n: Number of snapshots already folded in (``>= 0``).

    Returns:
        The updated ``(mean, sq_mean)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a = n / (n + 1)
    return a * mean + w / (n + 1), a * sq_mean + w * w / (n + 1)
