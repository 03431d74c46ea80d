"""Entropy-based uncertainty measures."""

from __future__ import annotations

import torch
from torch import Tensor


def entropy(log_probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy (nats) of categorical distributions given as log-probabilities.

    Args:
        log_probs: Log-probabilities, shape ``[..., C]`` along ``dim``.
        dim: The class dimension.

    Returns:
        Entropy with ``dim`` removed. Zero-probability classes contribute 0 (no ``0 * log 0`` NaN).
    """
    p = log_probs.exp()
    return -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim)
