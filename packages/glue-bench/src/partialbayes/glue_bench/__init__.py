"""The stochastic-subset GLUE and UCI experiments of Kampen et al. (UAI 2024), end to end.

Data (:func:`load_glue`, :func:`split_indices`, :func:`load_uci`), models (:func:`load_encoder`,
:class:`MLP`), MAP fine-tuning (:func:`finetune`), the method registry (:data:`METHODS`), the
resumable results store (:class:`ResultStore`), sampling-based linearised Laplace
(:func:`fit_linearised`), the grid runners (:func:`run_grid`, :func:`run_uci`), a whole ramp from one
curvature pass (:func:`run_shared`, :func:`compute_pass`, :class:`CurvatureStore`, :func:`capture_batch`,
:func:`replaying`) and reports (:func:`write_report`, with the tables :func:`budget_table`,
:func:`strategy_ranks`, :func:`calibration_curves`). The console script ``glue-bench`` wraps them.
"""

from importlib.metadata import version

from partialbayes.glue_bench.curvature_pass import CurvatureStore, TrainingLoss, compute_pass
from partialbayes.glue_bench.data_glue import (
    TASKS,
    Examples,
    TaskSpec,
    data_fingerprint,
    encode,
    load_glue,
    read_glue_tsv,
    split_indices,
    task_spec,
)
from partialbayes.glue_bench.data_uci import UCISplit, load_uci
from partialbayes.glue_bench.experiment import (
    CURVATURE_PASSES,
    RunConfig,
    prepare_context,
    run_cell,
    run_grid,
)
from partialbayes.glue_bench.laplace_cells import PriorSearch, TestPredictive
from partialbayes.glue_bench.linearised import (
    LinearSamplingConfig,
    dense_jacobians,
    fit_linearised,
    linearised_probs,
    stacked_features,
)
from partialbayes.glue_bench.methods import (
    METHODS,
    PRIOR_GRID,
    SKFAC_PERCENTS,
    Context,
    KronCell,
    Method,
    Prediction,
    Settings,
    fit_temperature,
    get_methods,
    probit_probs,
)
from partialbayes.glue_bench.metrics import (
    accuracy,
    all_metrics,
    brier,
    ece,
    nll,
    reliability_bins,
)
from partialbayes.glue_bench.models import MLP, load_encoder
from partialbayes.glue_bench.ramp import run_shared
from partialbayes.glue_bench.replay import Capture, capture_batch, replaying
from partialbayes.glue_bench.report import summarise, write_report
from partialbayes.glue_bench.store import (
    TIMING_FIELDS,
    Cell,
    ResultStore,
    iter_records,
    without_timings,
)
from partialbayes.glue_bench.tables import (
    budget_table,
    calibration_cells,
    calibration_curves,
    strategy_ranks,
)
from partialbayes.glue_bench.train import TrainConfig, finetune
from partialbayes.glue_bench.uci import run_uci, train_mlp

__version__ = version("partialbayes-glue-bench")
__all__ = [
    "CURVATURE_PASSES",
    "METHODS",
    "MLP",
    "PRIOR_GRID",
    "SKFAC_PERCENTS",
    "TASKS",
    "TIMING_FIELDS",
    "Capture",
    "Cell",
    "Context",
    "CurvatureStore",
    "Examples",
    "KronCell",
    "LinearSamplingConfig",
    "Method",
    "Prediction",
    "PriorSearch",
    "ResultStore",
    "RunConfig",
    "Settings",
    "TaskSpec",
    "TestPredictive",
    "TrainConfig",
    "TrainingLoss",
    "UCISplit",
    "__version__",
    "accuracy",
    "all_metrics",
    "brier",
    "budget_table",
    "calibration_cells",
    "calibration_curves",
    "capture_batch",
    "compute_pass",
    "data_fingerprint",
    "dense_jacobians",
    "ece",
    "encode",
    "finetune",
    "fit_linearised",
    "fit_temperature",
    "get_methods",
    "iter_records",
    "linearised_probs",
    "load_encoder",
    "load_glue",
    "load_uci",
    "nll",
    "prepare_context",
    "probit_probs",
    "read_glue_tsv",
    "reliability_bins",
    "replaying",
    "run_cell",
    "run_grid",
    "run_shared",
    "run_uci",
    "split_indices",
    "stacked_features",
    "strategy_ranks",
    "summarise",
    "task_spec",
    "train_mlp",
    "without_timings",
    "write_report",
]
