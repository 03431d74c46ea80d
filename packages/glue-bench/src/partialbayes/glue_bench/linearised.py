"""Sampling-based linearised Laplace (Antorán et al., ICLR 2023) on a weight subset of the fine-tuned model.

Built on ``partialbayes.linear_sampling``; the how-to's "Sampling-based linearised Laplace" section gives the
model, the EM for the prior precision and why the training Jacobian is computed densely
(:func:`dense_jacobians`) when it fits in ``dense_max_floats``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from partialbayes.curvature import logit_jacobians
from partialbayes.linear_sampling import (
    Features,
    Prior,
    effective_dimension,
    linearised_logit_samples,
    linearised_targets,
    loader_features,
    mackay_update,
    network_logits,
    posterior_mean,
    posterior_samples,
    softmax_hessian,
)
from partialbayes.linear_sampling.internal import network_parameters
from partialbayes.predictive.internal import check_fields, ranged
from partialbayes.selection import Subset

Batch = Mapping[str, Tensor]
# The stochastic parameters, as ``linear_sampling`` takes them: a Subset, names, or ``{name: bool mask}``.
Params: TypeAlias = Subset | Sequence[str] | Mapping[str, Tensor]


@dataclass(frozen=True)
class LinearSamplingConfig:
    """Settings of the sampling-based linearised Laplace methods.

    Attributes:
        k: Posterior samples per EM step (effective-dimension estimate).
        em_iters: EM iterations at most (stops earlier when ``α`` changes by less than ``em_tol``).
        em_tol: Relative change of ``α`` that ends EM; ``α`` fluctuates by about ``sqrt(2 / k)``.
        samples: Fresh posterior samples under the final prior for the predictive.
        cg_iters: Conjugate-gradient iterations at most per solve.
        cg_tol: Relative residual tolerance of conjugate gradients.
        alpha0: Initial prior precision.
        jitter: Added to the softmax Hessian's diagonal (it is singular along the all-ones direction).
        dense_max_floats: Materialise the training Jacobian ``Φ`` (``n·m·d`` floats) when it has at most
            this many entries and the subset is Kronecker-structured: per-example Jacobians from one
            backward pass per class (``curvature.logit_jacobians``), then every product is a matmul. Larger
            problems use ``linear_sampling.loader_features`` (a forward-mode JVP per column, much slower on
            Hugging Face models, but memory ``O(d·k)``); ``0`` always uses the operators. Test batches follow
            the same rule per batch.
    """

    k: int = ranged(8, "[1, inf)", int)
    em_iters: int = ranged(10, "[1, inf)", int)
    em_tol: float = ranged(0.1, "(0, inf)")
    samples: int = ranged(16, "[1, inf)", int)
    cg_iters: int = ranged(50, "[1, inf)", int)
    cg_tol: float = ranged(1e-3, "(0, inf)")
    alpha0: float = ranged(1.0, "(0, inf)")
    jitter: float = ranged(1e-4, "(0, inf)")
    dense_max_floats: int = ranged(50_000_000, "[0, inf)", int)

    def __post_init__(self) -> None:
        check_fields(self)


def dense_jacobians(model: nn.Module, batch: Batch, subset: Subset) -> tuple[Tensor, Tensor]:
    """Logits ``[b, m]`` and per-example logit Jacobians ``[b, m, d]`` in a Kronecker ``subset``.

    The dense ``Φ`` of ``network_features(model, batch, subset)`` (same column order), one backward pass per class.
    """
    logits, jac = logit_jacobians(model, batch, subset)
    owner = {}
    for mod in subset.kron_modules().values():
        owner[mod.weight_name] = ("weight", mod)
        if mod.bias_name is not None:
            owner[mod.bias_name] = ("bias", mod)
    parts = []
    for name in subset.names:
        role, mod = owner[name]
        j = jac[mod.module_name]  # [b, m, r, c (+1: the bias column last)]
        n_cols = j.shape[-1] - (1 if mod.bias_name is not None else 0)
        if role == "bias":
            parts.append(j[..., n_cols])
        else:
            w = j[..., :n_cols]
            if mod.transposed:  # Conv1D stores (n_in x n_out): row-major over the storage mask
                w = w.transpose(-1, -2)
            parts.append(w.reshape(*w.shape[:2], -1))
    return logits.detach(), torch.cat(parts, -1)


@dataclass
class LinearisedPosterior:
    """A fitted sampling-based linearised Laplace posterior on a subset.

    ``samples``: ``[d, K]`` zero-mean posterior samples ``z_j ~ N(0, H⁻¹)`` under the prior precision
    ``alpha``; ``history``: one entry per EM iteration (``alpha``, ``gamma``, ``change``, CG iterations);
    ``converged``: EM stopped on ``em_tol``; ``cg_converged``: every CG solve met ``cg_tol``.
    """

    alpha: float
    samples: Tensor
    history: list[dict[str, Any]]
    converged: bool
    cg_converged: bool


def fit_linearised(
    model: nn.Module,
    train: Sequence[Batch],
    params: Params,
    config: LinearSamplingConfig,
    generator: torch.Generator,
) -> LinearisedPosterior:
    """EM for the prior precision (MacKay updates), then fresh posterior samples (eval mode).

    As ``linear_sampling.fit_prior_precision``, but with the conjugate-gradient iterations capped (``cg_iters``).
    """
    theta = network_parameters(model, params)
    n, d = sum(int(b["labels"].shape[0]) for b in train), theta.shape[0]
    m = network_logits(model, {k: v[:1] for k, v in train[0].items()}).shape[1]
    if isinstance(params, Subset) and params.is_kronecker and n * m * d <= config.dense_max_floats:
        pairs = [dense_jacobians(model, b, params) for b in train]
        logits = torch.cat([p[0] for p in pairs])
        feats = Features.dense(torch.cat([p[1] for p in pairs]).to(theta.dtype))
        del pairs
    else:
        logits = torch.cat([network_logits(model, b) for b in train])
        feats = loader_features(model, train, params)
    logits = logits.to(feats.dtype)
    labels = torch.cat([b["labels"] for b in train]).to(logits.device)
    noise = softmax_hessian(logits.double(), jitter=config.jitter).to(feats.dtype, feats.device)
    bs = max(int(b["labels"].shape[0]) for b in train)  # one operator call per batch
    targets = linearised_targets(feats, theta, logits, labels, noise, batch_size=bs)
    solve: dict[str, Any] = {"method": "cg", "tol": config.cg_tol, "max_iter": config.cg_iters}
    solve["batch_size"] = bs
    prior = Prior(torch.tensor(float(config.alpha0)))
    history: list[dict[str, Any]] = []
    converged, cg_ok = False, True
    for _ in range(config.em_iters):
        mean = posterior_mean(feats, targets, noise, prior, **solve)
        draws = posterior_samples(feats, noise, prior, config.k, generator=generator, **solve)
        gamma = effective_dimension(feats, noise, prior, draws.samples, batch_size=bs)
        new = mackay_update(mean.mean, gamma, prior)
        change = float(abs(new.alpha - prior.alpha) / prior.alpha)
        cg_ok = cg_ok and mean.info.converged and draws.info.converged
        step = {"alpha": float(new.alpha), "gamma": float(gamma.sum()), "change": change}
        history.append(
            {**step, "cg_iters_mean": mean.info.steps, "cg_iters_samples": draws.info.steps}
        )
        prior = new
        if change < config.em_tol:
            converged = True
            break
    final = posterior_samples(feats, noise, prior, config.samples, generator=generator, **solve)
    cg_ok = cg_ok and final.info.converged
    return LinearisedPosterior(float(prior.alpha), final.samples, history, converged, cg_ok)


def linearised_probs(
    model: nn.Module,
    batches: Sequence[Batch],
    params: Params,
    samples: Tensor,
    dense_max_floats: int = 0,
) -> Tensor:
    """(N, C) float64 predictive ``(1/K) Σ_j softmax(f(x; θ*) + J(x) z_j)`` over ``batches``.

    ``samples``: ``[d, K]``; a batch within ``dense_max_floats`` (Kronecker subsets) uses :func:`dense_jacobians`.
    """
    out, d = [], samples.shape[0]
    for b in batches:
        inputs = {k: v for k, v in b.items() if k != "labels"}
        n = next(iter(inputs.values())).shape[0]
        m = network_logits(model, {k: v[:1] for k, v in inputs.items()}).shape[1]
        if isinstance(params, Subset) and params.is_kronecker and n * m * d <= dense_max_floats:
            mean, jac = dense_jacobians(model, b, params)
            z = samples.to(device=jac.device, dtype=jac.dtype)
            logits = mean.unsqueeze(0) + torch.einsum("nmd,dk->knm", jac, z).to(mean.dtype)
        else:
            logits = linearised_logit_samples(model, inputs, params, samples, batch_size=n)
        out.append(torch.softmax(logits.double(), -1).mean(0).cpu())
    return torch.cat(out)
