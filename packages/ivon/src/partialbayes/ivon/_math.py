"""Element-wise update rules of IVON (Shen et al., 2024, Alg. 1) on lists of tensors.

Every list function works on a list of same-device, same-dtype tensors with ``torch._foreach_*`` kernels, so
that one call touches all parameters of a bucket (one fused multi-tensor kernel on CUDA, one C++ loop on the
CPU) instead of launching several small kernels per parameter from Python. In-place functions end in ``_``.

Notation (per entry): ``m`` the mean, ``h`` the Hessian estimate, ``δ`` the weight decay (prior precision per
unit ``ess``), ``λ = ess`` the effective sample size, ``σ = 1/√(λ(h+δ))`` the posterior standard deviation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _add(
    tensors: list[Tensor],
    scalar: float,
    out: list[Tensor] | None,
    other: list[Tensor] | None = None,
) -> list[Tensor]:
    """``tensors + scalar`` (or ``tensors + scalar·other``), in ``out`` when given (no allocation), else new."""
    if out is None:
        if other is None:
            return torch._foreach_add(tensors, scalar)
        return torch._foreach_add(tensors, other, alpha=scalar)
    for t, dst, o in zip(
        tensors, out, other if other is not None else [None] * len(out), strict=True
    ):
        if o is None:
            torch.add(t, scalar, out=dst)
        else:
            torch.add(t, o, alpha=scalar, out=dst)
    return out


def _slot(scratch: list[list[Tensor]] | None, i: int) -> list[Tensor] | None:
    return None if scratch is None else scratch[i]


def hessian_update(h: Tensor, h_hat: Tensor, beta2: float, delta: float) -> Tensor:
    """IVON's Hessian update, which keeps ``h`` positive: ``β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ)``.

    Args:
        h: Current Hessian estimate (positive), any shape.
        h_hat: New reparameterisation estimate, same shape.
        beta2: Hessian momentum in ``[0, 1)``.
        delta: Weight decay δ (the prior precision per unit ess).

    Returns:
        The new Hessian estimate.
    """
    return beta2 * h + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h - h_hat) ** 2 / (h + delta)


def perturb_(
    noise: list[Tensor],
    means: list[Tensor],
    hess: list[Tensor],
    delta: float,
    scratch: list[Tensor] | None = None,
) -> None:
    """Turn noise ``z·c`` into a weight sample ``m + c·z/√(h+δ)`` in place (``c = 1/√ess`` drawn into z).

    Args:
        noise: Noise per parameter, overwritten with the sample; each of the parameter's shape.
        means: Means, same shapes (read only).
        hess: Hessian estimates ``h``, same shapes (read only).
        delta: Weight decay δ.
        scratch: Optional buffers of the same shapes for the temporary.
    """
    scale = _add(hess, delta, scratch)
    torch._foreach_rsqrt_(scale)
    torch._foreach_mul_(noise, scale)
    del scale
    torch._foreach_add_(noise, means)


def price_sample_(samples: list[Tensor], means: list[Tensor], grads: list[Tensor]) -> None:
    """Overwrite weight samples ``w`` with ``(w − m)·g``, the product of the applied noise and the gradient.

    Using ``w − m`` (the perturbation that was actually applied, after rounding) rather than the drawn noise
    saves a buffer; in exact arithmetic they agree.

    Args:
        samples: Weight samples ``w``, overwritten.
        means: Means ``m``, same shapes.
        grads: Gradients ``g`` at ``w``, same shapes.
    """
    torch._foreach_sub_(samples, means)
    torch._foreach_mul_(samples, grads)


def running_mean_(avg: list[Tensor], new: list[Tensor], count: int) -> None:
    """Welford running mean in place: ``avg ← avg + (new − avg)/count``, for the ``count``-th value."""
    torch._foreach_lerp_(avg, new, 1.0 / count)


def price_to_hessian_(
    nxg: list[Tensor],
    hess: list[Tensor],
    delta: float,
    ess: float,
    scratch: list[Tensor] | None = None,
) -> None:
    """Reparameterisation (Price) estimate in place: ``ĥ = E[ε·g]/σ² = E[ε·g]·ess·(h+δ)``.

    Args:
        nxg: Monte-Carlo mean of ``ε·g``, overwritten with ``ĥ``.
        hess: Current ``h`` (read only).
        delta: Weight decay δ.
        ess: Effective sample size λ.
        scratch: Optional buffers of the same shapes for the temporary.
    """
    scale = _add(hess, delta, scratch)
    torch._foreach_mul_(nxg, scale)
    torch._foreach_mul_(nxg, ess)


def hessian_step_(
    hess: list[Tensor],
    h_hat: list[Tensor],
    beta2: float,
    delta: float,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """:func:`hessian_update` in place on lists: ``h ← β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ)``.

    Args:
        hess: ``h``, updated in place.
        h_hat: ``ĥ``, destroyed (used as scratch).
        beta2: Hessian momentum β2.
        delta: Weight decay δ.
        scratch: Optional two lists of buffers of the same shapes for the temporaries.
    """
    denom = _add(hess, delta, _slot(scratch, 0))
    diff2 = _add(h_hat, -1.0, _slot(scratch, 1), other=hess)
    torch._foreach_mul_(diff2, diff2)
    torch._foreach_lerp_(hess, h_hat, 1.0 - beta2)
    torch._foreach_addcdiv_(hess, diff2, denom, value=0.5 * (1.0 - beta2) ** 2)


def mean_step_(
    means: list[Tensor],
    momentum: list[Tensor],
    hess: list[Tensor],
    *,
    lr: float,
    delta: float,
    debias: float,
    clip_radius: float,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """Mean update in place: ``m ← m − lr·clip((μ/debias + δ·m)/(h+δ), ±clip_radius)``.

    Args:
        means: Means ``m`` (the parameters), updated in place.
        momentum: Gradient momentum ``μ``.
        hess: Hessian estimates ``h`` (already updated this step).
        lr: Effective learning rate (after ``rescale_lr``).
        delta: Weight decay δ.
        debias: Momentum debiasing factor ``1 − β1^t`` (1 to switch debiasing off).
        clip_radius: Element-wise clipping radius (``inf`` for none).
        scratch: Optional two lists of buffers of the same shapes for the temporaries.
    """
    # direction·debias = μ + debias·δ·m, divided by h + δ; the debias factor is folded into lr and the radius.
    direction = _add(momentum, delta * debias, _slot(scratch, 0), other=means)
    denom = _add(hess, delta, _slot(scratch, 1))
    torch._foreach_div_(direction, denom)
    del denom
    if clip_radius != float("inf"):
        torch._foreach_clamp_min_(direction, -clip_radius * debias)
        torch._foreach_clamp_max_(direction, clip_radius * debias)
    torch._foreach_add_(means, direction, alpha=-lr / debias)


def sample_(
    noise: list[Tensor],
    means: list[Tensor],
    hess: list[Tensor],
    masks: list[Tensor] | None,
    *,
    std: float,
    delta: float,
    generator: torch.Generator | None,
    draw: bool = True,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """Draw ``z ~ N(0, std²)`` into ``noise``, zero it outside ``masks``, and make it the sample ``m + z/√(h+δ)``.

    Args:
        noise: Buffers of the parameters' shapes, overwritten with the samples.
        means: Means ``m``.
        hess: Hessian estimates ``h``.
        masks: Boolean masks of the variational entries, or ``None`` (all entries).
        std: ``1/√ess``.
        delta: Weight decay δ.
        generator: Generator for the draw (``None``: the global RNG of the device).
        draw: Draw the noise here; ``False`` when ``noise`` already holds ``z``.
        scratch: Optional buffers for the temporaries (see :mod:`partialbayes.ivon._blocked`).
    """
    if draw:
        for z in noise:
            z.normal_(0.0, std, generator=generator)
    if masks is not None:
        torch._foreach_mul_(noise, masks)
    perturb_(noise, means, hess, delta, _slot(scratch, 0))


def collect_price_(
    samples: list[Tensor],
    means: list[Tensor],
    grads: list[Tensor],
    avg: list[Tensor] | None,
    count: int,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """Turn samples into ``ε·g`` (:func:`price_sample_`) and, for the ``count``-th sample, average into ``avg``.

    ``scratch`` is accepted for a uniform interface and unused.
    """
    del scratch
    price_sample_(samples, means, grads)
    if avg is not None:
        running_mean_(avg, samples, count)


def update_(
    means: list[Tensor],
    momentum: list[Tensor],
    hess: list[Tensor],
    grads: list[Tensor],
    h_hat: list[Tensor] | None,
    masks: list[Tensor] | None,
    *,
    price: bool,
    beta1: float,
    beta2: float,
    delta: float,
    ess: float,
    lr: float,
    debias: float,
    clip_radius: float,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """One IVON step in place: momentum, Hessian (when ``h_hat`` is given) and mean.

    Args:
        means: Means ``m`` (the parameters).
        momentum: Momentum ``μ``.
        hess: Hessian estimates ``h``.
        grads: MC-averaged gradients ``ĝ``.
        h_hat: MC-averaged ``ε·g`` (``price``) or ``g²``; ``None`` keeps ``h`` fixed. Destroyed.
        masks: Variational entries (``h`` is kept fixed elsewhere), or ``None`` for all.
        price: Whether ``h_hat`` holds ``ε·g`` (to be scaled by ``ess·(h+δ)``).
        beta1: Gradient momentum β1.
        beta2: Hessian momentum β2.
        delta: Weight decay δ.
        ess: Effective sample size.
        lr: Effective learning rate (after ``rescale_lr``).
        debias: ``1 − β1ᵗ`` or 1.
        clip_radius: Element-wise clipping radius.
        scratch: Optional two lists of buffers of the same shapes for the temporaries.
    """
    torch._foreach_lerp_(momentum, grads, 1.0 - beta1)
    if h_hat is not None:
        if price:
            price_to_hessian_(h_hat, hess, delta, ess, _slot(scratch, 0))
        if masks is not None:
            h_hat = [torch.where(m, e, h) for m, e, h in zip(masks, h_hat, hess, strict=True)]
        hessian_step_(hess, h_hat, beta2, delta, scratch)
    mean_step_(
        means,
        momentum,
        hess,
        lr=lr,
        delta=delta,
        debias=debias,
        clip_radius=clip_radius,
        scratch=scratch,
    )
