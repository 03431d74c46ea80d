"""The IVON optimizer (improved variational online Newton), sampled weights and Multi-IVON.

IVON (Shen et al., *Variational Learning is Effective for Large Deep Networks*, ICML 2024) learns a
mean-field Gaussian posterior over the weights at about the cost of AdamW. :class:`IVON` is the optimizer;
:func:`ivon_posterior` reads the learned Gaussian off it as a :class:`GaussianPosterior`, and
:class:`MultiIVON` mixes several runs. Both implement ``partialbayes.predictive.Posterior`` (``sample``,
``swapped`` / ``sampled``, ``predict``, ``predictive_samples``, ``save`` / ``load``); :func:`predict_mean`
predicts at the mean, and ``save`` / :func:`load_posterior` store either as safetensors with JSON
metadata. The paper's uses of the posterior: :func:`merge` (uncertainty-weighted merging of
fine-tunes, with :func:`squared_gradients` as the alternative precision) and :func:`sensitivity`
(per-example sensitivities and the leave-one-out estimate). :class:`IVONCallback` trains with IVON inside a
Hugging Face ``Trainer``.
"""

from importlib.metadata import version

from partialbayes.ivon._callback import IVONCallback
from partialbayes.ivon._merge import merge, squared_gradients
from partialbayes.ivon._sensitivity import Sensitivity, sensitivity
from partialbayes.ivon.optimizer import IVON
from partialbayes.ivon.posterior import (
    GaussianPosterior,
    MultiIVON,
    ivon_posterior,
    load_posterior,
    predict_mean,
)

__version__ = version("partialbayes-ivon")
__all__ = [
    "IVON",
    "GaussianPosterior",
    "IVONCallback",
    "MultiIVON",
    "Sensitivity",
    "__version__",
    "ivon_posterior",
    "load_posterior",
    "merge",
    "predict_mean",
    "sensitivity",
    "squared_gradients",
]
