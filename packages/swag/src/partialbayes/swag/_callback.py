"""SWAG collected while a Hugging Face ``Trainer`` trains: `SWAGCallback`."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from partialbayes.predictive.internal import TrainerEvents, check_int, check_type, prefixed
from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset
from partialbayes.swag._posterior import SWAG


class SWAGCallback(TrainerEvents):
    """A ``transformers.TrainerCallback`` (by duck typing) that collects the SWAG moments of a subset in training.

    ``Trainer(..., callbacks=[cb])``: after every ``every``-th optimizer step past ``start_step`` (gradient
    accumulation counts as one step) the subset's entries are folded into a `SWAG` with `SWAG.collect`, as in
    `collect_swag`. After ``trainer.train()``, `posterior` is the `SWAG` of ``trainer.model`` (weights outside
    the subset are its final ones). Each ``train()`` call starts a new collection. SWAG assumes a constant
    learning rate around an optimum: start from a fine-tuned model (or set ``start_step`` past the
    fine-tuning) with ``TrainingArguments(lr_scheduler_type="constant")``.

    Args:
        subset: The ``partialbayes.selection.Subset`` of the trained model to collect.
        start_step: Optimizer steps to train before collecting (``>= 0``).
        every: Optimizer steps between snapshots (``>= 1``; the paper: 5).
        **swag_options: Keywords of `SWAG` (``max_rank``, ``diagonal_only``, ``dtype``, ``likelihood``,
            ``sigma_noise``), checked when training begins.

    Raises:
        TypeError: If ``subset`` is not a ``Subset`` or a step count is not an int.
        ValueError: If ``start_step < 0`` or ``every < 1``.

    Example:
        >>> cb = SWAGCallback(subset, start_step=100, every=5)  # doctest: +SKIP
        >>> Trainer(model, args, train_dataset=train, callbacks=[cb]).train()  # doctest: +SKIP
        >>> probs = cb.posterior.predict(batch)  # doctest: +SKIP
    """

    def __init__(
        self, subset: Subset, *, start_step: int = 0, every: int = 5, **swag_options: Any
    ) -> None:
        check_subset(subset)
        self.subset = subset
        self.start_step = check_int("start_step", start_step, "[0, inf)")
        self.every = check_int("every", every)
        self.swag_options = swag_options
        self._swag: SWAG | None = None

    @property
    def _needed(self) -> int:
        return 1 if self.swag_options.get("diagonal_only", False) else 2

    @property
    def n_snapshots(self) -> int:
        """Snapshots collected so far (0 before training)."""
        return 0 if self._swag is None else self._swag.n_snapshots

    @property
    def posterior(self) -> SWAG:
        """The collected `SWAG` posterior of the trained model.

        Raises:
            ValueError: Before training, or with fewer snapshots than sampling needs (2, or 1 for
                ``diagonal_only=True``).
        """
        if self.n_snapshots < self._needed:  # also before any training run (0 snapshots)
            raise ValueError(
                "SWAGCallback has not seen a training run: pass it to Trainer(callbacks=[...]) and call "
                "trainer.train() first"
                if self._swag is None
                else f"SWAGCallback collected {self.n_snapshots} snapshot(s) (start_step="
                f"{self.start_step}, every={self.every}); the SWAG posterior needs at least "
                f"{self._needed}: lower start_step or every, or train for more steps"
            )
        assert self._swag is not None
        return self._swag

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start a new collection on the ``model`` Trainer passes (checks the `SWAG` options)."""
        model = check_type("the Trainer's model", kwargs.get("model"), nn.Module, "an nn.Module")
        self._swag = SWAG(model, self.subset, **self.swag_options)

    @torch.no_grad()
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After optimizer step ``state.global_step``: take a snapshot when one is due."""
        done = state.global_step - self.start_step
        if self._swag is None or done <= 0 or done % self.every:
            return
        with prefixed(f"SWAGCallback: snapshot after optimizer step {state.global_step}"):
            self._swag.collect()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Warn about too few snapshots, or a negligible spread (`SWAG.warn_if_negligible`)."""
        if self._swag is not None:
            self._swag.warn_if_negligible("SWAGCallback")
        if self.n_snapshots < self._needed:
            warnings.warn(
                f"SWAGCallback collected {self.n_snapshots} snapshot(s) in {state.global_step} optimizer "
                f"steps (start_step={self.start_step}, every={self.every}, max_steps={state.max_steps}); "
                f"the SWAG posterior needs at least {self._needed}: lower start_step or every, or "
                "train for more steps",
                RuntimeWarning,
                stacklevel=2,
            )
