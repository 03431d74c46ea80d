"""Element-wise update rules of IVON (Shen et al., 2024, Alg. 1)."""

from __future__ import annotations

from torch import Tensor


def hessian_update(h: Tensor, h_hat: Tensor, beta2: float, delta: float) -> Tensor:
    """IVON's Hessian update, which keeps ``h`` positive: ``β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ)``.

    Args:
        h: Current Hessian estimate (positive), any shape.
        h_hat: New reparameterisation estimate, same shape.
        beta2: Hessian momentum in ``[0, 1)``.
        delta: Weight decay δ (the prior precision per unit ess).

    Returns:
        The new Hessian estimate.
    """
    return beta2 * h + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h - h_hat) ** 2 / (h + delta)
