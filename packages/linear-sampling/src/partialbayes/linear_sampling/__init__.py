"""Sample-then-optimise posteriors and EM prior updates for large linear models."""

from partialbayes.linear_sampling._cg import conjugate_gradients

__all__ = ["conjugate_gradients"]
