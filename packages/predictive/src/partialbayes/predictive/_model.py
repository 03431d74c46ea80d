"""Any posterior as an ``nn.Module`` that returns log predictive probabilities (for ``transformers.Trainer``)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive._batch import IGNORE_INDEX
from partialbayes.predictive._metrics import gaussian_nll, nll


class PosteriorModel(nn.Module):
    """A posterior's predictive as a model, for ``transformers.Trainer``, ``compute_metrics`` and pipelines.

    ``forward(**inputs, labels=None)`` calls ``posterior.predict`` once and returns ``{"loss", "logits"}`` for
    classification (the log predictive probabilities, floored at the dtype's smallest normal number, and
    their mean NLL over the outputs not labelled -100) or ``{"loss", "mean", "variance"}`` with the Gaussian
    NLL for regression; ``loss`` only with labels. The posterior's model is not a submodule (build the
    posterior on Trainer's device); ``forward``'s signature names its inputs, so Trainer keeps those columns.

    Args:
        posterior: Any ``Posterior`` (an object with ``predict(batch, **predict_kwargs)``).
        shift_labels: Causal-LM labels (score the output at ``t`` against ``labels[t + 1]``); ``None``
            decides by the model's class name (``...ForCausalLM``, ``...LMHeadModel``).
        **predict_kwargs: Passed to every ``posterior.predict`` call (``n_samples``, ``link``,
            ``generator``: a generator is consumed batch after batch, so a run is reproducible).

    Raises:
        TypeError: If ``posterior`` has no ``predict``, or ``predict`` does not take a keyword given.
    """

    accepts_loss_kwargs = False  # Trainer: do not pass num_items_in_batch

    def __init__(
        self, posterior: Any, *, shift_labels: bool | None = None, **predict_kwargs: Any
    ) -> None:
        super().__init__()
        predict = getattr(posterior, "predict", None)
        if not callable(predict):
            raise TypeError(f"posterior must have a predict method, got {type(posterior).__name__}")
        try:
            inspect.signature(predict).bind(None, **predict_kwargs)
        except TypeError as err:
            raise TypeError(
                f"{type(posterior).__name__}.predict does not take {predict_kwargs}: {err}"
            ) from err
        model: Any = getattr(posterior, "model", None)
        if shift_labels is None:
            shift_labels = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        self.posterior = posterior
        self.shift_labels = shift_labels
        self.predict_kwargs = predict_kwargs
        if hasattr(model, "config"):  # what pipelines read (labels, task)
            self.config = model.config
        self.__dict__["forward"] = _named_inputs(self, model)

    @property
    def device(self) -> torch.device:
        """The device of the posterior's model (pipelines read it)."""
        return next(self.posterior.model.parameters()).device

    def forward(self, labels: Tensor | None = None, **inputs: Any) -> dict[str, Tensor]:
        """Predictive of one batch of keyword inputs (see the class); ``labels`` (or ``label``) only score it.

        Raises:
            ValueError: If no model input is given, labels are given twice or do not fit the outputs, or every
                label is -100 (the NLL of no output is undefined).
        """
        if "label" in inputs:  # split_batch's other key: a score, never a silent drop
            if labels is not None:
                raise ValueError("PosteriorModel got both labels= and label=: give the labels once")
            labels = inputs.pop("label")
        if not inputs:
            raise ValueError(
                "PosteriorModel got no model inputs, only labels (Trainer keeps the columns that the "
                "wrapped model's forward names; else pass TrainingArguments(remove_unused_columns=False))"
            )
        out = self.posterior.predict(inputs, **self.predict_kwargs)
        if isinstance(out, tuple):  # regression: (mean, variance)
            mean, var = out
            if labels is None:
                return {"mean": mean, "variance": var}
            target = labels.to(mean.device, mean.dtype).reshape(mean.shape)
            return {"loss": gaussian_nll(mean, var, target), "mean": mean, "variance": var}
        logp = out.clamp_min(torch.finfo(out.dtype).tiny).log()
        if labels is None:
            return {"logits": logp}
        probs, y = out, labels.to(out.device)
        if self.shift_labels and out.ndim == 3:
            probs, y = out[:, :-1], y[:, 1:]
        if tuple(y.shape) != tuple(probs.shape[:-1]):
            raise ValueError(
                f"labels of shape {tuple(labels.shape)} do not fit predictive outputs of shape "
                f"{tuple(out.shape)}"
            )
        keep = y != IGNORE_INDEX
        if not bool(keep.any()):
            raise ValueError(
                "every label of the batch is -100: no output to score (drop the batch, or call "
                "PosteriorModel without labels)"
            )
        return {"loss": nll(probs[keep], y[keep]), "logits": logp}


def _named_inputs(wrapper: PosteriorModel, model: Any) -> Any:
    """``wrapper.forward`` with ``model.forward``'s keyword names (``Trainer`` drops columns ``forward`` does not name)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    try:
        inner = [
            p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in kinds
        ]
    except (AttributeError, TypeError, ValueError):  # no model, or no signature to read
        inner = []
    params = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name in dict.fromkeys([*inner, "labels"])
    ]
    forward = functools.partial(PosteriorModel.forward, wrapper)
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*params, inspect.Parameter("inputs", inspect.Parameter.VAR_KEYWORD)]
    )
    return forward
