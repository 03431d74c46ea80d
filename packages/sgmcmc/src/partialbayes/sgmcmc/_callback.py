"""SGMCMC as the optimizer of a Hugging Face ``Trainer``: `SGMCMCCallback`."""

from __future__ import annotations

import warnings
from typing import Any

from partialbayes.predictive.internal import TrainerEvents
from partialbayes.sgmcmc._posterior import SampledPosterior
from partialbayes.sgmcmc._sampler import SGMCMC


class SGMCMCCallback(TrainerEvents):
    """Sample with `SGMCMC` inside a ``transformers.Trainer``; `posterior` holds the kept samples.

    ``Trainer(..., optimizers=(SGMCMC(model, subset, lr=..., num_data=len(train), burn_in=..., thin=...),
    None), callbacks=[SGMCMCCallback()])``: the sampler is the Trainer's optimizer (the Trainer's loss is the
    batch mean, as `SGMCMC` expects) and keeps a sample after every ``thin``-th step past ``burn_in``. Use
    ``lr_scheduler_type="constant"`` for a stationary chain; freeze the weights outside the subset to save
    their backward pass. A ``TrainerCallback`` by duck typing.

    Args:
        **posterior_options: Keywords of `SampledPosterior` (``likelihood``, ``sigma_noise``).

    Raises:
        TypeError: At the start of training, if the Trainer's optimizer is not an `SGMCMC`.
    """

    def __init__(self, **posterior_options: Any) -> None:
        self.posterior_options = posterior_options
        self.sampler: SGMCMC | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Find the `SGMCMC` sampler inside the Trainer's (possibly wrapped) optimizer."""
        optimizer = kwargs.get("optimizer")
        while optimizer is not None and not isinstance(optimizer, SGMCMC):
            optimizer = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer
        if optimizer is None:
            raise TypeError(
                f"SGMCMCCallback needs an SGMCMC sampler as the Trainer's optimizer, got "
                f"{type(kwargs.get('optimizer')).__name__}: pass Trainer(..., optimizers=(partialbayes."
                "sgmcmc.SGMCMC(model, subset, lr=..., num_data=...), None))"
            )
        self.sampler = optimizer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Warn when no sample was kept (``burn_in`` past the last step)."""
        if self.sampler is not None and not self.sampler.samples:
            warnings.warn(
                f"SGMCMCCallback: no sample kept in {self.sampler.steps} steps (burn_in="
                f"{self.sampler.burn_in}); lower burn_in or train longer",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def posterior(self) -> SampledPosterior:
        """The kept samples as a `SampledPosterior` of the trained model.

        Raises:
            ValueError: Before training, or when no sample was kept.
        """
        if self.sampler is None:
            raise ValueError(
                "SGMCMCCallback has not seen a training run: pass it to Trainer(callbacks=[...]) and "
                "call trainer.train() first"
            )
        return self.sampler.posterior(**self.posterior_options)
