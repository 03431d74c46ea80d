"""Low-level helpers of ``sgmcmc``: no compatibility promise, not in the API reference."""

from partialbayes.sgmcmc._chains import classification_loss
from partialbayes.sgmcmc._sampler import METHODS

__all__ = ["METHODS", "classification_loss"]
