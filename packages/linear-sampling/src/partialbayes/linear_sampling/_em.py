"""EM / MacKay updates of the prior precision with sample-based effective dimensions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from partialbayes.linear_sampling._features import Features, batches, scale_features
from partialbayes.linear_sampling._ops import (
    check_samples,
    curvature_matvec,
    default_batch_size,
    targets_3d,
)
from partialbayes.linear_sampling._precision import NoisePrecision, Prior
from partialbayes.linear_sampling._sgd import SGDConfig
from partialbayes.linear_sampling._solve import check_problem, posterior_mean, posterior_samples
from partialbayes.predictive.internal import (
    check_bool,
    check_choice,
    check_finite,
    check_generator,
    check_int,
    check_number,
)

_ESTIMATORS = ("function", "weight")


def _group_sum(values: Tensor, groups: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, groups, values
    )


def effective_dimension(
    features: Features,
    noise: NoisePrecision,
    prior: Prior,
    samples: Tensor,
    *,
    estimator: str = "function",
    batch_size: int | None = None,
) -> Tensor:
    """Sample estimate of the effective dimension ``γ_g = Tr_g(H⁻¹ΦᵀBΦ) = d_g − α_g Tr_g(H⁻¹)`` per group, ``[G]``.

    With ``z_j ~ N(0, H⁻¹)`` (``samples`` ``[d, k]``): ``"function"`` estimates
    ``γ_g ≈ (1/k) Σ_j z_{j,g}ᵀ (ΦᵀBΦ z_j)_g`` (one pass over the data), ``"weight"`` estimates
    ``γ_g ≈ d_g − α_g (1/k) Σ_j ‖z_{j,g}‖²`` (free, noisier when ``γ_g ≪ d_g``); both are unbiased. The groups
    are ``prior``'s; ``batch_size`` observations go per operator call.

    Raises:
        ValueError: On an unknown estimator, a shape mismatch or non-finite samples.
    """
    check_choice("estimator", estimator, _ESTIMATORS)
    check_samples(samples, features.d)
    groups = prior.group_index(features.d, features.device)
    n_groups = prior.n_groups
    k = samples.shape[1]
    if estimator == "function":
        noise.check(features.n, features.m)
        noise = noise.to(features.dtype, features.device)
        hz = curvature_matvec(features, noise, samples, default_batch_size(features, batch_size, k))
        return _group_sum((samples * hz).sum(1) / k, groups, n_groups)
    a = prior.diag(features.d, features.dtype, features.device)
    sizes = _group_sum(torch.ones_like(a), groups, n_groups)
    return sizes - _group_sum(a * (samples * samples).sum(1) / k, groups, n_groups)


def mackay_update(mean: Tensor, gamma: Tensor, prior: Prior) -> Prior:
    """MacKay's fixed-point update ``α_g ← γ_g / ‖θ̄_g‖²`` (a stationary point of the evidence): the new `Prior`.

    Raises:
        ValueError: If ``mean`` ``[d]`` or ``gamma`` ``[G]`` is not finite, a group has ``γ_g ≤ 0`` (too
            few samples for the weight-space estimate) or a zero mean.
    """
    check_finite(mean, "mean has non-finite entries")
    check_finite(gamma, "gamma has non-finite entries")
    groups = prior.group_index(mean.shape[0], mean.device)
    norms = _group_sum(mean * mean, groups, prior.n_groups)
    gamma = gamma.to(norms)
    if gamma.shape != norms.shape:
        raise ValueError(f"gamma has shape {tuple(gamma.shape)}, the prior {prior.n_groups} groups")
    for g in range(prior.n_groups):
        if not float(gamma[g]) > 0:
            raise ValueError(
                f"effective dimension of group {g} is {float(gamma[g]):.3g} <= 0: draw more samples "
                "(k) or use estimator='function'"
            )
        if not float(norms[g]) > 0:
            raise ValueError(f"posterior mean of group {g} is zero: the MacKay update is undefined")
    alpha = (gamma / norms).to(prior.alpha.dtype).cpu()
    return Prior(alpha.reshape(prior.alpha.shape), prior.groups)


def feature_scales(
    features: Features,
    noise: NoisePrecision,
    *,
    n_probes: int = 64,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """g-prior scales ``s_i = sqrt((ΦᵀBΦ)_ii)`` ``[d]``: exact for dense features, else a Rademacher-probe estimate."""
    check_generator(generator)
    check_int("n_probes", n_probes)
    noise.check(features.n, features.m)
    noise = noise.to(features.dtype, features.device)
    if features.matrix is not None:
        phi = features.matrix
        idx = torch.arange(features.n, device=features.device)
        diag = (phi * noise.apply(idx, phi)).sum((0, 1))
    else:
        bs = default_batch_size(features, batch_size, n_probes)
        diag = torch.zeros(features.d, dtype=features.dtype, device=features.device)
        for idx in batches(features.n, bs, features.device):
            e = torch.randint(0, 2, (idx.shape[0], features.m, n_probes), generator=generator)
            e = (2 * e - 1).to(features.dtype).to(features.device)
            proj = features.apply_t(idx, noise.apply_sqrt(idx, e))
            diag += (proj * proj).mean(1)
    if not bool((diag > 0).all()):
        bad = (diag <= 0).nonzero().flatten()[:5].tolist()
        raise ValueError(f"parameters {bad} have zero curvature: a g-prior needs every feature")
    return diag.sqrt()


@dataclass
class EMResult:
    """Result of [`fit_prior_precision`][partialbayes.linear_sampling.fit_prior_precision].

    Attributes:
        prior: Final prior. With ``g_prior=True`` it acts on the normalised parameters ``θ' = s ⊙ θ``;
            the prior precision of ``θ`` is then ``precision_diag``.
        precision_diag: ``[d]`` diagonal of the prior precision ``A`` of the original parameters.
        mean: ``[d]`` posterior mean under the final prior (original parameters).
        samples: ``[d, k]`` zero-mean posterior samples from the last E-step (original parameters).
        scale: ``[d]`` g-prior scales ``s``, or ``None``.
        converged: Whether the relative change of ``α`` fell below ``tol``.
        history: One entry per iteration: ``alpha`` and ``gamma`` (lists) and ``change``.
    """

    prior: Prior
    precision_diag: Tensor
    mean: Tensor
    samples: Tensor
    scale: Tensor | None
    converged: bool
    history: list[dict] = field(default_factory=list)


def fit_prior_precision(
    features: Features,
    targets: Tensor,
    noise: NoisePrecision,
    prior: Prior,
    *,
    k: int = 16,
    estimator: str = "function",
    method: str = "cg",
    sgd: SGDConfig | None = None,
    tol: float = 1e-2,
    max_iter: int = 20,
    g_prior: bool = False,
    solver_tol: float = 1e-8,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> EMResult:
    """EM for the prior precision: E-step posterior mean and ``k`` samples, M-step MacKay update.

    Each iteration solves for ``θ̄``, draws ``z_j ~ N(0, H⁻¹)`` (low-variance sample-then-optimise), estimates
    ``γ_g`` and sets ``α_g ← γ_g / ‖θ̄_g‖²``, until ``max_g |Δα_g| / α_g < tol``. ``α`` fluctuates by about
    ``sqrt(2 / k)`` relative: pick ``tol`` above that.

    Args:
        features: Features ``Φ``.
        targets: ``[n]`` or ``[n, m]``.
        noise: Noise precision ``B``.
        prior: Initial prior (scalar or per-group ``α``).
        k: Samples per E-step.
        estimator: ``"function"`` or ``"weight"`` (see
            [`effective_dimension`][partialbayes.linear_sampling.effective_dimension]).
        method: Solver for the mean and the samples, ``"cg"`` or ``"sgd"``.
        sgd: SGD settings (``method="sgd"`` only; an error otherwise).
        tol: Relative tolerance on ``α``.
        max_iter: Iteration cap.
        g_prior: Normalise the features to unit curvature first (``Φ' = Φ diag(1/s)``,
            ``s_i² = (ΦᵀBΦ)_ii``) and place the prior on the normalised parameters.
        solver_tol: CG tolerance.
        batch_size: Observations per operator call.
        generator: CPU generator.

    Raises:
        ValueError: On bad arguments (``sgd`` settings with ``method="cg"`` among them) or divergence.
        TypeError: If an argument has the wrong type.
    """
    check_choice("estimator", estimator, _ESTIMATORS)
    check_problem(features, noise, prior, method, sgd)
    check_generator(generator)
    check_int("k", k)
    check_int("max_iter", max_iter)
    check_number("tol", tol)
    check_bool("g_prior", g_prior)
    targets_3d(features, targets)  # validate early
    scale = (
        feature_scales(features, noise, batch_size=batch_size, generator=generator)
        if g_prior
        else None
    )
    feats = features if scale is None else scale_features(features, scale)
    history: list[dict] = []
    converged = False
    kw: dict[str, Any] = {
        "sgd": sgd,
        "batch_size": batch_size,
        "generator": generator,
        "tol": solver_tol,
    }
    mean: Tensor | None = None
    samples: Tensor | None = None
    for _ in range(max_iter):
        init = None if mean is None or method == "cg" else mean
        mean = posterior_mean(feats, targets, noise, prior, method=method, init=init, **kw).mean
        samples = posterior_samples(feats, noise, prior, k, method=method, **kw).samples
        gamma = effective_dimension(
            feats, noise, prior, samples, estimator=estimator, batch_size=batch_size
        )
        new = mackay_update(mean, gamma, prior)
        change = float(((new.alpha - prior.alpha).abs() / prior.alpha).max())
        history.append(
            {"alpha": new.alpha.reshape(-1).tolist(), "gamma": gamma.tolist(), "change": change}
        )
        prior = new
        if change < tol:
            converged = True
            break
    mean = posterior_mean(
        feats, targets, noise, prior, method=method, init=None if method == "cg" else mean, **kw
    ).mean
    a = prior.diag(features.d, features.dtype, features.device)
    assert samples is not None
    if scale is not None:
        mean, samples, a = mean / scale, samples / scale.unsqueeze(1), a * scale**2
    return EMResult(prior, a, mean, samples, scale, converged, history)
