"""The stochastic-subset GLUE and UCI experiments of Kampen et al. (UAI 2024), end to end."""

from importlib.metadata import version

__version__ = version("partialbayes-glue-bench")
__all__ = ["__version__"]
