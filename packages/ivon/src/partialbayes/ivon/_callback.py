"""IVON as the optimizer of a Hugging Face ``Trainer``: one weight sample per optimizer step."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from partialbayes.ivon.optimizer import IVON
from partialbayes.predictive.internal import TrainerEvents


class _Discard(Exception):
    """Leaves an open sample without collecting it (training stopped inside an optimizer step)."""


class IVONCallback(TrainerEvents):
    """Train with IVON in a ``transformers.Trainer``: ``callbacks=[IVONCallback()]``.

    ``Trainer(..., optimizers=(IVON(model.parameters(), lr=..., ess=...), None), callbacks=[IVONCallback()])``
    draws one weight sample per optimizer step: it enters the model before the step's first micro-batch and
    leaves, its gradient collected, just before ``optimizer.step()`` (after gradient clipping and fp16
    unscaling). Between steps the model holds the means, so ``evaluate``, ``predict`` and checkpoints see
    the means. After training, ``ivon_posterior(optimizer, trainer.model)`` gives the posterior. A
    ``TrainerCallback`` by duck typing. Multi-process Trainer runs are refused (DDP would average the ranks'
    gradients before IVON pairs each rank's noise with its own gradient; see the concept page).

    Raises:
        TypeError: At the start of training, if the Trainer's optimizer is not an IVON optimizer (the message
            says how to pass one).
        ValueError: At the start of training, for a Trainer run on several processes.
    """

    def __init__(self) -> None:
        self._ivon: IVON | None = None
        self._sample: AbstractContextManager[None] | None = None  # the open sampled_params context

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Find the IVON optimizer inside the Trainer's (possibly wrapped) optimizer."""
        optimizer = inner = kwargs.get("optimizer")
        while optimizer is not None and not isinstance(optimizer, IVON):  # AcceleratedOptimizer
            inner, optimizer = optimizer, getattr(optimizer, "optimizer", None)
        if optimizer is None:
            raise TypeError(  # the innermost optimizer: AdamW, not accelerate's wrapper
                f"IVONCallback needs IVON as the Trainer's optimizer, got {type(inner).__name__}: "
                "pass Trainer(..., optimizers=(partialbayes.ivon.IVON(model.parameters(), lr=..., ess=...), None))"
            )
        if getattr(args, "world_size", 1) > 1:
            raise ValueError(
                f"IVONCallback: a Trainer run on {args.world_size} processes is not supported (DDP averages the "
                "ranks' gradients before IVON pairs each rank's noise with its gradient); train in one process, "
                "or use IVON in a plain torch.distributed loop"
            )
        self._ivon = optimizer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Put a weight sample into the model for the coming forward and backward passes."""
        if self._ivon is None:
            self.on_train_begin(args, state, control, **kwargs)
        assert self._ivon is not None
        self._leave(collect=False)
        self._sample = self._ivon.sampled_params(train=True)
        self._sample.__enter__()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Take the sample out of the model and collect its (clipped, unscaled) gradient for the step."""
        self._leave(collect=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Leave a sample that is still open (training stopped inside a step) without collecting it."""
        self._leave(collect=False)
        self._ivon = None

    def _leave(self, *, collect: bool) -> None:
        sample, self._sample = self._sample, None
        if sample is not None and collect:
            sample.__exit__(None, None, None)
        elif sample is not None:
            sample.__exit__(_Discard, _Discard(), None)
