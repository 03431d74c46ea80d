"""IVON's arithmetic (Shen et al., 2024, Alg. 1) as pure element-wise functions: the one statement of it.

The eager path calls these functions on chunks of the parameters, the compiled path calls ``torch.compile``
of the very same functions (see :mod:`partialbayes.ivon._kernels`). They take tensors of one shape (or
broadcastable masks) and return new tensors; hyperparameters are Python floats, or 0-d tensors inside
compiled kernels (so that a changing bias correction never recompiles).

Notation per entry: ``m`` the mean, ``μ`` the gradient momentum, ``h`` the Hessian estimate, ``δ`` the
weight decay, ``λ`` the effective sample size ``ess``, ``σ = 1/√(λ(h+δ))`` the posterior standard deviation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

#: A hyperparameter: a float, or a 0-d tensor inside a compiled kernel.
Scalar = float | Tensor


class Hyper(NamedTuple):
    """The hyperparameters of one IVON update, by name."""

    lr: Scalar
    """Step size α (``lr·(hess_init + δ)`` with ``rescale_lr``)."""
    beta1: Scalar
    """Gradient momentum β1."""
    beta2: Scalar
    """Hessian momentum β2."""
    weight_decay: Scalar
    """δ, the prior precision divided by ``ess``."""
    ess: Scalar
    """Effective sample size λ."""
    bias_correction: Scalar
    """``1 − β1ᵗ`` at step ``t`` (1 without debiasing)."""
    clip_radius: Scalar | None
    """Element-wise clipping radius of the preconditioned step (``None``: no clipping)."""


def weight_sample(
    mean: Tensor, hess: Tensor, noise: Tensor, mask: Tensor | None, *, weight_decay: Scalar
) -> Tensor:
    """A weight sample ``w = m + z/√(h+δ)`` from noise ``z ~ N(0, 1/λ)``, so ``w ~ N(m, σ²)``.

    Args:
        mean: Means ``m``, any shape.
        hess: Hessian estimates ``h``, same shape.
        noise: ``z``, drawn from ``N(0, 1/ess)``, same shape.
        mask: Variational entries (``True``: gets noise), same shape, or ``None`` for all.
        weight_decay: δ.

    Returns:
        ``w``, the shape of ``mean`` (equal to ``m`` outside ``mask``).
    """
    if mask is not None:
        noise = noise * mask
    return mean + noise * torch.rsqrt(hess + weight_decay)


def hess_statistic(
    grad: Tensor, sample: Tensor | None, mean: Tensor, *, hess_approx: str
) -> Tensor:
    """One MC sample's Hessian statistic: ``ε·g`` with ``ε = w − m`` (``"price"``) or ``g²`` (``"gradsq"``).

    Args:
        grad: Gradient ``g`` at the sample, any shape.
        sample: The weight sample ``w``, same shape (not needed for ``"gradsq"``).
        mean: Means ``m``, same shape.
        hess_approx: ``"price"`` or ``"gradsq"``.

    Returns:
        The statistic, the shape of ``grad``.
    """
    if hess_approx == "gradsq":
        return grad * grad
    if sample is None:
        raise ValueError("hess_statistic: 'price' needs the weight sample")
    return (sample - mean) * grad


def ivon_update(
    mean: Tensor,
    momentum: Tensor,
    hess: Tensor,
    grad: Tensor,
    stat: Tensor | None,
    mask: Tensor | None,
    hyper: Hyper,
    *,
    hess_approx: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """One IVON step (Alg. 1, lines 5–8) for one tensor of entries; returns the new ``(m, μ, h)``.

    With ``ĝ = grad`` (the gradient averaged over the MC samples) and ``stat`` averaged likewise::

        ĥ = λ·(h+δ)·stat                        ("price": stat = ε·g, so ĥ = ε·g/σ²)   or   ĥ = stat ("gradsq")
        μ ← β1·μ + (1−β1)·ĝ
        h ← β2·h + (1−β2)·ĥ + ½(1−β2)²·(h−ĥ)²/(h+δ)          (h stays positive even where ĥ < 0)
        m ← m − α·clip((μ/(1−β1ᵗ) + δ·m)/(h+δ), ±clip_radius)

    Args:
        mean: Means ``m``, any shape.
        momentum: Momentum ``μ``, same shape.
        hess: Hessian estimates ``h > 0``, same shape.
        grad: MC-averaged gradient ``ĝ``, same shape.
        stat: MC-averaged statistic of :func:`hess_statistic`, same shape; ``None`` keeps ``h`` fixed (entries
            that are not variational).
        mask: Entries whose ``h`` is learned (elsewhere ``h`` stays fixed), or ``None`` for all.
        hyper: The hyperparameters.
        hess_approx: ``"price"`` or ``"gradsq"``: what ``stat`` holds.

    Returns:
        The new mean, momentum and Hessian estimate, each the shape of ``mean``.
    """
    momentum = hyper.beta1 * momentum + (1 - hyper.beta1) * grad
    if stat is not None:
        h_plus_delta = hess + hyper.weight_decay
        h_hat = hyper.ess * h_plus_delta * stat if hess_approx == "price" else stat
        one_minus_beta2 = 1 - hyper.beta2
        new_hess = (
            hyper.beta2 * hess
            + one_minus_beta2 * h_hat
            + 0.5 * one_minus_beta2**2 * (hess - h_hat) ** 2 / h_plus_delta
        )
        hess = new_hess if mask is None else torch.where(mask, new_hess, hess)
    direction = (momentum / hyper.bias_correction + hyper.weight_decay * mean) / (
        hess + hyper.weight_decay
    )
    if hyper.clip_radius is not None:
        direction = direction.clamp(-hyper.clip_radius, hyper.clip_radius)  # type: ignore[arg-type]
    return mean - hyper.lr * direction, momentum, hess
