"""Choose which weights of a model get a posterior."""

from partialbayes.selection._modules import linear_modules

__all__ = ["linear_modules"]
