"""Choose which weights of a model get a posterior: the Subset type and selection strategies."""

from partialbayes.selection._blocks import Block, KronBlock, KronModule, MaskBlock
from partialbayes.selection._modules import (
    Grouping,
    grouped_linear_modules,
    linear_modules,
    module_group,
)
from partialbayes.selection._subset import Subset, countable_parameters

__all__ = [
    "Block",
    "Grouping",
    "KronBlock",
    "KronModule",
    "MaskBlock",
    "Subset",
    "countable_parameters",
    "grouped_linear_modules",
    "linear_modules",
    "module_group",
]
