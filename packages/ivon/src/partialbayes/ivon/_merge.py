"""Uncertainty-weighted merging of fine-tunes of one base model (Daheim et al., 2024; Shen et al., 2024, §4.3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from partialbayes.ivon._examples import class_logits, labelled_batches, requiring_grad
from partialbayes.ivon.posterior import GaussianPosterior
from partialbayes.predictive.internal import check_number, check_shapes, eval_mode, model_logits


def _check_same(posteriors: Sequence[Any]) -> dict[str, torch.Size]:
    """The parameter names and shapes every posterior shares; the first mismatch is named."""
    if len(posteriors) == 0:
        raise ValueError("merge: needs at least one posterior")
    for t, post in enumerate(posteriors):
        if not isinstance(post, GaussianPosterior):
            raise TypeError(
                f"merge: posterior {t} is a {type(post).__name__}, expected a GaussianPosterior "
                "(ivon_posterior(optimizer, model) of each fine-tune)"
            )
    # fine-tunes of one base model: the same parameters, of the same shapes
    shapes = {n: m.shape for n, m in posteriors[0].mean.items()}
    for t, post in enumerate(posteriors[1:], start=1):
        check_shapes("merge: ", post.mean, shapes, f"posterior {t}", "posterior 0")
        own = {n: m.shape for n, m in post.mean.items()}
        check_shapes("merge: ", posteriors[0].mean, own, "posterior 0", f"posterior {t}")
    return shapes


def _base_weights(
    base: nn.Module | Mapping[str, Tensor], shapes: Mapping[str, torch.Size]
) -> dict[str, Tensor]:
    named = dict(base.named_parameters()) if isinstance(base, nn.Module) else dict(base)
    for name, shape in shapes.items():
        if name not in named or named[name].shape != shape:
            got = "missing" if name not in named else f"of shape {tuple(named[name].shape)}"
            raise ValueError(
                f"merge: parameter {name!r} of the posteriors is {got} in base (expected {tuple(shape)})"
            )
    return {n: named[n].detach() for n in shapes}


def merge(
    posteriors: Sequence[GaussianPosterior],
    base: nn.Module | Mapping[str, Tensor] | None = None,
    *,
    precisions: Sequence[Mapping[str, Tensor]] | None = None,
    base_precision: float = 0.0,
) -> dict[str, Tensor]:
    """Merge IVON fine-tunes of one base model, each weight weighted by the fine-tunes' precisions.

    ``θ = θ₀ + Σ_t (h₀ + Σ_s H_s)⁻¹ H_t (θ_t − θ₀)`` elementwise; with ``h₀ = 0`` the base cancels:
    ``θ = Σ_t H_t θ_t / Σ_s H_s``. An entry no fine-tune has information on (every ``H_t`` and ``h₀`` 0) is the
    plain average of the ``θ_t``.

    Args:
        posteriors: ``ivon_posterior(optimizer, model)`` of each fine-tune (same parameters and shapes).
        base: The base model (or its ``{name: tensor}``), ``θ₀``; needed when ``base_precision > 0``.
        precisions: ``H_t`` per posterior, ``{name: tensor}`` of the means' shapes (e.g.
            :func:`squared_gradients`); default IVON's ``1/σ_t²`` (0 where ``σ_t = 0``).
        base_precision: ``h₀ >= 0``, the pull towards the base weights.

    Returns:
        ``{param name: merged weights}`` on the means' devices: ``model.load_state_dict(w, strict=False)``.

    Raises:
        TypeError: If ``posteriors`` is not a list (or other iterable) of :class:`GaussianPosterior`.
        ValueError: If the posteriors differ in their parameters or shapes (the first mismatch is named),
            ``precisions`` does not fit them, ``base_precision`` is negative, or it is positive and ``base``
            is missing or does not fit.
    """
    if isinstance(posteriors, GaussianPosterior | str | Mapping) or not isinstance(
        posteriors, Iterable
    ):
        raise TypeError(
            f"merge: posteriors must be a list of GaussianPosterior, got a {type(posteriors).__name__} "
            "(merge([ivon_posterior(opt_a, model_a), ivon_posterior(opt_b, model_b)]))"
        )
    posteriors = list(posteriors)  # a generator is read once
    shapes = _check_same(posteriors)
    check_number("merge: base_precision", base_precision, "[0, inf)")
    if base is None and base_precision > 0:
        raise ValueError(
            "merge: base_precision > 0 pulls the merged weights towards the base model's, and the posteriors "
            "do not carry their start point: pass base=<the base model or its state_dict>"
        )
    if precisions is None:
        precisions = [
            {n: torch.where(s > 0, s.double() ** -2, 0.0) for n, s in p.std.items()}
            for p in posteriors
        ]
    if len(precisions) != len(posteriors):
        raise ValueError(f"merge: {len(precisions)} precisions for {len(posteriors)} posteriors")
    for t, prec in enumerate(precisions):
        for name, shape in shapes.items():
            if name not in prec or prec[name].shape != shape or bool((prec[name] < 0).any()):
                raise ValueError(
                    f"merge: precisions[{t}][{name!r}] must be a tensor >= 0 of shape {tuple(shape)}"
                )
    theta0 = _base_weights(base, shapes) if base is not None else {}
    merged, tiny = {}, torch.finfo(torch.float64).tiny
    for name in shapes:
        means = torch.stack([p.mean[name].double() for p in posteriors])
        weights = torch.stack([h[name].to(means.device, torch.float64) for h in precisions])
        origin = theta0[name].to(means.device, torch.float64) if name in theta0 else means.mean(0)
        total = base_precision + weights.sum(0)
        pulled = origin + (weights * (means - origin)).sum(0) / total.clamp_min(tiny)
        merged[name] = torch.where(total > 0, pulled, means.mean(0))
    return {n: m.to(posteriors[0].mean[n].dtype) for n, m in merged.items()}


def squared_gradients(
    posterior: GaussianPosterior,
    loader: Iterable[Any],
    *,
    sampled: bool = True,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """The squared-gradient precisions ``{name: Σ_n (∂ℓ_n/∂θ)²}`` of a fine-tune, for :func:`merge`.

    The diagonal empirical Fisher of the cross-entropy of every labelled example of ``loader`` (class labels
    ``[B]``; -100 skipped), one backward pass per example, in eval mode, at one weight sample of ``posterior``
    per batch drawn with ``generator`` (the paper's estimator) or at the mean (``sampled=False``).

    Raises:
        ValueError: If the loader has no labelled example, a batch has no labels or is empty, or the logits
            are not ``[B, C]``.
    """
    model = posterior.model
    params = {n: model.get_parameter(n) for n in posterior.mean}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    with eval_mode(model), requiring_grad(params.values()), torch.enable_grad():
        for batch in labelled_batches(loader, model, "squared_gradients"):
            with posterior.sampled(generator=generator) if sampled else nullcontext():
                for _, inputs, label in batch:
                    logits = class_logits(model_logits(model, inputs), "squared_gradients")
                    loss = F.cross_entropy(
                        logits[None], torch.tensor([label], device=logits.device)
                    )
                    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
                    for t, g in zip(total.values(), grads, strict=True):
                        if g is not None:
                            t.add_(g.double().square())
    return {n: t.to(params[n].dtype) for n, t in total.items()}
