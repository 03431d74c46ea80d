"""What the sibling packages share from ``selection``, and its low-level helpers: no compatibility promise, not in the API reference."""

from partialbayes.selection._blocks import Block, KronModule
from partialbayes.selection._module_strategies import rank_by_operator_norm
from partialbayes.selection._modules import MLP, grouped_linear_modules, module_group
from partialbayes.selection._skfac import (
    skfac_count,
    skfac_fraction,
    skfac_percent_for_fraction,
    skfac_percent_for_target,
    skfac_percent_of_params,
)
from partialbayes.selection._subset import check_subset, countable_named_parameters

__all__ = [
    "MLP",
    "Block",
    "KronModule",
    "check_subset",
    "countable_named_parameters",
    "grouped_linear_modules",
    "module_group",
    "rank_by_operator_norm",
    "skfac_count",
    "skfac_fraction",
    "skfac_percent_for_fraction",
    "skfac_percent_for_target",
    "skfac_percent_of_params",
]
