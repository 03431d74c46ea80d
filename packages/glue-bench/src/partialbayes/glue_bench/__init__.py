"""The stochastic-subset GLUE and UCI experiments of Kampen et al. (UAI 2024), end to end.

What a user calls: the grid runners (:func:`run_grid` with :class:`RunConfig`, :class:`TrainConfig`,
:class:`Settings` and :class:`LinearSamplingConfig`; :func:`run_uci`), the method registry
(:data:`METHODS`; a new method is a :class:`Method` whose ``run`` takes a :class:`Context` and returns a
:class:`Prediction`), the results (:class:`ResultStore`, :func:`iter_records`) and the reports
(:func:`write_report`, :func:`summarise`, the tables :func:`budget_table`, :func:`strategy_ranks`,
:func:`calibration_curves`), plus the data and model loaders (:func:`load_glue`, :func:`load_uci`,
:func:`load_encoder`) and MAP fine-tuning (:func:`finetune`). The console script ``glue-bench`` wraps them.
Everything else is importable from its module (``partialbayes.glue_bench.<module>``).
"""

from importlib.metadata import version

from partialbayes.glue_bench.context import Context, Prediction, Settings
from partialbayes.glue_bench.data_glue import load_glue
from partialbayes.glue_bench.data_uci import load_uci
from partialbayes.glue_bench.experiment import RunConfig, run_grid
from partialbayes.glue_bench.linearised import LinearSamplingConfig
from partialbayes.glue_bench.methods import METHODS, Method
from partialbayes.glue_bench.models import load_encoder
from partialbayes.glue_bench.report import summarise, write_report
from partialbayes.glue_bench.store import ResultStore, iter_records
from partialbayes.glue_bench.tables import budget_table, calibration_curves, strategy_ranks
from partialbayes.glue_bench.train import TrainConfig, finetune
from partialbayes.glue_bench.uci import run_uci

__version__ = version("partialbayes-glue-bench")
__all__ = [
    "METHODS",
    "Context",
    "LinearSamplingConfig",
    "Method",
    "Prediction",
    "ResultStore",
    "RunConfig",
    "Settings",
    "TrainConfig",
    "__version__",
    "budget_table",
    "calibration_curves",
    "finetune",
    "iter_records",
    "load_encoder",
    "load_glue",
    "load_uci",
    "run_grid",
    "run_uci",
    "strategy_ranks",
    "summarise",
    "write_report",
]
