"""Predictives from samples and the total / aleatoric / epistemic uncertainty decomposition."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.predictive._validate import (
    PROB_ATOL,
    check_broadcasts,
    check_int,
    check_nonneg,
    check_same_device,
    check_tensor,
)


@dataclass(frozen=True)
class Uncertainty:
    """Per-example uncertainty decomposition, ``total = aleatoric + epistemic``.

    Classification (nats): ``total`` is the entropy of the mean prediction, ``aleatoric`` the mean
    entropy of the sampled predictions and ``epistemic`` their mutual information with the
    parameters. Regression: the law of total variance (mean of the variances plus the variance of
    the means).

    Attributes:
        total: ``[B]`` (or the batch shape).
        aleatoric: Same shape.
        epistemic: Same shape, ``≥ 0``.
    """

    total: Tensor
    aleatoric: Tensor
    epistemic: Tensor


def entropy(log_probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy (nats) of categorical distributions given as log-probabilities along ``dim`` (removed).

    ``-inf`` entries contribute 0.

    Raises:
        TypeError: If ``log_probs`` is not a floating tensor.
        ValueError: If it holds NaN or ``+inf``, or its rows are not normalised (``logsumexp`` must be 0;
            probabilities passed by mistake are always caught).
    """
    check_tensor("log_probs", log_probs, finite=False, what="a floating-point torch.Tensor")
    if bool(torch.isnan(log_probs).any()) or bool((log_probs == math.inf).any()):
        raise ValueError("log_probs contains NaN or +inf")
    check_int("dim", dim, f"[{-log_probs.ndim}, {max(log_probs.ndim, 1)})")
    if log_probs.numel():
        work = torch.promote_types(log_probs.dtype, torch.float32)
        norm = torch.logsumexp(log_probs.to(work), dim).abs().amax()
        tol = max(PROB_ATOL, 32 * torch.finfo(log_probs.dtype).eps)
        if float(norm) > tol:
            hint = (
                "; these look like probabilities: pass probs.log()"
                if bool((log_probs >= 0).all())
                else ""
            )
            raise ValueError(
                f"log_probs must be normalised log-probabilities (logsumexp over dim {dim} is 0), "
                f"but a row has logsumexp {float(norm):.3g}{hint}"
            )
    p = log_probs.exp()
    return -torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim)


def _check_samples(name: str, samples: Tensor, shape: str = "[S, ..., C]", ndim: int = 2) -> Tensor:
    x = check_tensor(name, samples)
    if x.ndim < ndim or x.shape[0] < 1:
        raise ValueError(f"{name} must have shape {shape} with S >= 1, got {tuple(x.shape)}")
    return x


def log_average_softmax(logit_samples: Tensor) -> Tensor:
    """``log((1/S) Σ_s softmax(f_s))`` ``[..., C]`` from logit samples ``[S, ..., C]``, via log-sum-exp (finite)."""
    f = _check_samples("logit_samples", logit_samples)
    return torch.logsumexp(torch.log_softmax(f, dim=-1), dim=0) - math.log(f.shape[0])


def average_softmax(logit_samples: Tensor) -> Tensor:
    """Monte Carlo predictive ``(1/S) Σ_s softmax(f_s)`` ``[..., C]`` from logit samples ``[S, ..., C]``."""
    return log_average_softmax(logit_samples).exp()


def decompose_classification(logit_samples: Tensor) -> Uncertainty:
    """Entropy decomposition of the predictive from logit samples ``[S, ..., C]``: an `Uncertainty` of shape ``[...]``.

    ``total = H[p̄]``, ``aleatoric = (1/S) Σ_s H[p_s]``, ``epistemic = (1/S) Σ_s KL(p_s ‖ p̄)`` (the mutual
    information, clipped at 0) with ``p_s = softmax(f_s)``, all from log-probabilities (no ``log 0``).
    """
    f = _check_samples("logit_samples", logit_samples)
    log_p = torch.log_softmax(f, dim=-1)
    log_mean = torch.logsumexp(log_p, dim=0) - math.log(f.shape[0])
    total = entropy(log_mean)
    aleatoric = entropy(log_p).mean(0)
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - log_mean), torch.zeros_like(p)).sum(-1)
    return Uncertainty(total=total, aleatoric=aleatoric, epistemic=kl.mean(0).clamp_min(0.0))


def decompose_regression(
    mean_samples: Tensor, var_samples: Tensor | float | None = None
) -> Uncertainty:
    """Law of total variance for the mixture ``(1/S) Σ_s N(m_s, v_s)``: an `Uncertainty` of shape ``[...]``.

    ``aleatoric = mean_s v_s``, ``epistemic = mean_s (m_s − m̄)²``. ``mean_samples`` are ``[S, ...]``;
    ``var_samples`` anything broadcastable to them (e.g. a float), or ``None`` for zero.
    """
    m = _check_samples("mean_samples", mean_samples, "[S, ...]", 1)
    if var_samples is None:
        var_samples = 0.0
    if not isinstance(var_samples, Tensor):
        var_samples = torch.as_tensor(float(var_samples), dtype=m.dtype, device=m.device)
    v = check_nonneg("var_samples", var_samples)
    check_same_device(mean_samples=m, var_samples=v)
    check_broadcasts("var_samples", v, "mean_samples", m)
    aleatoric = v.expand(m.shape).mean(0)
    epistemic = (m - m.mean(0)).square().mean(0)
    return Uncertainty(total=aleatoric + epistemic, aleatoric=aleatoric, epistemic=epistemic)
