"""SWAG (Maddox et al., 2019) on a stochastic subset of the weights; everything else stays at the MAP.

Main entry points: `collect_swag` (SGD from the MAP, snapshots, returns a `SWAG`), `sweep_learning_rate`
(the paper's learning-rate sweep by validation NLL), `SWAGCallback` (snapshots while a Hugging Face
``Trainer`` trains), and the `SWAG` posterior, which implements
``partialbayes.predictive.Posterior``: `SWAG.sample` (``{param name: [n, k]}``), `SWAG.swapped` /
`SWAG.sampled` (swap weights into the model, restored on exit), `SWAG.predict` (Monte Carlo average of the
softmax), `SWAG.predictive_samples`, `SWAG.save` / `SWAG.load`. Batches may be of any kind
``partialbayes.predictive.internal.split_batch`` reads (tensors, pairs, dicts,
``transformers.BatchEncoding``).
"""

from importlib.metadata import version

from partialbayes.swag._callback import SWAGCallback
from partialbayes.swag._posterior import SWAG
from partialbayes.swag._sweep import predictive_nll, sweep_learning_rate
from partialbayes.swag._train import NonFiniteLossError, collect_swag

__version__ = version("partialbayes-swag")
__all__ = [
    "SWAG",
    "NonFiniteLossError",
    "SWAGCallback",
    "__version__",
    "collect_swag",
    "predictive_nll",
    "sweep_learning_rate",
]
