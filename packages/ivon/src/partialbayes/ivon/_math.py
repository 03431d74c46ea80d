"""Element-wise update rules of IVON (Shen et al., 2024, Alg. 1) on lists of tensors, in few passes.

Every list function takes aligned lists of same-device, same-dtype tensors. Without ``scratch`` it uses
``torch._foreach_*`` multi-tensor kernels over whole lists (the GPU path: temporaries come from the caching
allocator). With ``scratch`` (the CPU path, see :mod:`partialbayes.ivon._blocked`) the lists hold one chunk
each and every temporary is written into a reused buffer, so nothing is allocated. In-place functions end in
``_``.

Notation (per entry): ``m`` the mean, ``μ`` the gradient momentum, ``h`` the Hessian estimate, ``δ`` the
weight decay, ``λ = ess``, ``σ = 1/√(λ(h+δ))``, ``w = m + ε`` a weight sample, ``g`` the gradient at ``w``.

Passes over the parameters per training step with one MC sample (each reads and writes a few of the
buffers; the normal draw is the costliest by far on CPUs):

* before the forward pass, :func:`draw_`: the normal draw, ``s = h+δ``, ``s ← 1/√s``, ``w = m + z·s`` (4);
* :meth:`~partialbayes.ivon.IVON.step`, :func:`update_`: momentum (1), ``ε·g`` (2), ``h+δ`` and
  ``d = h − ĥ`` (2), ``h`` (3), mean (3) — 11.

With ``torch.compile`` (:mod:`partialbayes.ivon._compiled`) these are one pass each, plus the draw.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: What the Hessian-estimate argument ``est`` of :func:`update_` holds.
#: ``"sample"``: the weight samples ``w`` of the (single) MC sample, ``ĥ = (w−m)·g·λ(h+δ)``;
#: ``"price"``: the MC mean of ``ε·g``, ``ĥ = est·λ(h+δ)``; ``"gradsq"``: the MC mean of ``g²``;
#: ``"grad"``: nothing (``est`` is ``None``), ``ĥ = g²`` from the gradient; ``None``: ``h`` is kept fixed.
EST_KINDS = ("sample", "price", "gradsq", "grad", None)

#: A list of tensors as the ``torch._foreach_*`` kernels take and return them (they return tuples).
Tensors = list[Tensor] | tuple[Tensor, ...]


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


def _slot(scratch: list[list[Tensor]] | None, i: int) -> list[Tensor] | None:
    return None if scratch is None else scratch[i]


def _add(
    tensors: list[Tensor],
    scalar: float,
    out: list[Tensor] | None,
    other: list[Tensor] | None = None,
) -> Tensors:
    """``tensors + scalar`` (or ``tensors + scalar·other``), written into ``out`` when given, else new."""
    if out is None:
        if other is None:
            return torch._foreach_add(tensors, scalar)
        return torch._foreach_add(tensors, other, alpha=scalar)
    for i, (t, dst) in enumerate(zip(tensors, out, strict=True)):
        if other is None:
            torch.add(t, scalar, out=dst)
        else:
            torch.add(t, other[i], alpha=scalar, out=dst)
    return out


def _addcmul(
    base: Tensors, t1: Tensors, t2: Tensors, value: float, out: list[Tensor] | None
) -> Tensors:
    """``base + value·t1·t2``, written into ``out`` when given, else new."""
    if out is None:
        return torch._foreach_addcmul(base, t1, t2, value=value)
    for b, x, y, o in zip(base, t1, t2, out, strict=True):
        torch.addcmul(b, x, y, value=value, out=o)
    return out


def running_mean_(avg: list[Tensor], new: list[Tensor], count: int) -> None:
    """Welford running mean in place: ``avg ← avg + (new − avg)/count``, for the ``count``-th value."""
    torch._foreach_lerp_(avg, new, 1.0 / count)


def draw_(
    samples: list[Tensor],
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
    """Draw ``z ~ N(0, std²)`` into ``samples`` and turn it into the weight sample ``m + z/√(h+δ)``.

    With ``std = 1/√λ`` this is ``w = m + ε``, ``ε ~ N(0, σ²)``. The draw is one ``normal_`` per tensor in
    list order (so chunks of one parameter draw in order too); entries outside ``masks`` get ``ε = 0``.

    Args:
        samples: Buffers of the parameters' shapes, overwritten with the samples.
        means: Means ``m`` (read only).
        hess: Hessian estimates ``h`` (read only).
        masks: Boolean masks of the variational entries, or ``None`` (all entries).
        std: ``1/√ess``.
        delta: Weight decay δ.
        generator: Generator for the draw (``None``: the global RNG of the device).
        draw: Draw the noise here; ``False`` when ``samples`` already hold ``z``.
        scratch: Reused buffers (one chunk per list; see :mod:`partialbayes.ivon._blocked`).
    """
    if draw:
        for z in samples:
            z.normal_(0.0, std, generator=generator)
    if masks is not None:
        torch._foreach_mul_(samples, masks)
    scale = _add(hess, delta, _slot(scratch, 0))
    torch._foreach_rsqrt_(scale)
    if scratch is None:  # addcmul (fused multiply-add) rounds like the scratch path below
        torch._foreach_copy_(samples, torch._foreach_addcmul(means, samples, scale))
    else:  # one fused pass: w = m + z·s
        for w, m, s in zip(samples, means, scale, strict=True):
            torch.addcmul(m, w, s, out=w)


def price_product_(
    out: list[Tensor], samples: list[Tensor], means: list[Tensor], grads: list[Tensor]
) -> None:
    """``out ← (w − m)·g``: the applied perturbation ``ε`` times the gradient (``out`` may be ``samples``).

    Using ``w − m`` (the perturbation actually applied, after rounding) rather than the drawn noise saves a
    buffer; in exact arithmetic they agree.

    Args:
        out: Destination buffers, same shapes.
        samples: Weight samples ``w``.
        means: Means ``m``.
        grads: Gradients ``g`` at ``w``.
    """
    for o, w, m, g in zip(out, samples, means, grads, strict=True):
        torch.sub(w, m, out=o)
        o.mul_(g)


def update_(
    means: list[Tensor],
    momentum: list[Tensor],
    hess: list[Tensor],
    grads: list[Tensor],
    est: list[Tensor] | None,
    masks: list[Tensor] | None,
    *,
    est_kind: str | None,
    beta1: float,
    beta2: float,
    delta: float,
    ess: float,
    lr: float,
    debias: float,
    clip_radius: float,
    scratch: list[list[Tensor]] | None = None,
) -> None:
    """One IVON step in place: momentum, Hessian (unless ``est_kind`` is ``None``) and mean.

    ``μ ← β1·μ + (1−β1)·ĝ``; ``h ← β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ)``, written as
    ``d = h − ĥ``, ``h ← h − (1−β2)·d + ½(1−β2)²·d²/(h+δ)``; then
    ``m ← m − (lr/debias)·clip((μ + debias·δ·m)/(h+δ), ±debias·clip_radius)``.

    Args:
        means: Means ``m`` (the parameters).
        momentum: Momentum ``μ``.
        hess: Hessian estimates ``h``.
        grads: MC-averaged gradients ``ĝ``.
        est: The Hessian statistic, as ``est_kind`` says (see :data:`EST_KINDS`); destroyed.
        masks: Variational entries (``h`` is kept fixed elsewhere), or ``None`` for all.
        est_kind: One of :data:`EST_KINDS`.
        beta1: Gradient momentum β1.
        beta2: Hessian momentum β2.
        delta: Weight decay δ.
        ess: Effective sample size λ.
        lr: Effective learning rate (after ``rescale_lr``).
        debias: ``1 − β1ᵗ`` or 1.
        clip_radius: Element-wise clipping radius.
        scratch: Two lists of reused buffers for the temporaries (``None``: allocate).
    """
    torch._foreach_lerp_(momentum, grads, 1.0 - beta1)
    if est_kind is not None:
        denom = _add(hess, delta, _slot(scratch, 0))  # h + δ
        if est_kind in ("sample", "price"):
            if est is None:
                raise ValueError(f"update_: est_kind {est_kind!r} needs est")
            if est_kind == "sample":
                price_product_(est, est, means, grads)  # ε·g
            diff = _addcmul(hess, est, denom, -ess, _slot(scratch, 1))  # h − ĥ = h − λ·ε·g·(h+δ)
        elif est_kind == "gradsq":
            if est is None:
                raise ValueError("update_: est_kind 'gradsq' needs est")
            diff = _add(hess, -1.0, _slot(scratch, 1), other=est)
        elif est_kind == "grad":
            diff = _addcmul(hess, grads, grads, -1.0, _slot(scratch, 1))
        else:
            raise ValueError(f"update_: unknown est_kind {est_kind!r}")
        if masks is not None:  # ĥ := h outside the mask, so h stays fixed there
            torch._foreach_mul_(diff, masks)
        torch._foreach_add_(hess, diff, alpha=-(1.0 - beta2))
        torch._foreach_mul_(diff, diff)
        torch._foreach_addcdiv_(hess, diff, denom, value=0.5 * (1.0 - beta2) ** 2)
        del denom, diff
    # direction·debias = μ + debias·δ·m, over h + δ; the debias factor is folded into lr and the radius.
    direction = _add(momentum, delta * debias, _slot(scratch, 1), other=means)
    denom = _add(hess, delta, _slot(scratch, 0))
    if clip_radius == float("inf"):
        torch._foreach_addcdiv_(means, direction, denom, value=-lr / debias)
        return
    torch._foreach_div_(direction, denom)
    torch._foreach_clamp_min_(direction, -clip_radius * debias)
    torch._foreach_clamp_max_(direction, clip_radius * debias)
    torch._foreach_add_(means, direction, alpha=-lr / debias)
