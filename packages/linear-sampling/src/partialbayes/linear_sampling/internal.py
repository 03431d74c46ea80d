"""What glue-bench shares from ``linear_sampling``, and its low-level helpers: no compatibility promise, not in the API reference."""

from partialbayes.linear_sampling._cg import conjugate_gradients
from partialbayes.linear_sampling._network import network_parameters

__all__ = ["conjugate_gradients", "network_parameters"]
