"""What the sibling packages share from ``curvature``: no compatibility promise, not in the API reference."""

from partialbayes.curvature._kfac import block_key
from partialbayes.curvature._likelihood import FISHERS

__all__ = ["FISHERS", "block_key"]
