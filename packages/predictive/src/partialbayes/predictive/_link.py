"""Deterministic link approximations of ``E[softmax(f)]`` (or ``E[sigmoid(f)]``) for Gaussian logits ``f``; the link choice."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from partialbayes.predictive._validate import (
    check_broadcasts,
    check_nonneg,
    check_number,
    check_same_device,
    check_tensor,
)
from partialbayes.predictive._validate import gaussian_logits as _gaussian_logits

_PI_OVER_8 = math.pi / 8.0


def probit_scale(var: Tensor) -> Tensor:
    """The probit scaling factor ``κ = (1 + π/8 · var)^(-1/2)`` in ``(0, 1]``, elementwise over ``var ≥ 0``.

    Raises:
        ValueError: If ``var`` has NaN/inf or negative entries.
    """
    return torch.rsqrt(1.0 + _PI_OVER_8 * check_nonneg("var", var))


def probit_binary(mean: Tensor, var: Tensor) -> Tensor:
    """Probit approximation ``E[σ(f)] ≈ σ(κ·mean)``, ``κ = (1 + π var / 8)^(-1/2)``, for one logit ``f ~ N(mean, var)``.

    MacKay (1992): σ(x) replaced by Φ(√(π/8)·x), error at most about 0.0177. ``mean`` and ``var ≥ 0`` have
    one shape; returns the positive class's probability of that shape.

    Raises:
        ValueError: On NaN/inf, negative ``var`` or mismatched shapes.
    """
    mu = check_tensor("mean", mean)
    v = check_nonneg("var", var)
    check_same_device(mean=mu, var=v)
    if v.shape != mu.shape:
        raise ValueError(f"var must have the shape of mean {tuple(mu.shape)}, got {tuple(v.shape)}")
    return torch.sigmoid(probit_scale(v) * mu)


def probit(mean: Tensor, cov: Tensor) -> Tensor:
    """Multiclass probit ``softmax(κ ⊙ mean)``, ``κ_c = (1 + π/8 · Σ_cc)^(-1/2)``, of ``E[softmax(f)]``, ``f ~ N(mean, cov)``.

    Kampen et al. (2024, Eq. 12). ``mean`` is ``[..., C]``, ``cov`` variances ``[..., C]`` or covariances
    ``[..., C, C]``; only the diagonal enters, but a full matrix is validated whole (an asymmetric one is
    most likely a transposed or mis-shaped tensor). Returns ``[..., C]``.

    Raises:
        ValueError: On NaN/inf, negative variances, asymmetric covariances or mismatched shapes.
    """
    mu, var, full = _gaussian_logits(mean, cov)
    return probit_kernel(mu, var.diagonal(dim1=-2, dim2=-1) if full else var)


def probit_kernel(mean: Tensor, var: Tensor) -> Tensor:
    """`probit` from logit means and variances ``[..., C]``, unchecked (for the library's own covariances)."""
    return torch.softmax(torch.rsqrt(1.0 + _PI_OVER_8 * var) * mean, dim=-1)


def laplace_bridge_alpha(mean: Tensor, cov: Tensor, *, correct_mean: bool = True) -> Tensor:
    """Dirichlet concentrations of the Laplace bridge for ``f ~ N(mean, cov)``.

    ``α_k = (1 − 2/K + e^{μ_k} Σ_l e^{−μ_l} / K²) / Σ_kk`` (Hobbhahn, Kristiadi & Hennig, 2022).
    This inverts the Laplace approximation of a Dirichlet in the softmax basis, whose mean
    ``μ_k = log α_k − mean_l log α_l`` and variances ``Σ_kk = (1 − 2/K)/α_k + Σ_l α_l^{-1} / K²``.

    With ``correct_mean`` (the default, as in laplace-torch), the Gaussian is first conditioned on
    ``Σ_k f_k = 0`` (logits are shift-invariant under softmax), which the bridge assumes:
    ``μ ← μ − Σ1 (1ᵀμ)/(1ᵀΣ1)`` and ``Σ ← Σ − Σ11ᵀΣ/(1ᵀΣ1)``.

    Args:
        mean: Logit means ``[..., K]``.
        cov: Variances ``[..., K]`` or covariances ``[..., K, K]``; the used variances must be > 0.
        correct_mean: Apply the sum-to-zero correction first.

    Returns:
        Concentrations ``α`` ``[..., K]``, positive, in the dtype of ``mean`` (computed in at
        least float64, since the correction cancels nearly equal numbers).

    Raises:
        ValueError: On NaN/inf, non-positive variances, or fewer than two classes.
    """
    mu, var, full = _gaussian_logits(mean, cov, symmetrize=False)
    k = mu.shape[-1]
    if k < 2:
        raise ValueError(f"the Laplace bridge needs at least 2 classes, mean has {k}")
    out_dtype = mu.dtype
    # The correction subtracts nearly equal numbers: work in at least float64. Only the row
    # sums and the diagonal of the covariance are needed, so symmetry is checked on the sums.
    work = torch.promote_types(out_dtype, torch.float64)
    mu = mu.to(work)
    if full:
        d0 = var.diagonal(dim1=-2, dim2=-1).to(work)
        row_sums, col_sums = var.sum(-1).to(work), var.sum(-2).to(work)
        tol = 1e3 * torch.finfo(var.dtype).eps * var.abs().sum((-1, -2)).to(work).unsqueeze(-1)
        if bool(((row_sums - col_sums).abs() > tol).any()):
            raise ValueError(
                "cov must be symmetric (its row sums and column sums differ by up to "
                f"{float((row_sums - col_sums).abs().max()):.3g})"
            )
        row = 0.5 * (row_sums + col_sums)  # Σ1, [..., K]
    else:
        d0 = row = var.to(work)
    if correct_mean:
        total = row.sum(-1, keepdim=True)  # 1ᵀΣ1, [..., 1]
        if bool((total <= 0).any()):
            raise ValueError("cov must be non-zero for the Laplace bridge (1ᵀ cov 1 = 0)")
        mu = mu - row * mu.sum(-1, keepdim=True) / total
        d = d0 - row.square() / total  # diagonal of the corrected covariance
    else:
        d = d0
    # a corrected variance within round-off of zero (relative to the uncorrected one) is zero
    tiny = 10 * torch.finfo(work).eps * d0
    bad = (d <= tiny).any(-1)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise ValueError(
            "the Laplace bridge needs positive logit variances; cov has a zero (or, after the "
            f"sum-to-zero correction, vanishing) variance at batch index {idx}. Add jitter to "
            "cov or use probit / mc_predictive"
        )
    # e^{μ_k} Σ_l e^{−μ_l} = exp(μ_k + logsumexp(−μ)), computed stably.
    s = torch.exp(mu + torch.logsumexp(-mu, dim=-1, keepdim=True))
    return ((1.0 - 2.0 / k + s / k**2) / d).to(out_dtype)


def laplace_bridge(mean: Tensor, cov: Tensor, *, correct_mean: bool = True) -> Tensor:
    """Predictive probabilities ``[..., K]`` of the Laplace bridge: the mean ``α / Σα`` of its Dirichlet.

    Arguments and errors as [`laplace_bridge_alpha`][partialbayes.predictive.laplace_bridge_alpha].
    """
    alpha = laplace_bridge_alpha(mean, cov, correct_mean=correct_mean)
    return alpha / alpha.sum(-1, keepdim=True)


def gaussian_predictive(
    mean: Tensor, var: Tensor, noise_var: Tensor | float
) -> tuple[Tensor, Tensor]:
    """Regression predictive ``(mean, var + σ²)``: the observation noise ``noise_var`` σ² ≥ 0 added.

    ``var`` is ``[...]``, or covariances ``[..., D, D]`` for ``mean [..., D]`` (σ² on the diagonal);
    ``noise_var`` a float or a tensor broadcastable to the variances.

    Raises:
        ValueError: On NaN/inf, negative variances or mismatched shapes.
    """
    mu, v, full = _gaussian_logits(mean, var)
    if not isinstance(noise_var, Tensor):
        value = check_number("noise_var", noise_var, "[0, inf)")
        noise_var = torch.as_tensor(value, dtype=mu.dtype, device=mu.device)
    noise = check_nonneg("noise_var", noise_var)
    target = v.diagonal(dim1=-2, dim2=-1) if full else v
    check_broadcasts("noise_var", noise, "the variances", target)
    if full:
        return mu, v + torch.diag_embed(torch.zeros_like(target) + noise)
    return mu, v + noise


def resolve_link(link: str | None, offered: Sequence[str], family: str) -> str:
    """The link to use: ``offered[0]`` for ``None``, else ``link`` if offered (else a ``ValueError`` listing them)."""
    if link is None:
        return offered[0]
    if link not in offered:
        raise ValueError(
            f"{family}.predict: link={link!r} is not offered; {family} offers {tuple(offered)}"
        )
    return link
