"""Tempered stochastic-gradient MCMC on a stochastic subset of the weights; everything else stays fixed.

The ``posteriors`` framing (Duffield et al., 2024): every sampler has a temperature ``T`` and is the matching
optimizer at ``T = 0``. `SGMCMC` (a ``torch.optim.Optimizer``: methods ``"sgld"``, ``"sghmc"``,
``"sgnht"``, ``"baoa"``) moves and samples only a ``Subset``'s entries, minibatch-first (mean loss, data size
``N``), with burn-in and thinning; `run_chain` runs one chain, `parallel_chains` several independent ones
keeping the last state of each (the Bayesian deep ensemble), `SGMCMCCallback` samples inside a Hugging Face
``Trainer``. The result, `SampledPosterior`, implements ``partialbayes.predictive.Posterior``.
"""

from importlib.metadata import version

from partialbayes.sgmcmc._callback import SGMCMCCallback
from partialbayes.sgmcmc._chains import parallel_chains, run_chain
from partialbayes.sgmcmc._posterior import SampledPosterior
from partialbayes.sgmcmc._sampler import SGMCMC

__version__ = version("partialbayes-sgmcmc")
__all__ = [
    "SGMCMC",
    "SGMCMCCallback",
    "SampledPosterior",
    "__version__",
    "parallel_chains",
    "run_chain",
]
