"""Posterior mean and sample-then-optimise posterior samples of the Gaussian linear model.

Model: ``y_n = Φ_n θ + η_n``, ``θ ~ N(0, A⁻¹)``, ``η_n ~ N(0, B_n⁻¹)``. Posterior precision
``H = ΦᵀBΦ + A``, mean ``θ̄ = H⁻¹ΦᵀBY``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.linear_sampling._cg import cg_solve
from partialbayes.linear_sampling._features import Features
from partialbayes.linear_sampling._ops import (
    curvature_matvec,
    default_batch_size,
    features_t_noise,
    features_t_noise_sqrt,
    targets_3d,
)
from partialbayes.linear_sampling._precision import NoisePrecision, Prior
from partialbayes.linear_sampling._sgd import (
    SGDConfig,
    SolveInfo,
    power_max_eigenvalue,
    sgd_minimise,
)

_METHODS = ("cg", "sgd")
_OBJECTIVES = ("low_variance", "standard")


@dataclass(frozen=True)
class PosteriorMean:
    """Result of [`posterior_mean`][partialbayes.linear_sampling.posterior_mean].

    Attributes:
        mean: ``[d]`` posterior mean ``θ̄ = H⁻¹ΦᵀBY``.
        info: What the solver did.
    """

    mean: Tensor
    info: SolveInfo


@dataclass(frozen=True)
class PosteriorSamples:
    """Result of [`posterior_samples`][partialbayes.linear_sampling.posterior_samples].

    Attributes:
        samples: ``[d, k]`` zero-mean samples ``z_j ~ N(0, H⁻¹)``; add the posterior mean to get
            posterior samples of ``θ``.
        info: What the solver did.
    """

    samples: Tensor
    info: SolveInfo


def _check(features: Features, noise: NoisePrecision, prior: Prior, method: str) -> tuple:
    if not isinstance(features, Features):
        raise TypeError(f"features must be Features, got {type(features).__name__}")
    if not isinstance(noise, NoisePrecision):
        raise TypeError(f"noise must be a NoisePrecision, got {type(noise).__name__}")
    if not isinstance(prior, Prior):
        raise TypeError(f"prior must be a Prior, got {type(prior).__name__}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    noise.check(features.n, features.m)
    noise = noise.to(features.dtype, features.device)
    a = prior.diag(features.d, features.dtype, features.device)
    return noise, a


def _lr(features, noise, a, batch_size, config, generator) -> float:
    if config.lr is not None:
        return config.lr
    scale = features.n / batch_size

    def matvec(v: Tensor, _: int) -> Tensor:
        idx = torch.randperm(features.n, generator=generator)[:batch_size].to(features.device)
        hv = features.apply_t(idx, noise.apply(idx, features.apply(idx, v)))
        return scale * hv + a.unsqueeze(1) * v

    lam = power_max_eigenvalue(matvec, features.d, features.dtype, features.device, 20, generator)
    return config.lr_scale / lam


def _minimise(
    features, noise, a, rhs, grad_fn, method, tol, max_iter, sgd, batch_size, generator, init
) -> tuple[Tensor, SolveInfo]:
    if method == "cg":
        x, iters, res = cg_solve(
            lambda v: curvature_matvec(features, noise, v, batch_size) + a.unsqueeze(1) * v,
            rhs,
            tol,
            max_iter,
            init,
        )
        converged = bool((res <= tol).all())
        return x, SolveInfo(
            "cg", iters, converged, history=[{"step": iters, "residual": float(res.max())}]
        )
    config = sgd or SGDConfig()
    b = default_batch_size(features, config.batch_size if sgd is not None else batch_size)
    lr = _lr(features, noise, a, b, config, generator)
    x0 = torch.zeros_like(rhs) if init is None else init.to(rhs)
    return sgd_minimise(grad_fn(b), x0, features.n, b, config, lr, generator)


def posterior_mean(
    features: Features,
    targets: Tensor,
    noise: NoisePrecision,
    prior: Prior,
    *,
    method: str = "cg",
    tol: float = 1e-8,
    max_iter: int | None = None,
    sgd: SGDConfig | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    init: Tensor | None = None,
) -> PosteriorMean:
    """Posterior mean ``θ̄ = H⁻¹ΦᵀBY``, the minimiser of ``½‖Y − Φθ‖²_B + ½‖θ‖²_A``.

    Args:
        features: Features ``Φ`` (``n`` observations, ``m`` outputs, ``d`` parameters).
        targets: ``[n]`` (when ``m = 1``) or ``[n, m]``.
        noise: Noise precision ``B``.
        prior: Prior precision ``A``.
        method: ``"cg"`` (conjugate gradients, full-data products; for moderate sizes) or ``"sgd"``
            (minibatch Nesterov SGD with Polyak averaging; one epoch costs ``O(n·d)``).
        tol: CG relative residual tolerance (SGD uses ``sgd.tol``).
        max_iter: CG iteration cap (default ``d``).
        sgd: SGD settings (default ``SGDConfig()``).
        batch_size: Observations per operator call for CG, and the SGD batch size when ``sgd`` is None.
        generator: CPU generator for the SGD minibatch order.
        init: Warm start ``[d]``.

    Returns:
        The mean and solver information.

    Raises:
        ValueError: On shape mismatches, non-finite inputs, or divergence
            ([`DivergenceError`][partialbayes.linear_sampling.DivergenceError]).
        TypeError: If an argument has the wrong type.
    """
    noise, a = _check(features, noise, prior, method)
    y = targets_3d(features, targets)
    bs = default_batch_size(features, batch_size)

    def grad_fn(b: int):
        scale = features.n / b

        def fn(x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            r = features.apply(idx, x) - y[idx]
            br = noise.apply(idx, r)
            grad = scale * features.apply_t(idx, br) + a.unsqueeze(1) * x
            obj = 0.5 * scale * (r * br).sum((0, 1)) + 0.5 * (a.unsqueeze(1) * x * x).sum(0)
            return grad, obj

        return fn

    rhs = (
        features_t_noise(features, noise, y, bs)
        if method == "cg"
        else torch.zeros(features.d, 1, dtype=features.dtype, device=features.device)
    )
    x0 = None if init is None else init.reshape(features.d, 1).to(rhs)
    x, info = _minimise(
        features, noise, a, rhs, grad_fn, method, tol, max_iter, sgd, bs, generator, x0
    )
    return PosteriorMean(x[:, 0], info)


def posterior_samples(
    features: Features,
    noise: NoisePrecision,
    prior: Prior,
    k: int,
    *,
    method: str = "sgd",
    objective: str = "low_variance",
    tol: float = 1e-8,
    max_iter: int | None = None,
    sgd: SGDConfig | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> PosteriorSamples:
    """``k`` zero-mean posterior samples ``z_j ~ N(0, H⁻¹)`` by sample-then-optimise, jointly.

    With ``θ⁰ ~ N(0, A⁻¹)`` and ``ε ~ N(0, I)`` (one ``m``-vector per observation), the low-variance
    objective ``½ Σ_n ‖Φ_n z‖²_{B_n} + ½ ‖z − θⁿ‖²_A`` with ``θⁿ = θ⁰ + A⁻¹ Φᵀ B^½ ε`` has the minimiser
    ``H⁻¹(Aθ⁰ + ΦᵀB^½ε)``, exactly ``N(0, H⁻¹)``. The standard objective
    ``½ Σ_n ‖Φ_n z − B_n^{-½ᵀ} ε_n‖²_{B_n} + ½ ‖z − θ⁰‖²_A`` has the same minimiser, but its
    minibatch gradients are noisier near the optimum (the noise targets enter every step).

    Args:
        features: Features ``Φ``.
        noise: Noise precision ``B``.
        prior: Prior precision ``A``.
        k: Number of samples, optimised jointly (memory ``O(d·k)``; the standard objective also keeps
            ``ε``, ``O(n·m·k)``).
        method: ``"sgd"`` (default) or ``"cg"``.
        objective: ``"low_variance"`` (default) or ``"standard"``.
        tol: CG relative residual tolerance.
        max_iter: CG iteration cap.
        sgd: SGD settings.
        batch_size: Observations per operator call (CG) / SGD batch size when ``sgd`` is None.
        generator: CPU generator for ``θ⁰``, ``ε`` and the minibatch order.

    Returns:
        The samples and solver information.

    Raises:
        ValueError: On bad arguments or divergence.
        TypeError: If an argument has the wrong type.
    """
    noise, a = _check(features, noise, prior, method)
    if objective not in _OBJECTIVES:
        raise ValueError(f"objective must be one of {_OBJECTIVES}, got {objective!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    bs = default_batch_size(features, batch_size)
    a1 = a.unsqueeze(1)
    theta0 = torch.randn(features.d, k, generator=generator, dtype=features.dtype)
    theta0 = theta0.to(features.device) / a1.sqrt()
    keep = objective == "standard" and method == "sgd"
    proj, eps = features_t_noise_sqrt(features, noise, k, bs, generator, keep=keep)
    theta_n = theta0 + proj / a1
    rhs = a1 * theta_n

    def grad_fn(b: int):
        scale = features.n / b

        def low_variance(z: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            fz = features.apply(idx, z)
            bfz = noise.apply(idx, fz)
            diff = z - theta_n
            grad = scale * features.apply_t(idx, bfz) + a1 * diff
            obj = 0.5 * scale * (fz * bfz).sum((0, 1)) + 0.5 * (a1 * diff * diff).sum(0)
            return grad, obj

        def standard(z: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            assert eps is not None
            r = features.apply(idx, z) - noise.apply_inv_sqrt_t(idx, eps[idx])
            br = noise.apply(idx, r)
            diff = z - theta0
            grad = scale * features.apply_t(idx, br) + a1 * diff
            obj = 0.5 * scale * (r * br).sum((0, 1)) + 0.5 * (a1 * diff * diff).sum(0)
            return grad, obj

        return low_variance if objective == "low_variance" else standard

    z, info = _minimise(
        features, noise, a, rhs, grad_fn, method, tol, max_iter, sgd, bs, generator, None
    )
    return PosteriorSamples(z, info)
