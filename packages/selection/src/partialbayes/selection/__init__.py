"""Choose which weights of a model get a posterior: the Subset type and selection strategies.

The shared type is :class:`Subset` (parameter name -> :class:`KronBlock` or :class:`MaskBlock`). Strategies
are plain functions returning a Subset: module level (:func:`max_operator_norm`, :func:`min_operator_norm`,
:func:`random_modules`, :func:`last_layer`, :func:`modules`, :func:`ramp`), Sparse-KFAC
(:func:`sparse_kfac`), Bayesian LoRA (:func:`lora_subset`, :func:`lora_modules` for the adapters of a PEFT
model) and parameter level (:func:`largest_magnitude`, :func:`random_parameters`,
:func:`largest_marginal_variance`).
"""

from importlib.metadata import version

from partialbayes.selection._blocks import KronBlock, MaskBlock
from partialbayes.selection._lora import lora_modules, lora_subset
from partialbayes.selection._module_strategies import (
    PAPER_COUNTS,
    last_layer,
    max_operator_norm,
    min_operator_norm,
    modules,
    ramp,
    random_modules,
)
from partialbayes.selection._modules import linear_modules, module_groups, tied_linear_modules
from partialbayes.selection._parameter_strategies import (
    largest_magnitude,
    largest_marginal_variance,
    random_parameters,
)
from partialbayes.selection._skfac import sparse_kfac
from partialbayes.selection._subset import Subset, countable_parameters
from partialbayes.selection._summary import summary

__version__ = version("partialbayes-selection")
__all__ = [
    "PAPER_COUNTS",
    "KronBlock",
    "MaskBlock",
    "Subset",
    "__version__",
    "countable_parameters",
    "largest_magnitude",
    "largest_marginal_variance",
    "last_layer",
    "linear_modules",
    "lora_modules",
    "lora_subset",
    "max_operator_norm",
    "min_operator_norm",
    "module_groups",
    "modules",
    "ramp",
    "random_modules",
    "random_parameters",
    "sparse_kfac",
    "summary",
    "tied_linear_modules",
]
