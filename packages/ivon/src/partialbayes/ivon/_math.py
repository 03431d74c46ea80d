"""IVON's arithmetic (Shen et al., 2024, Alg. 1) and its update contract: the one statement of both.

Per entry: mean ``m`` (the parameter), momentum ``μ``, Hessian estimate ``h``, weight decay ``δ``,
``λ = ess``, ``σ = 1/√(λ(h+δ))``, sample ``w = m + σ·z`` with ``z ~ N(0, 1)``. A kernel (``*_``) reads a
named tuple (`Shift`, `Fold`, `Update`; ``None`` for an absent field) and overwrites its ``written``
fields with what the pure function of the same name returns, eagerly or compiled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

#: A hyperparameter: a float, or a 0-d tensor inside a compiled kernel.
Scalar = float | Tensor


class Hyper(NamedTuple):
    """The hyperparameters of one IVON update, by name."""

    lr: Scalar  # Step size α (``lr·(hess_init + δ)`` with ``rescale_lr``).
    beta1: Scalar  # Gradient momentum β1.
    beta2: Scalar  # Hessian momentum β2.
    weight_decay: Scalar  # δ, the prior precision divided by ``ess``.
    ess: Scalar  # Effective sample size λ.
    bias_correction: Scalar  # ``1 − β1ᵗ`` at step ``t`` (1 without debiasing).
    clip_radius: Scalar | None  # Element-wise clipping radius of the step (``None``: none).


class Shift(NamedTuple):
    """Entering or leaving a weight sample: ``param`` ← ``param ± ε`` (writes ``param``)."""

    param: Tensor  # ``m`` on entry (``w`` on exit).
    hess: Tensor  # ``h``.
    noise: Tensor  # ``z`` (float16; zero outside the variational entries).

    @property
    def written(self) -> tuple[Tensor, ...]:
        """The tensors the kernel overwrites."""
        return (self.param,)


class Fold(NamedTuple):
    """Folding one more MC sample's Hessian statistic into the running mean ``stat`` (writes ``stat``)."""

    stat: Tensor  # The weighted running mean of the statistic so far.
    grad: Tensor  # The new sample's gradient ``g``.
    noise: Tensor | None  # The new sample's ``z`` (``None`` for ``"gradsq"``).

    @property
    def written(self) -> tuple[Tensor, ...]:
        """The tensors the kernel overwrites."""
        return (self.stat,)


class Update(NamedTuple):
    """One IVON step of one tensor of entries (writes ``mean``, ``momentum`` and ``hess``)."""

    mean: Tensor  # ``m``: the parameter.
    momentum: Tensor  # ``μ``.
    hess: Tensor  # ``h > 0``.
    grad: Tensor  # ``ĝ``: the gradient, averaged over the step's MC samples.
    noise: Tensor | None  # ``z`` of the one sample whose statistic is pending ("price"), or None.
    stat: Tensor | None  # The statistic averaged over the samples if folded, else None.
    mask: Tensor | None  # Entries whose ``h`` is learned (elsewhere it stays fixed); None: all.

    @property
    def written(self) -> tuple[Tensor, ...]:
        """The tensors the kernel overwrites."""
        return (self.mean, self.momentum, self.hess)


def perturbation(hess: Tensor, noise: Tensor, *, scale: Scalar, weight_decay: Scalar) -> Tensor:
    """``scale·z/√(h+δ)`` in ``hess``'s dtype: with ``scale = ±1/√λ`` the perturbation ``±ε`` of a sample."""
    return noise.to(hess.dtype) * torch.rsqrt(hess + weight_decay) * scale


def hess_statistic(grad: Tensor, noise: Tensor | None, *, hess_approx: str) -> Tensor:
    """One sample's Hessian statistic ``z·g`` (``"price"``; `ivon_update` applies ``√(λ(h+δ))``) or ``g²``."""
    if hess_approx == "gradsq":
        return grad * grad
    return noise.to(grad.dtype) * grad  # type: ignore[union-attr]


def ivon_update(
    u: Update, hyper: Hyper, *, hess_approx: str, learn_hess: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One IVON step (Alg. 1, lines 5–8) of one tensor of entries; returns the new ``(m, μ, h)``.

    With ``ĝ = u.grad`` and ``s̄`` the statistic averaged over the step's samples (:func:`hess_statistic`)::

        ĥ = √(λ(h+δ))·s̄   ("price": s̄ = mean z·g, so ĥ = mean ε·g/σ²)   or   ĥ = s̄   ("gradsq")
        μ ← β1·μ + (1−β1)·ĝ
        h ← β2·h + (1−β2)·ĥ + ½(1−β2)²·(h−ĥ)²/(h+δ)          (h stays positive even where ĥ < 0)
        m ← m − α·clip((μ/(1−β1ᵗ) + δ·m)/(h+δ), ±clip_radius)

    ``learn_hess=False`` keeps ``h`` fixed (entries that are not variational).
    """
    hess = u.hess
    momentum = hyper.beta1 * u.momentum + (1 - hyper.beta1) * u.grad
    if learn_hess:
        stat = (
            u.stat
            if u.stat is not None
            else hess_statistic(u.grad, u.noise, hess_approx=hess_approx)
        )
        h_plus_delta = hess + hyper.weight_decay
        h_hat = torch.sqrt(hyper.ess * h_plus_delta) * stat if hess_approx == "price" else stat
        one_minus_beta2 = 1 - hyper.beta2
        new_hess = (
            hyper.beta2 * hess
            + one_minus_beta2 * h_hat
            + 0.5 * one_minus_beta2**2 * (hess - h_hat) ** 2 / h_plus_delta
        )
        hess = new_hess if u.mask is None else torch.where(u.mask, new_hess, hess)
    direction = (momentum / hyper.bias_correction + hyper.weight_decay * u.mean) / (
        hess + hyper.weight_decay
    )
    if hyper.clip_radius is not None:
        direction = direction.clamp(-hyper.clip_radius, hyper.clip_radius)  # type: ignore[arg-type]
    return u.mean - hyper.lr * direction, momentum, hess


def shift_(s: Shift, *, scale: Scalar, weight_decay: Scalar) -> None:
    """``param ← param + perturbation(...)`` in place (``scale = +1/√λ`` enters a sample, ``−1/√λ`` leaves)."""
    s.param.copy_(s.param + perturbation(s.hess, s.noise, scale=scale, weight_decay=weight_decay))


def fold_(f: Fold, *, hess_approx: str, rate: Scalar) -> None:
    """``stat ← stat + rate·(statistic − stat)`` in place (``rate = w_k / Σ_{j≤k} w_j`` for sample ``k``)."""
    new = hess_statistic(f.grad, f.noise, hess_approx=hess_approx)
    f.stat.copy_(f.stat + rate * (new - f.stat))


def update_(u: Update, *, hyper: Hyper, hess_approx: str, learn_hess: bool) -> None:
    """:func:`ivon_update` in place on ``u.mean``, ``u.momentum`` and ``u.hess``."""
    new = ivon_update(u, hyper, hess_approx=hess_approx, learn_hess=learn_hess)
    for dst, src in zip(u.written, new, strict=True):
        if src is not dst:
            dst.copy_(src)
