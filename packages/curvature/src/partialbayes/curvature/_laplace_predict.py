"""The linearised predictive of a Laplace posterior from ``f_MAP`` and ``Σ_f = J Σ Jᵀ``: links and samples.

Pure functions of the logits as the model returns them (``[B, C]`` or ``[B, T, C]``), the kept positions of
token-level logits and one covariance ``[N, C, C]`` per output row. The formulas are
``partialbayes.predictive``'s (`probit`, `laplace_bridge`, `mc_predictive`, `sample_logits`,
`gaussian_predictive`); this module only places the results back at the model's output shape. Positions
that are not kept (attention mask 0, label -100) hold the MAP prediction: the softmax of the logits, the
logits themselves for samples, and the noise variance alone for regression. Nothing there is NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from partialbayes.predictive import (
    gaussian_predictive,
    laplace_bridge,
    mc_predictive,
    probit,
    sample_logits,
)

#: The links every Laplace posterior offers; the first is the default.
LINKS = ("probit", "mc", "bridge")


def _rows(logits: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    f = logits if keep is None else logits[keep]
    return f.to(dtype)


def _place(full: Tensor, keep: Tensor | None, rows: Tensor) -> Tensor:
    """``rows [..., N, C]`` at the kept positions of ``full [..., B, T, C]`` (or ``rows`` for ``keep=None``)."""
    if keep is None:
        return rows
    out = full.clone()
    out[..., keep, :] = rows
    return out


def classification_predictive(
    logits: Tensor,
    keep: Tensor | None,
    cov: Tensor,
    *,
    link: str,
    n_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """Predictive probabilities of ``softmax(f)``, ``f ~ N(f_MAP, Σ_f)``, at the model's output shape.

    Args:
        logits: ``f_MAP`` as the model returns it, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions of token-level logits (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``, one per kept output (row-major ``(b, t)`` order); its dtype is the
            dtype of the computation.
        link: ``"probit"`` (``softmax(κ ⊙ f)``, ``κ_c = (1 + π/8 Σ_cc)^(-1/2)``), ``"mc"`` (``n_samples``
            draws of ``f``, averaged softmax) or ``"bridge"`` (the Laplace bridge's Dirichlet mean).
        n_samples: Number of draws for ``"mc"``.
        generator: Source of randomness of ``"mc"`` (on the device of ``cov``).

    Returns:
        Probabilities with the shape and dtype of ``logits``; positions that are not kept hold
        ``softmax(f_MAP)``.
    """
    f = _rows(logits, keep, cov.dtype)
    if link == "probit":
        probs = probit(f, cov)
    elif link == "bridge":
        probs = laplace_bridge(f, cov)
    elif link == "mc":
        probs = mc_predictive(f, cov, n_samples, generator=generator)
    else:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    full = None if keep is None else torch.softmax(logits.to(cov.dtype), dim=-1)
    out = probs if full is None else _place(full, keep, probs)
    return out.to(logits.dtype)


def regression_predictive(
    logits: Tensor, keep: Tensor | None, cov: Tensor, noise_var: float
) -> tuple[Tensor, Tensor]:
    """Linearised Gaussian predictive ``N(f_MAP, diag Σ_f + σ²)`` at the model's output shape.

    The variance includes the observation noise ``σ²``: it is the variance of a new target, not of the
    function (subtract ``σ²`` for the latter). Every link gives this same closed form (the integral is
    Gaussian; the links approximate the softmax's).

    Args:
        logits: ``f_MAP``, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions of token-level outputs (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``.
        noise_var: ``σ²``.

    Returns:
        ``(mean, variance)``, each with the shape and dtype of ``logits``; positions that are not kept hold
        ``(f_MAP, σ²)``.
    """
    f = _rows(logits, keep, cov.dtype)
    mean, var = gaussian_predictive(f, cov.diagonal(dim1=-2, dim2=-1), noise_var)
    if keep is not None:
        full = logits.to(cov.dtype)
        mean = _place(full, keep, mean)
        var = _place(torch.full_like(full, noise_var), keep, var)
    return mean.to(logits.dtype), var.to(logits.dtype)


def linearised_logit_samples(
    logits: Tensor,
    keep: Tensor | None,
    cov: Tensor,
    n: int,
    *,
    generator: torch.Generator | None,
) -> Tensor:
    """``n`` draws of the linearised logits ``f ~ N(f_MAP, Σ_f)``, ``[n, *logits.shape]``.

    Regression: draws of the function (no observation noise). Positions that are not kept hold ``f_MAP``.
    The draws of different outputs are independent (``Σ_f`` is per output; the covariance between two
    examples or positions is not modelled).

    Args:
        logits: ``f_MAP``, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``.
        n: Number of draws.
        generator: Source of randomness (on the device of ``cov``).

    Returns:
        ``[n, B, C]`` or ``[n, B, T, C]`` in the dtype of ``logits``.
    """
    f = _rows(logits, keep, cov.dtype)
    draws = sample_logits(f, cov, n, generator=generator)  # [n, N, C]
    if keep is not None:
        full = logits.to(cov.dtype).expand(n, *logits.shape)
        draws = _place(full, keep, draws)
    return draws.to(logits.dtype)
