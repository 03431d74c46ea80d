"""Monte Carlo predictive for Gaussian logits over the full covariance."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from partialbayes.predictive._validate import check_generator, check_int
from partialbayes.predictive._validate import gaussian_logits as _gaussian_logits

#: Elements of one sample chunk ``[s, ..., C]``; bounds the memory of `mc_predictive`.
_CHUNK_ELEMENTS = 1 << 22


def cholesky_jitter(cov: Tensor, *, max_tries: int = 8) -> Tensor:
    """Lower Cholesky factor ``[..., C, C]`` of finite PSD matrices, adding jitter only to the ones that fail.

    A failing matrix with an eigenvalue below ``−√eps · max|λ|`` is not PSD and raises; the others get
    ``jitter·I``, from ``10·eps·mean(diag)`` growing tenfold for up to ``max_tries`` levels.
    """
    chol, info = torch.linalg.cholesky_ex(cov)
    bad = info > 0
    if not bool(bad.any()):
        return chol
    eps = torch.finfo(cov.dtype).eps
    failing = cov[bad]
    eig = torch.linalg.eigvalsh(failing)
    scale = eig.abs().amax(-1)
    worst = eig[:, 0] / scale.clamp_min(torch.finfo(cov.dtype).tiny)
    if bool((worst < -math.sqrt(eps)).any()):
        i = int(torch.argmin(worst))
        idx = bad.nonzero()[i].tolist()
        raise ValueError(
            f"cov is not positive semi-definite: matrix at batch index {idx} has eigenvalue "
            f"{float(eig[i, 0]):.3g} (largest magnitude {float(scale[i]):.3g})"
        )
    mean_diag = failing.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(cov.dtype).tiny)
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    jitter = 10 * eps * mean_diag
    for _ in range(max_tries):
        fixed, info_fixed = torch.linalg.cholesky_ex(failing + jitter[:, None, None] * eye)
        if not bool((info_fixed > 0).any()):
            chol = chol.clone()
            chol[bad] = fixed
            return chol
        jitter = jitter * 10
    raise ValueError(f"cov: Cholesky failed even with jitter up to {float(jitter.max() / 10):.3g}")


def sample_logits(
    mean: Tensor, cov: Tensor, n_samples: int, *, generator: torch.Generator | None = None
) -> Tensor:
    """Draw logit samples ``f = mean + L ε`` with ``L Lᵀ = cov`` (Cholesky with jitter fallback).

    Args:
        mean: ``[..., C]``.
        cov: Variances ``[..., C]`` or covariances ``[..., C, C]``.
        n_samples: Number of samples ``S ≥ 1``.
        generator: Random generator (same seed, same samples).

    Returns:
        Samples ``[S, ..., C]``.

    Raises:
        ValueError: On invalid shapes or ``n_samples``, NaN/inf, negative variances, a non-PSD covariance.
        TypeError: If ``generator`` is not a ``torch.Generator``.
    """
    check_int("n_samples", n_samples)
    check_generator(generator)
    return gaussian_draws(*_gaussian_logits(mean, cov), n_samples, generator)


def gaussian_draws(
    mu: Tensor, var: Tensor, full: bool, n: int, generator: torch.Generator | None
) -> Tensor:
    """`sample_logits` on checked input (``full``: ``var`` is ``[..., C, C]``)."""
    scale = cholesky_jitter(var) if full else var.sqrt()
    return _draw_t(mu, scale, full, n, generator).movedim(-1, 0)


def mc_predictive(
    mean: Tensor, cov: Tensor, n_samples: int = 100, *, generator: torch.Generator | None = None
) -> Tensor:
    """Monte Carlo estimate of ``E[softmax(f)]``, ``[..., C]``, for ``f ~ N(mean, cov)`` (errors: `sample_logits`).

    Samples are drawn in chunks, so memory stays bounded for large batches; the estimate is unbiased with
    standard error ``O(S^{-1/2})`` for ``S = n_samples``.

    Args:
        mean: Logit means ``[..., C]``.
        cov: Variances ``[..., C]`` or covariances ``[..., C, C]``.
        n_samples: Number of samples ``S``.
        generator: Random generator.
    """
    check_int("n_samples", n_samples)
    check_generator(generator)
    return gaussian_mc(*_gaussian_logits(mean, cov), n_samples, generator)


def gaussian_mc(
    mu: Tensor, var: Tensor, full: bool, n_samples: int, generator: torch.Generator | None
) -> Tensor:
    """`mc_predictive` on checked input (``full``: ``var`` is ``[..., C, C]``)."""
    scale = cholesky_jitter(var) if full else var.sqrt()
    chunk = max(1, _CHUNK_ELEMENTS // max(1, mu.numel()))
    total = torch.zeros_like(mu)
    done = 0
    while done < n_samples:
        s = min(chunk, n_samples - done)
        total += torch.softmax(_draw_t(mu, scale, full, s, generator), dim=-2).sum(-1)
        done += s
    return total / n_samples


def _draw_t(
    mu: Tensor, scale: Tensor, full: bool, n: int, generator: torch.Generator | None
) -> Tensor:
    """Samples laid out ``[..., C, n]`` (one batched matmul ``L @ ε`` per example)."""
    eps = torch.randn((*mu.shape, n), dtype=mu.dtype, device=mu.device, generator=generator)
    if full:
        return mu.unsqueeze(-1) + scale @ eps
    return mu.unsqueeze(-1) + scale.unsqueeze(-1) * eps
