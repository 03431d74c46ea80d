"""A float64 re-implementation of IVON (Shen et al., 2024, Alg. 1), written independently for the tests.

Plain per-tensor arithmetic, no foreach, no in-place tricks: the ground truth for the optimizer.
"""

from __future__ import annotations

import math

import torch


def reference_ivon(
    params0,
    loss_fn,
    steps,
    *,
    lr,
    ess,
    hess_init=1.0,
    beta1=0.9,
    beta2=0.99999,
    weight_decay=1e-4,
    mc_samples=1,
    hess_approx="price",
    clip_radius=math.inf,
    rescale_lr=True,
    generator=None,
    masks=None,
    generators=None,
    weights=None,
):
    """Run Alg. 1 for ``steps`` steps from ``params0`` (list of tensors); returns (means, hess) lists.

    Noise: for each sample, for each parameter in order, float32 standard normals drawn with ``generator`` in
    the parameter's shape and rounded to float16 (the construction the optimizer documents), divided by
    ``√(ess·(h+δ))``; entries outside ``masks`` get no noise and keep h. With ``generators``, MC sample ``s``
    draws from ``generators[s]`` (one generator per data-parallel rank). ``weights`` (one per MC sample,
    e.g. batch sizes) weigh the samples' gradients and statistics (Alg. 1 note); default: equal.
    """
    m = [p.detach().to(torch.float64).clone() for p in params0]
    h = [torch.full_like(x, hess_init) for x in m]
    mu = [torch.zeros_like(x) for x in m]
    d = weight_decay
    masks = masks or [None] * len(m)
    weights = [1.0] * mc_samples if weights is None else weights
    for t in range(1, steps + 1):
        gbar = [torch.zeros_like(x) for x in m]
        hhat = [torch.zeros_like(x) for x in m]
        for s in range(mc_samples):
            gen = generator if generators is None else generators[s]
            share = weights[s] / sum(weights)
            eps = []
            for x, hx, mk in zip(m, h, masks, strict=True):
                z = torch.empty(x.shape, dtype=torch.float32, device=x.device).normal_(
                    generator=gen
                )
                e = z.half().to(torch.float64) / math.sqrt(ess) / torch.sqrt(hx + d)
                eps.append(e if mk is None else e * mk)
            w = [(x + e).requires_grad_(True) for x, e in zip(m, eps, strict=True)]
            fn = (
                loss_fn[s] if isinstance(loss_fn, list) else loss_fn
            )  # one loss per MC sample (rank)
            grads = torch.autograd.grad(fn(w), w)
            for i, (g, e) in enumerate(zip(grads, eps, strict=True)):
                gbar[i] += g * share
                if hess_approx == "price":
                    hhat[i] += e * g * ess * (h[i] + d) * share
                else:
                    hhat[i] += g * g * share
        for i in range(len(m)):
            mu[i] = beta1 * mu[i] + (1 - beta1) * gbar[i]
            hh = hhat[i] if masks[i] is None else torch.where(masks[i], hhat[i], h[i])
            h[i] = (
                beta2 * h[i]
                + (1 - beta2) * hh
                + 0.5 * (1 - beta2) ** 2 * (h[i] - hh) ** 2 / (h[i] + d)
            )
            alpha = lr * (hess_init + d) if rescale_lr else lr
            direction = (mu[i] / (1 - beta1**t) + d * m[i]) / (h[i] + d)
            m[i] = m[i] - alpha * direction.clamp(-clip_radius, clip_radius)
    return m, h
