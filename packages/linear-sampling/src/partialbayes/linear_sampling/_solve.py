"""Posterior mean and sample-then-optimise posterior samples of the Gaussian linear model."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.linear_sampling._cg import cg_solve, check_options
from partialbayes.linear_sampling._features import Features
from partialbayes.linear_sampling._ops import (
    Problem,
    default_batch_size,
    features_t_noise,
    features_t_noise_sqrt,
    targets_3d,
)
from partialbayes.linear_sampling._precision import NoisePrecision, Prior
from partialbayes.linear_sampling._sgd import SGDConfig, SolveInfo, sgd_minimise
from partialbayes.linear_sampling._svrg import svrg_minimise
from partialbayes.predictive.internal import (
    check_choice,
    check_generator,
    check_int,
    check_tensor,
    check_type,
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


def check_problem(
    features: Features, noise: NoisePrecision, prior: Prior, method: str, sgd: SGDConfig | None
) -> tuple[NoisePrecision, Tensor]:
    """Validate the common arguments; returns the noise on the features' device and ``diag(A)``."""
    check_type("features", features, Features, "Features")
    check_type("noise", noise, NoisePrecision)
    check_type("prior", prior, Prior)
    check_choice("method", method, _METHODS)
    check_type("sgd", sgd, (SGDConfig, type(None)), "an SGDConfig or None")
    if sgd is not None and method != "sgd":
        raise ValueError(
            f"sgd settings were given but method={method!r}: they apply to method='sgd' only"
        )
    noise.check(features.n, features.m)
    noise = noise.to(features.dtype, features.device)
    a = prior.diag(features.d, features.dtype, features.device)
    return noise, a


def _lr(problem: Problem, batch_size: int, config: SGDConfig, generator) -> float:
    """``config.lr``, else ``lr_scale / λ̂`` (``λ̂``: 20 power steps on minibatch curvatures)."""
    if config.lr is not None:
        return config.lr
    f = problem.features
    v = torch.randn(f.d, 1, generator=generator, dtype=f.dtype).to(f.device)
    v, lam = v / v.norm(), 0.0
    for _ in range(20):
        idx = torch.randperm(f.n, generator=generator)[:batch_size].to(f.device)
        hv = problem.batch_matvec(v, idx)
        lam, norm = max(lam, float((v * hv).sum())), hv.norm()
        if not bool(norm > 0):
            break
        v = hv / norm
    return config.lr_scale / lam


def _minimise(
    problem: Problem,
    grad_fn: Callable[[Tensor, Tensor], Tensor],
    x0: Tensor | None,
    method: str,
    tol: float,
    max_iter: int | None,
    sgd: SGDConfig | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, SolveInfo]:
    features = problem.features
    if method == "cg":
        x, iters, res = cg_solve(problem.matvec, problem.c, tol, max_iter, x0)
        converged = bool((res <= tol).all())
        return x, SolveInfo(
            "cg", iters, converged, history=[{"step": iters, "residual": float(res.max())}]
        )
    x0 = torch.zeros_like(problem.c) if x0 is None else x0
    config = sgd or SGDConfig(batch_size=problem.batch_size)
    b = default_batch_size(features, config.batch_size, problem.c.shape[1])
    if config.variance_reduction:
        per_step = math.ceil(features.n / math.ceil(features.n / b))  # equal-sized batches
        lr = _lr(problem, per_step, config, generator)
        return svrg_minimise(problem, x0, b, config, lr, config.lr is None, generator)
    lr = _lr(problem, b, config, generator)
    return sgd_minimise(problem, grad_fn, x0, b, config, lr, generator)


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
        method: ``"cg"`` (conjugate gradients, full-data products) or ``"sgd"`` (minibatch steps, see
            [`SGDConfig`][partialbayes.linear_sampling.SGDConfig]; one epoch costs ``O(n·d)``).
        tol: CG relative residual tolerance (SGD uses ``sgd.tol``, a bound on the relative error).
        max_iter: CG iteration cap (default ``d``).
        sgd: SGD settings (default ``SGDConfig()``); an error with ``method="cg"``.
        batch_size: Observations per operator call for CG, and the SGD batch size when ``sgd`` is None.
        generator: CPU generator for the SGD minibatch order.
        init: Warm start ``[d]`` for either method (default zeros, the prior mean).

    Returns:
        The mean and solver information (``info.converged`` says whether the tolerance was met).

    Raises:
        ValueError: On shape mismatches, non-finite inputs, ``sgd`` settings with ``method="cg"``, or
            divergence ([`DivergenceError`][partialbayes.linear_sampling.DivergenceError]).
        TypeError: If an argument has the wrong type.
    """
    noise, a = check_problem(features, noise, prior, method, sgd)
    check_options(tol, max_iter)
    check_generator(generator)
    y = targets_3d(features, targets)
    bs = default_batch_size(features, batch_size)
    x0 = _initial_mean(features, init)
    a1 = a[:, None]
    problem = Problem(features, noise, a, features_t_noise(features, noise, y, bs), bs)

    def grad_fn(x: Tensor, idx: Tensor) -> Tensor:
        r = features.apply(idx, x) - y[idx]
        return (features.n / idx.shape[0]) * features.apply_t(idx, noise.apply(idx, r)) + a1 * x

    x, info = _minimise(problem, grad_fn, x0, method, tol, max_iter, sgd, generator)
    return PosteriorMean(x[:, 0], _warn_unconverged("posterior_mean", info))


def _initial_mean(features: Features, init: Tensor | None) -> Tensor | None:
    if init is None:
        return None
    check_tensor("init", init, what=f"a floating tensor of shape [{features.d}] or None")
    if tuple(init.shape) not in ((features.d,), (features.d, 1)):
        raise ValueError(
            f"init has shape {tuple(init.shape)} but the features expect [d] = [{features.d}]"
        )
    return init.reshape(features.d, 1).to(device=features.device, dtype=features.dtype)


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

    Both objectives (the concept page derives them) have the minimiser ``H⁻¹(Aθ⁰ + ΦᵀB^½ε)`` with
    ``θ⁰ ~ N(0, A⁻¹)``, ``ε ~ N(0, I)``; they differ only for plain SGD, where ``"low_variance"`` has less
    noisy minibatch gradients. Every solver starts at ``θ⁰``.

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
        sgd: SGD settings (default ``SGDConfig()``); an error with ``method="cg"``.
        batch_size: Observations per operator call (CG) / SGD batch size when ``sgd`` is None.
        generator: CPU generator for ``θ⁰``, ``ε`` and the minibatch order.

    Returns:
        The samples and solver information (``info.converged`` says whether the tolerance was met).

    Raises:
        ValueError: On bad arguments, ``sgd`` settings with ``method="cg"``, or divergence.
        TypeError: If an argument has the wrong type.
    """
    noise, a = check_problem(features, noise, prior, method, sgd)
    check_options(tol, max_iter)
    check_generator(generator)
    check_choice("objective", objective, _OBJECTIVES)
    check_int("k", k)
    bs = default_batch_size(features, batch_size, k)
    a1 = a.unsqueeze(1)
    theta0 = torch.randn(features.d, k, generator=generator, dtype=features.dtype)
    theta0 = theta0.to(features.device) / a1.sqrt()
    plain = method == "sgd" and not (sgd or SGDConfig()).variance_reduction
    keep = objective == "standard" and plain  # only plain SGD reads ε again
    proj, eps = features_t_noise_sqrt(features, noise, k, bs, generator, keep=keep)
    theta_n = theta0 + proj / a1
    problem = Problem(features, noise, a, a1 * theta_n, bs)

    def low_variance(z: Tensor, idx: Tensor) -> Tensor:
        return problem.data_batch(idx, z) + a1 * (z - theta_n)

    def standard(z: Tensor, idx: Tensor) -> Tensor:
        assert eps is not None
        r = features.apply(idx, z) - noise.apply_inv_sqrt_t(idx, eps[idx])
        scale = features.n / idx.shape[0]
        return scale * features.apply_t(idx, noise.apply(idx, r)) + a1 * (z - theta0)

    grad_fn = low_variance if objective == "low_variance" else standard
    z, info = _minimise(problem, grad_fn, theta0, method, tol, max_iter, sgd, generator)
    return PosteriorSamples(z, _warn_unconverged("posterior_samples", info))


def _warn_unconverged(name: str, info: SolveInfo) -> SolveInfo:
    """``info``, after a ``RuntimeWarning`` when its solver stopped short of its tolerance."""
    if not info.converged:
        last = info.history[-1] if info.history else {}
        warnings.warn(
            f"{name}: the {info.method} solver stopped after {info.steps} steps without reaching its "
            f"tolerance ({last}); the result is approximate (a sample variance can be several times "
            "off): raise max_iter or sgd=SGDConfig(max_epochs=...), loosen tol, or use method='cg'",
            RuntimeWarning,
            stacklevel=3,
        )
    return info
