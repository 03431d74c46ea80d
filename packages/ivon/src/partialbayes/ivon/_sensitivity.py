"""Sensitivity to each training example and the leave-one-out estimate (Nickl et al., 2023; Shen et al., §4.4)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialbayes.ivon._examples import class_logits, labelled_batches, requiring_grad
from partialbayes.ivon.optimizer import IVON
from partialbayes.ivon.posterior import GaussianPosterior
from partialbayes.predictive.internal import check_number, eval_mode, model_logits


@dataclass(frozen=True)
class Sensitivity:
    """Per-example sensitivities of a model to its training data (see :func:`sensitivity`).

    Attributes:
        index: ``[N]`` position of each scored example in the loader (counting unlabelled ones too).
        labels: ``[N]`` class labels.
        logits: ``[N, C]`` logits at the posterior mean.
        variance: ``[N, C, C]`` prediction variances ``V_i = J_i diag(σ²) J_iᵀ``.
    """

    index: Tensor
    labels: Tensor
    logits: Tensor
    variance: Tensor

    @property
    def residual(self) -> Tensor:
        """``[N, C]`` prediction errors ``e_i = softmax(f_i) − onehot(y_i)``."""
        onehot = F.one_hot(self.labels, self.logits.shape[-1]).to(self.logits.dtype)
        return self.logits.softmax(-1) - onehot

    @property
    def shift(self) -> Tensor:
        """``[N, C]`` the predicted change of each example's logits when it is left out: ``V_i e_i``."""
        return (self.variance @ self.residual.unsqueeze(-1)).squeeze(-1)

    @property
    def scores(self) -> Tensor:
        """``[N]`` scalar sensitivities ``‖V_i e_i‖₁`` (high: the model leans on the example)."""
        return self.shift.abs().sum(-1)

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood of the examples at the posterior mean (the training loss)."""
        return float(F.cross_entropy(self.logits, self.labels))

    @property
    def loo_nll(self) -> float:
        """The leave-one-out estimate ``mean_i −log softmax(f_i + V_i e_i)[y_i]`` of the held-out NLL."""
        return float(F.cross_entropy(self.logits + self.shift, self.labels))

    def rescaled(self, factor: float) -> Sensitivity:
        """The sensitivities with the variances ``V_i`` scaled by ``factor`` (``λ / N`` reads an ``ess = λ`` run as N's)."""
        check_number("Sensitivity.rescaled: factor", factor, "[0, inf)")
        return replace(self, variance=self.variance * factor)


def _variances(source: Any, model: nn.Module | None) -> tuple[nn.Module, dict[str, Tensor]]:
    """The model and ``{name: σ²}`` of its parameters with some ``σ > 0``."""
    if isinstance(source, GaussianPosterior):
        if model is not None and model is not source.model:
            raise ValueError("sensitivity: model= is for an IVON optimizer; a posterior has one")
        model = source.model
        std = source.std
    elif isinstance(source, IVON):
        if model is None:
            raise ValueError("sensitivity(optimizer, loader) needs model=...: the model it trains")
        source._check_outside("sensitivity")
        held = {p for g in source.param_groups for p in g["params"]}
        std = {n: source.posterior_std(p) for n, p in model.named_parameters() if p in held}
    else:
        raise TypeError(
            f"sensitivity: expected a GaussianPosterior or an IVON optimizer, got {type(source).__name__}"
        )
    params = dict(model.named_parameters())
    var = {
        n: s.to(params[n].device) ** 2
        for n, s in std.items()
        if n in params and bool((s > 0).any())
    }
    if not var:
        raise ValueError("sensitivity: no parameter has σ > 0")
    return model, var


def sensitivity(
    source: GaussianPosterior | IVON, loader: Iterable[Any], *, model: nn.Module | None = None
) -> Sensitivity:
    """Per-example sensitivities, their scores and the leave-one-out NLL estimate of a (training) posterior.

    ``source`` is a :class:`GaussianPosterior` bound to its model, or an :class:`IVON` optimizer with its
    ``model`` (its current means and ``σ``, read outside ``sampled_params`` without copies: usable during
    training). ``loader`` gives batches with class labels ``[B]`` (the training data, for leave-one-out;
    -100 skipped). Eval mode; one forward and ``C`` backward passes per labelled example.

    Raises:
        TypeError: If ``source`` is neither.
        ValueError: If the loader has no labels (or none but -100), a batch is empty, the logits are not
            ``[B, C]``, or no parameter has ``σ > 0``; with an optimizer and no ``model``.
    """
    model, var = _variances(source, model)
    params = [model.get_parameter(n) for n in var]
    sigma2 = [v.reshape(-1) for v in var.values()]
    rows: list[tuple[int, int, Tensor, Tensor]] = []
    examples = (e for batch in labelled_batches(loader, model, "sensitivity") for e in batch)
    with eval_mode(model), requiring_grad(params), torch.enable_grad():
        for index, inputs, label in examples:
            logits = class_logits(model_logits(model, inputs), "sensitivity")
            c = logits.shape[0]
            grads = [
                torch.autograd.grad(logits[k], params, retain_graph=k < c - 1, allow_unused=True)
                for k in range(c)
            ]
            variance = logits.new_zeros(c, c)
            for j, s2 in enumerate(sigma2):
                if all(g[j] is None for g in grads):
                    continue  # the parameter plays no part in this output
                jac = torch.stack(
                    [torch.zeros_like(s2) if g[j] is None else g[j].reshape(-1) for g in grads]
                )
                variance += (jac * s2) @ jac.T
            rows.append((index, label, logits.detach(), variance.detach()))
    return Sensitivity(
        index=torch.tensor([r[0] for r in rows]),
        labels=torch.tensor([r[1] for r in rows], device=rows[0][2].device),
        logits=torch.stack([r[2] for r in rows]),
        variance=torch.stack([r[3] for r in rows]),
    )
