"""The stochastic-subset GLUE and UCI experiments of Kampen et al. (UAI 2024), end to end.

What a user calls: the grid runners (:func:`run_grid` of a :class:`Grid` with :class:`RunConfig`, :class:`TrainConfig`,
:class:`Settings` and :class:`LinearSamplingConfig`; :func:`run_uci`), the method registry (:data:`METHODS`;
a new method is a ``methods.Method`` whose ``run`` takes a ``context.Context`` and returns a
``methods.Prediction``), the results (:class:`ResultStore`) and the report (:func:`write_report`). The
console script ``glue-bench`` wraps them. Everything else (the tables, data and model loaders, MAP
fine-tuning) is importable from its module (``partialbayes.glue_bench.<module>``).
"""

from importlib.metadata import version

from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.linearised import LinearSamplingConfig
from partialbayes.glue_bench.methods import METHODS
from partialbayes.glue_bench.report import write_report
from partialbayes.glue_bench.store import ResultStore
from partialbayes.glue_bench.train import TrainConfig
from partialbayes.glue_bench.uci import run_uci

__version__ = version("partialbayes-glue-bench")
__all__ = [
    "METHODS",
    "Grid",
    "LinearSamplingConfig",
    "ResultStore",
    "RunConfig",
    "Settings",
    "TrainConfig",
    "__version__",
    "run_grid",
    "run_uci",
    "write_report",
]
