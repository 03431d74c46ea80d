"""Predictive distributions, uncertainty decomposition and calibration metrics.

Takes what a posterior produces — Gaussian logits ``N(mean, cov)`` or logit samples — and turns it
into predictive distributions and scores. Defines the `Posterior` protocol every posterior family
implements, and `PosteriorModel`, any posterior as an ``nn.Module`` for ``transformers.Trainer``.
What the sibling packages share (the batch reader, the model call, posterior files, argument checks)
lives in `partialbayes.predictive.internal`. Depends on torch only; never imports a posterior class.
"""

from importlib.metadata import version

from partialbayes.predictive._answers import answer_logits, answer_positions
from partialbayes.predictive._auroc import auroc
from partialbayes.predictive._batch import is_causal_lm, kept_positions
from partialbayes.predictive._calibration import ReliabilityData, ece, mce, reliability
from partialbayes.predictive._decomposition import (
    Uncertainty,
    average_softmax,
    decompose_classification,
    decompose_regression,
    entropy,
    log_average_softmax,
)
from partialbayes.predictive._link import (
    gaussian_predictive,
    laplace_bridge,
    laplace_bridge_alpha,
    probit,
    probit_binary,
)
from partialbayes.predictive._mc import mc_predictive, sample_logits
from partialbayes.predictive._metrics import accuracy, brier, gaussian_nll, nll
from partialbayes.predictive._model import PosteriorModel
from partialbayes.predictive._posterior import Posterior, sampled_logits, sampled_predict
from partialbayes.predictive._stream import (
    MCPrediction,
    MCRegression,
    mc_predict,
    mc_predict_regression,
)
from partialbayes.predictive._temperature import apply_temperature, fit_temperature

__version__ = version("partialbayes-predictive")
__all__ = [
    "MCPrediction",
    "MCRegression",
    "Posterior",
    "PosteriorModel",
    "ReliabilityData",
    "Uncertainty",
    "__version__",
    "accuracy",
    "answer_logits",
    "answer_positions",
    "apply_temperature",
    "auroc",
    "average_softmax",
    "brier",
    "decompose_classification",
    "decompose_regression",
    "ece",
    "entropy",
    "fit_temperature",
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
    "nll",
    "probit",
    "probit_binary",
    "reliability",
    "sample_logits",
    "sampled_logits",
    "sampled_predict",
]
