"""Linearised-Laplace predictive: logit means, covariances and samples of ``f(x; θ*) + J(x)(θ − θ*)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.linear_sampling._cg import cg_solve
from partialbayes.linear_sampling._features import Features, batches
from partialbayes.linear_sampling._network import (
    Inputs,
    ParamSpec,
    network_features,
    network_logits,
)
from partialbayes.linear_sampling._ops import (
    check_memory,
    check_samples,
    curvature_matvec,
    default_batch_size,
)
from partialbayes.linear_sampling._precision import NoisePrecision, Prior
from partialbayes.predictive.internal import check_finite, check_labels


def linearised_logit_samples(
    model: nn.Module,
    inputs: Inputs,
    params: ParamSpec,
    samples: Tensor,
    *,
    batch_size: int = 64,
    output_fn: Callable[[Any], Tensor] | None = None,
) -> Tensor:
    """``[k, n, m]`` logit samples ``f(x; θ*) + J(x) z_j`` of the linearised network (the layout ``predictive`` takes).

    ``model`` is at the MAP ``θ*``, in eval mode; ``inputs`` are the ``[n, ...]`` test points (tensor or dict);
    ``params`` are the stochastic parameters (as in
    [`network_features`][partialbayes.linear_sampling.network_features]); ``samples`` are ``[d, k]`` zero-mean
    posterior samples (e.g. [`posterior_samples`][partialbayes.linear_sampling.posterior_samples]);
    ``batch_size`` test points go per JVP call; ``output_fn`` maps the output to logits.

    Raises:
        ValueError: If the samples are not ``[d, k]`` or not finite.
    """
    feats = network_features(model, inputs, params, output_fn=output_fn)
    check_samples(samples, feats.d)
    mean = network_logits(model, inputs, batch_size=batch_size, output_fn=output_fn)
    out = torch.empty(feats.n, feats.m, samples.shape[-1], dtype=mean.dtype, device=mean.device)
    z = samples.to(device=feats.device, dtype=feats.dtype)
    for idx in batches(feats.n, batch_size, feats.device):
        out[idx] = feats.apply(idx, z).to(mean.dtype)
    return (mean.unsqueeze(2) + out).permute(2, 0, 1)


def linearised_logit_moments(
    model: nn.Module,
    inputs: Inputs,
    params: ParamSpec,
    *,
    train_features: Features | None = None,
    noise: NoisePrecision | None = None,
    prior: Prior | None = None,
    samples: Tensor | None = None,
    batch_size: int = 16,
    tol: float = 1e-8,
    output_fn: Callable[[Any], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Logit mean ``f(x; θ*)`` ``[n, m]`` and covariance ``J H⁻¹ Jᵀ`` ``[n, m, m]`` of the linearised network.

    Give either ``samples`` (``[d, k]``; Monte Carlo ``(1/k) Σ_j (J z_j)(J z_j)ᵀ``, ``k`` JVPs per test batch)
    or ``train_features``, ``noise`` and ``prior`` (exact: ``Jᵀ`` by ``m`` VJPs per test point, then CG on
    ``H = ΦᵀBΦ + A`` to ``tol``; for modest numbers of test points). Other arguments as
    [`linearised_logit_samples`][partialbayes.linear_sampling.linearised_logit_samples].

    Raises:
        ValueError: If neither or both ways are given, ``d`` disagrees, or the ``[n, m, m]``
            covariances (and the exact path's identity) would not fit in the free memory.
    """
    exact = train_features is not None or noise is not None or prior is not None
    if exact == (samples is not None) or (
        exact and (train_features is None or noise is None or prior is None)
    ):
        raise ValueError("give either samples, or all of train_features, noise and prior")
    feats = network_features(model, inputs, params, output_fn=output_fn)
    mean = network_logits(model, inputs, batch_size=batch_size, output_fn=output_fn)
    b = 0 if samples is not None else min(batch_size, feats.n)  # the exact path's [b, m, b·m] eye
    floats = (feats.n + b * b) * feats.m**2
    instead = "use linearised_logit_samples, which forms no m x m blocks"
    check_memory(floats * feats.dtype.itemsize, feats.device, "linearised_logit_moments", instead)
    cov = torch.empty(feats.n, feats.m, feats.m, dtype=feats.dtype, device=feats.device)
    if samples is not None:
        check_samples(samples, feats.d)
        z = samples.to(device=feats.device, dtype=feats.dtype)
        for idx in batches(feats.n, batch_size, feats.device):
            jz = feats.apply(idx, z)
            cov[idx] = jz @ jz.transpose(1, 2) / z.shape[1]
        return mean, cov
    assert train_features is not None
    assert noise is not None
    assert prior is not None
    if train_features.d != feats.d:
        raise ValueError(f"train_features have d={train_features.d} but params select d={feats.d}")
    noise.check(train_features.n, train_features.m)
    noise = noise.to(train_features.dtype, train_features.device)
    a = prior.diag(feats.d, train_features.dtype, train_features.device).unsqueeze(1)
    bs = default_batch_size(train_features, None)
    m = feats.m
    for idx in batches(feats.n, batch_size, feats.device):
        b = idx.shape[0]
        eye = torch.eye(b * m, dtype=feats.dtype, device=feats.device).reshape(b, m, b * m)
        jt = feats.apply_t(idx, eye).to(train_features.dtype)  # [d, b·m]
        x = cg_solve(lambda v: curvature_matvec(train_features, noise, v, bs) + a * v, jt, tol)[0]
        block = (jt.T @ x).reshape(b, m, b, m)
        cov[idx] = block[torch.arange(b), :, torch.arange(b), :].to(feats.dtype)
    return mean, cov


def linearised_targets(
    features: Features,
    theta: Tensor,
    logits: Tensor,
    labels: Tensor,
    noise: NoisePrecision,
    *,
    batch_size: int | None = None,
) -> Tensor:
    """``[n, m]`` targets ``Φθ* + B⁻¹(y − p)`` of the linear model that linearised Laplace for classification solves.

    The second-order expansion of the categorical log-likelihood in the logits at the MAP ``θ*`` is a Gaussian
    linear model with noise precision ``B`` (the softmax Hessian) and these pseudo-targets; at a MAP trained
    with the same prior its posterior mean is ``θ*`` itself.
    [`fit_prior_precision`][partialbayes.linear_sampling.fit_prior_precision] uses them to re-estimate ``A``.

    Args:
        features: Training features ``Φ`` at ``θ*`` (``n`` examples, ``m`` classes).
        theta: ``[d]`` the MAP values of the stochastic parameters, flat in the features' order (``subset.gather``
            of each parameter, in ``subset.names`` order).
        logits: ``[n, m]`` logits at ``θ*``.
        labels: ``[n]`` int64 class labels.
        noise: ``B``, a [`softmax_hessian`][partialbayes.linear_sampling.softmax_hessian].
        batch_size: Observations per JVP call.

    Raises:
        ValueError: On shape mismatches, non-finite logits or ``theta``, or labels out of range.
    """
    n, m = features.n, features.m
    if tuple(logits.shape) != (n, m):
        raise ValueError(f"logits have shape {tuple(logits.shape)}, expected (n, m) = ({n}, {m})")
    labels = check_labels("labels", labels, n, m).long()
    check_finite(logits, "logits have non-finite entries")
    if theta.shape != (features.d,) or not bool(torch.isfinite(theta).all()):
        raise ValueError(
            f"theta must be a finite [d] = [{features.d}] tensor, got shape {tuple(theta.shape)}"
        )
    if noise.value.ndim < 2:
        raise ValueError("noise must be a softmax Hessian (softmax_hessian)")
    noise.check(n, m)
    noise = noise.to(features.dtype, features.device)
    theta = theta.to(device=features.device, dtype=features.dtype).reshape(-1, 1)
    grad = torch.nn.functional.one_hot(labels.to(features.device), m).to(features.dtype)
    grad = grad - logits.to(features.device, features.dtype).softmax(-1)
    out = noise.solve(torch.arange(n, device=features.device), grad.unsqueeze(2))[..., 0]
    for idx in batches(n, default_batch_size(features, batch_size), features.device):
        out[idx] += features.apply(idx, theta)[..., 0]
    return out
