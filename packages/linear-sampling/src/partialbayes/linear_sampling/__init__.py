"""Sample-then-optimise posteriors and EM prior updates for large linear models, and linearised Laplace.

Implements Antorán et al. (ICLR 2023), *Sampling-based inference for large linear models, with
application to linearised Laplace*. The model is ``y_n = Φ_n θ + η_n`` with ``θ ~ N(0, A⁻¹)`` and
``η_n ~ N(0, B_n⁻¹)``; the features ``Φ`` are minibatched operators (JVP / VJP), so nothing of size
``d × d`` is ever formed.

For a network, `SampledLaplace` is the sampling-based linearised Laplace posterior over a
``partialbayes.selection.Subset`` of its weights, a ``partialbayes.predictive.Posterior`` (``sample``,
``swapped``, ``predict``, ``save`` / ``load``) built from any training loader.
"""

from importlib.metadata import version

from partialbayes.linear_sampling._em import effective_dimension, fit_prior_precision, mackay_update
from partialbayes.linear_sampling._features import Features
from partialbayes.linear_sampling._linearised import (
    linearised_logit_moments,
    linearised_logit_samples,
    linearised_targets,
)
from partialbayes.linear_sampling._network import loader_features, network_features, network_logits
from partialbayes.linear_sampling._posterior import SampledLaplace
from partialbayes.linear_sampling._precision import NoisePrecision, Prior, softmax_hessian
from partialbayes.linear_sampling._sgd import DivergenceError, SGDConfig
from partialbayes.linear_sampling._solve import posterior_mean, posterior_samples
from partialbayes.linear_sampling.internal import (  # importable; not in __all__
    network_parameters as network_parameters,
)

__version__ = version("partialbayes-linear-sampling")
__all__ = [
    "DivergenceError",
    "Features",
    "NoisePrecision",
    "Prior",
    "SGDConfig",
    "SampledLaplace",
    "__version__",
    "effective_dimension",
    "fit_prior_precision",
    "linearised_logit_moments",
    "linearised_logit_samples",
    "linearised_targets",
    "loader_features",
    "mackay_update",
    "network_features",
    "network_logits",
    "posterior_mean",
    "posterior_samples",
    "softmax_hessian",
]
