"""What the sibling packages share from ``selection``: no compatibility promise, not in the API reference."""

from partialbayes.selection._blocks import Block, KronModule
from partialbayes.selection._modules import grouped_linear_modules
from partialbayes.selection._subset import countable_named_parameters

__all__ = ["Block", "KronModule", "countable_named_parameters", "grouped_linear_modules"]
