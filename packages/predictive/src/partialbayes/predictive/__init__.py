"""Predictive distributions, uncertainty decomposition and calibration metrics.

Takes what a posterior produces — Gaussian logits ``N(mean, cov)`` or logit samples — and turns it
into predictive distributions and scores. Defines the `Posterior` protocol every posterior family
implements, the one way to read a batch (`split_batch`) and call a model (`model_logits`), and
`PosteriorModel`, any posterior as an ``nn.Module`` for ``transformers.Trainer``. Depends on
torch only; never imports a posterior class.
"""

from partialbayes.predictive._answers import (
    answer_index,
    answer_logits,
    answer_positions,
    check_target_ids,
)
from partialbayes.predictive._auroc import auroc
from partialbayes.predictive._batch import (
    IGNORE_INDEX,
    Batch,
    batch_size,
    flatten_outputs,
    is_causal_lm,
    kept_positions,
    model_logits,
    move_batch,
    output_logits,
    split_batch,
)
from partialbayes.predictive._calibration import ReliabilityData, ece, mce, reliability
from partialbayes.predictive._decomposition import (
    Uncertainty,
    average_softmax,
    decompose_classification,
    decompose_regression,
    entropy,
    log_average_softmax,
)
from partialbayes.predictive._files import (
    PosteriorFile,
    model_structure,
    read_posterior_file,
    write_posterior_file,
)
from partialbayes.predictive._link import (
    gaussian_predictive,
    laplace_bridge,
    laplace_bridge_alpha,
    probit,
    probit_binary,
    probit_scale,
)
from partialbayes.predictive._mc import cholesky_jitter, mc_predictive, sample_logits
from partialbayes.predictive._metrics import accuracy, brier, gaussian_nll, nll
from partialbayes.predictive._model import PosteriorModel
from partialbayes.predictive._posterior import (
    LIKELIHOODS,
    Posterior,
    available_memory,
    check_likelihood,
    eval_mode,
    resolve_link,
    rows,
    sampled_logits,
    sampled_predict,
)
from partialbayes.predictive._stream import (
    MCPrediction,
    MCRegression,
    mc_predict,
    mc_predict_regression,
)
from partialbayes.predictive._temperature import apply_temperature, fit_temperature
from partialbayes.predictive._validate import check_count, check_generator

__all__ = [
    "IGNORE_INDEX",
    "LIKELIHOODS",
    "Batch",
    "MCPrediction",
    "MCRegression",
    "Posterior",
    "PosteriorFile",
    "PosteriorModel",
    "ReliabilityData",
    "Uncertainty",
    "accuracy",
    "answer_index",
    "answer_logits",
    "answer_positions",
    "apply_temperature",
    "auroc",
    "available_memory",
    "average_softmax",
    "batch_size",
    "brier",
    "check_count",
    "check_generator",
    "check_likelihood",
    "check_target_ids",
    "cholesky_jitter",
    "decompose_classification",
    "decompose_regression",
    "ece",
    "entropy",
    "eval_mode",
    "fit_temperature",
    "flatten_outputs",
    "gaussian_nll",
    "gaussian_predictive",
    "is_causal_lm",
    "kept_positions",
    "laplace_bridge",
    "laplace_bridge_alpha",
    "log_average_softmax",
    "mc_predict",
    "mc_predict_regression",
    "mc_predictive",
    "mce",
    "model_logits",
    "model_structure",
    "move_batch",
    "nll",
    "output_logits",
    "probit",
    "probit_binary",
    "probit_scale",
    "read_posterior_file",
    "reliability",
    "resolve_link",
    "rows",
    "sample_logits",
    "sampled_logits",
    "sampled_predict",
    "split_batch",
    "write_posterior_file",
]
