"""Running moments and the deviation matrix of SWAG snapshots (pure functions on flat vectors)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_squares(w: Tensor, dtype: torch.dtype) -> None:
    """Raise before a snapshot whose squares would overflow the moments' ``dtype`` is folded in.

    The running mean of squares of such a snapshot is ``inf``, and every variance and sample after it
    ``inf`` or NaN (float32 overflows for entries above about ``1.8e19``, e.g. after a huge learning rate).

    Args:
        w: The snapshot, any shape.
        dtype: Floating dtype of the running moments.

    Raises:
        ValueError: If ``w`` has NaN/inf entries or an entry whose square overflows ``dtype``.
    """
    if w.numel() == 0:
        return
    peak = float(w.detach().abs().max())
    if not math.isfinite(peak):
        raise ValueError("the snapshot has non-finite entries")
    limit = math.sqrt(torch.finfo(dtype).max)
    if peak > limit:
        raise ValueError(
            f"the snapshot has entries up to |w| = {peak:.3g}, whose squares overflow "
            f"{str(dtype).removeprefix('torch.')} (|w| <= {limit:.3g}): the second moment would "
            "become inf and the variance NaN; lower the learning rate, or keep the moments in "
            "float64 (dtype=torch.float64)"
        )


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

    Raises:
        ValueError: If ``n < 0``, or ``w`` is not finite or its squares overflow the dtype of
            ``sq_mean`` (see ``check_squares``).
    """
    mean, sq_mean = mean.clone(), sq_mean.clone()
    update_moments_(mean, sq_mean, w, n)
    return mean, sq_mean


def update_moments_(mean: Tensor, sq_mean: Tensor, w: Tensor, n: int) -> None:
    """In-place `update_moments`: the one statement of the update, without temporaries of size ``d``.

    `SWAG.collect` (so `collect_swag` and `SWAGCallback`) folds snapshots in with it; the moments are left
    untouched when it raises.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_squares(w, sq_mean.dtype)
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
