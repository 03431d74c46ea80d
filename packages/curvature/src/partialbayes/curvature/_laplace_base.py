"""`LaplaceBase`: what every Laplace posterior over a `Subset` offers, put together from one file per concern.

State, subclass hooks and fitting: ``_laplace_core``; evidence and prior tuning: ``_laplace_evidence``;
samples and swapping: ``_laplace_sampling``; the linearised predictive: ``_laplace_predict``; files:
``_io``. This file adds the size, the summary and saving.
"""

from __future__ import annotations

import os
from typing import ClassVar

from torch import nn

from partialbayes.curvature._io import load_posterior, save_posterior
from partialbayes.curvature._laplace_evidence import LaplaceEvidence
from partialbayes.curvature._laplace_predict import LINKS, LaplacePredictive
from partialbayes.curvature._laplace_sampling import LaplaceSampling


class LaplaceBase(LaplaceEvidence, LaplaceSampling, LaplacePredictive):
    """Shared machinery of `KronLaplace`, `DiagLaplace` and `DenseLaplace` (not used directly).

    Batches, everywhere (``fit``, ``logit_mean_cov``, ``predict``, ``optimize_prior_precision``): a tensor
    ``x``, a pair ``(inputs, labels)``, or any mapping of keyword inputs (``dict``, the ``BatchEncoding``
    of ``DataCollatorWithPadding``) with labels under ``"labels"`` or ``"label"``.

    Outputs: logits ``[B, C]`` give one output per example; token-level logits ``[B, T, C]`` (token
    classification, causal LMs) one per kept position — positions where the attention mask is 0 or the
    label is -100 are dropped, in the curvature, the training loss, ``n_data`` and the predictive alike.

    Args:
        model: The fine-tuned model (its current weights are the MAP).
        subset: Which entries get a posterior; the rest stay at their MAP values.
        likelihood: ``"classification"`` (softmax cross-entropy) or ``"regression"`` (Gaussian, ``sigma_noise``).
        prior_precision: ``δ > 0``: a scalar, a tensor with one value per module, or ``{module: δ}``.
        temperature: ``T > 0``; the posterior precision is ``H / T + δ``.
        sigma_noise: Observation noise of the regression likelihood.
        fisher: ``"exact"`` (GGN), ``"mc"`` or ``"empirical"``; passed to the curvature routine.
        mc_samples: Sampled labels per example for ``fisher="mc"`` (a positive ``int``; seed the sampling with
            ``fit(..., generator=...)``).
        num_classes: Expected number of logits (checked during `fit`); ``None`` to skip the check.
        dtype: dtype of the stored curvature: ``torch.float64`` (default) or ``torch.float32``.
        shift_labels: Token-level outputs of a causal language model: the output at position ``t`` is
            scored against ``labels[t + 1]`` (Hugging Face shifts the labels inside the model; this makes
            the same convention explicit) and is kept when the tokens ``t`` and ``t + 1`` are real and that
            label is not -100. ``None`` (default): ``True`` exactly when the model's class name ends with
            ``ForCausalLM`` or ``LMHeadModel``. Stored by `save`.
    """

    #: Links `predict` accepts: the linearised probit (default), Monte Carlo over the linearised
    #: Gaussian logits, and the Laplace bridge.
    links: ClassVar[tuple[str, ...]] = LINKS

    @property
    def num_floats(self) -> int:
        """Floats stored for the posterior covariance (curvature representation; MAP excluded)."""
        self._require_fit()
        return sum(t.numel() for t in self._curvature_state().values())

    def summary(self) -> str:
        """A readable table: module, stored structure, floats; with totals."""
        self._require_fit()
        rows = self._summary_rows()
        width = max([len("module"), *(len(m) for m, _, _ in rows)])
        lines = [
            f"{type(self).__name__}: {len(self.modules)} modules, {self.subset.num_entries()} parameters, "
            f"likelihood={self.likelihood}, fisher={self.fisher}, T={self.temperature:g}, N={self.n_data}",
            f"{'module'.ljust(width)}  {'structure':<40}  floats",
        ]
        lines += [f"{m.ljust(width)}  {s:<40}  {f}" for m, s, f in rows]
        lines.append(f"{'total'.ljust(width)}  {'':<40}  {self.num_floats}")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save to one ``.safetensors`` file (tensors) with JSON metadata (options, subset, model structure)."""
        save_posterior(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> LaplaceBase:
        """Load a posterior saved with `save` onto ``model``.

        ``LaplaceBase.load`` loads whichever posterior class the file holds.

        Raises:
            ValueError: If ``model``'s parameter names / shapes or the saved subset do not match, or the file
                holds another posterior type than ``cls``.
        """
        post: LaplaceBase = load_posterior(path, model, cls)
        return post

    def __repr__(self) -> str:
        state = f"{self.num_floats} floats" if self._fitted else "not fitted"
        return f"{type(self).__name__}({len(self.modules)} modules, {state})"
