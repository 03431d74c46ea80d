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

import importlib
import warnings
from importlib.metadata import version
from typing import Any

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

# Names exported by 0.2 that now live only in their modules: still importable from the package for one
# minor version, with a DeprecationWarning naming the module.
_MOVED = {
    "context": ("KronCell", "PRIOR_GRID", "SKFAC_PERCENTS"),
    "curvature_pass": ("CurvatureStore", "TrainingLoss", "compute_pass"),
    "data_glue": (
        "TASKS",
        "Examples",
        "TaskSpec",
        "data_fingerprint",
        "encode",
        "read_glue_tsv",
        "split_indices",
        "task_spec",
    ),
    "data_uci": ("UCISplit",),
    "experiment": ("CURVATURE_PASSES", "prepare_context", "run_cell"),
    "laplace_cells": ("PriorSearch", "TestPredictive"),
    "linearised": ("dense_jacobians", "fit_linearised", "linearised_probs", "stacked_features"),
    "methods": ("get_methods",),
    "metrics": ("accuracy", "all_metrics", "brier", "ece", "nll", "reliability_bins"),
    "models": ("MLP",),
    "ramp": ("run_shared",),
    "replay": ("Capture", "capture_batch", "replaying"),
    "store": ("TIMING_FIELDS", "Cell", "without_timings"),
    "tables": ("calibration_cells",),
    "uci": ("train_mlp",),
}
_MODULE_OF = {name: module for module, names in _MOVED.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'partialbayes.glue_bench' has no attribute {name!r}")
    warnings.warn(
        f"partialbayes.glue_bench.{name} is deprecated: import it from "
        f"partialbayes.glue_bench.{module} (it will leave the package namespace in the next minor "
        "version)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f"partialbayes.glue_bench.{module}"), name)
