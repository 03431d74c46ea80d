"""Low-level helpers of ``linear_sampling``: no compatibility promise, not in the API reference."""

from partialbayes.linear_sampling._cg import conjugate_gradients

__all__ = ["conjugate_gradients"]
