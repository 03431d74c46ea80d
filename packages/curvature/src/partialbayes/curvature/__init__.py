"""KFAC / Sparse-KFAC / GGN / EF curvature on a parameter subset, and Laplace posteriors."""

from partialbayes.curvature._kfac_math import kfac_factors

__all__ = ["kfac_factors"]
from partialbayes.curvature._laplace_kron import KronLaplace

__all__ += ["KronLaplace"]
