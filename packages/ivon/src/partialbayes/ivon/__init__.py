"""The IVON optimizer: improved variational online Newton."""

from partialbayes.ivon._math import hessian_update

__all__ = ["hessian_update"]
