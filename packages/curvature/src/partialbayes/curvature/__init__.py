"""KFAC / Sparse-KFAC / GGN / EF curvature on a parameter subset, and Laplace posteriors."""

from importlib.metadata import version

from partialbayes.curvature._diag_dense import dense_curvature, diag_curvature
from partialbayes.curvature._jacobians import logit_jacobians
from partialbayes.curvature._kfac import ModuleFactors, kfac, kfac_many
from partialbayes.curvature._laplace import LaplaceBase
from partialbayes.curvature._laplace_dense import DenseLaplace
from partialbayes.curvature._laplace_diag import DiagLaplace
from partialbayes.curvature._laplace_kron import KronLaplace
from partialbayes.curvature._many import grid_val_nll_many, logit_mean_cov_many
from partialbayes.curvature._memory import MemoryEstimate, memory_estimate
from partialbayes.curvature._prior import MarglikFit
from partialbayes.curvature.internal import FISHERS as FISHERS  # importable; not in __all__

__version__ = version("partialbayes-curvature")
__all__ = [
    "DenseLaplace",
    "DiagLaplace",
    "KronLaplace",
    "LaplaceBase",
    "MarglikFit",
    "MemoryEstimate",
    "ModuleFactors",
    "__version__",
    "dense_curvature",
    "diag_curvature",
    "grid_val_nll_many",
    "kfac",
    "kfac_many",
    "logit_jacobians",
    "logit_mean_cov_many",
    "memory_estimate",
]
