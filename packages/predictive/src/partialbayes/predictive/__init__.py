"""Predictive distributions, uncertainty decomposition and calibration metrics."""

from partialbayes.predictive._decomposition import entropy

__all__ = ["entropy"]
