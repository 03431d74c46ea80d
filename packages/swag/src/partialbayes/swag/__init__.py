"""SWAG on a stochastic subset of the weights."""

from partialbayes.swag._moments import update_moments

__all__ = ["update_moments"]
