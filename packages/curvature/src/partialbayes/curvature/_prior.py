"""Prior precision: parsing and validation, the Gaussian marginal likelihood, and a local probit NLL.

The probit predictive lives here (and not in ``partialbayes.predictive``) to keep ``curvature`` independent of
``predictive`` (DESIGN's dependency graph); it is only used to score prior precisions on validation data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

PriorSpec = float | int | Tensor | Mapping[str, float]


def prior_vector(
    spec: PriorSpec, modules: Sequence[str], *, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Parse a prior precision into one value per module.

    Args:
        spec: A positive scalar (float or 0-d tensor), a 1-D tensor with one value per module, or a mapping
            ``module name -> value`` covering every module.
        modules: Module names, in the posterior's order.
        dtype: Floating dtype of the result.
        device: Device of the result.

    Returns:
        ``[len(modules)]`` prior precisions (differentiable if ``spec`` is a tensor that requires grad).

    Raises:
        ValueError: On unknown or missing module names, a wrong length, or a non-positive / non-finite value.
        TypeError: On an unsupported type.
    """
    n = len(modules)
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(modules))
        missing = [m for m in modules if m not in spec]
        if unknown:
            raise ValueError(
                f"prior_precision names unknown modules {unknown}; known: {list(modules)}"
            )
        if missing:
            raise ValueError(f"prior_precision misses modules {missing}")
        vec = torch.stack(
            [torch.as_tensor(spec[m], dtype=dtype, device=device).reshape(()) for m in modules]
        )
    elif isinstance(spec, Tensor):
        vec = spec.to(dtype=dtype, device=device)
        if vec.ndim == 0:
            vec = vec.expand(n)
        elif vec.shape != (n,):
            raise ValueError(
                f"prior_precision tensor must be a scalar or have shape ({n},) (one per module), got {tuple(vec.shape)}"
            )
    elif isinstance(spec, (float, int)) and not isinstance(spec, bool):
        vec = torch.full((n,), float(spec), dtype=dtype, device=device)
    else:
        raise TypeError(
            f"prior_precision must be a float, a tensor or a dict module -> float, got {type(spec).__name__}"
        )
    with torch.no_grad():
        bad = ~torch.isfinite(vec) | (vec <= 0)
        if bad.any():
            where = [modules[i] for i in torch.nonzero(bad).flatten().tolist()]
            raise ValueError(
                f"prior_precision must be positive and finite; got {vec.detach().cpu().tolist()} "
                f"(bad for modules {where})"
            )
    return vec


def check_positive(name: str, value: float | Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a positive finite number."""
    v = float(value.detach()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be positive and finite, got {v}")


def gaussian_log_marglik(
    log_likelihood: Tensor, log_det_posterior: Tensor, log_det_prior: Tensor, scatter: Tensor
) -> Tensor:
    """Laplace evidence ``log p(D|θ*) - ½ (log det P - log det P₀) - ½ θ*ᵀ P₀ θ*`` (prior mean 0).

    The ``(2π)^{d/2}`` factors of prior and posterior cancel. All arguments are scalars.
    """
    return log_likelihood - 0.5 * (log_det_posterior - log_det_prior) - 0.5 * scatter


def probit_nll(logits: Tensor, cov: Tensor, labels: Tensor) -> Tensor:
    """Summed NLL of the probit-approximated softmax predictive ``softmax(f / √(1 + π/8 diag Σ_f))``.

    Args:
        logits: ``f_MAP``, shape ``[B, C]``.
        cov: ``Σ_f``, shape ``[B, C, C]``.
        labels: Class indices, shape ``[B]``.

    Returns:
        Scalar, summed over the batch.
    """
    var = torch.diagonal(cov, dim1=-2, dim2=-1).clamp(min=0)
    scaled = logits / torch.sqrt(1.0 + math.pi / 8.0 * var)
    return torch.nn.functional.cross_entropy(scaled, labels, reduction="sum")


def gaussian_nll(mean: Tensor, cov: Tensor, targets: Tensor, sigma_noise: float | Tensor) -> Tensor:
    """Summed NLL of the linearised Gaussian predictive ``N(f, diag Σ_f + σ²)``.

    Args:
        mean: ``[B, C]``.
        cov: ``[B, C, C]``.
        targets: ``[B, C]`` (or ``[B]`` when ``C == 1``).
        sigma_noise: Observation noise ``σ``.

    Returns:
        Scalar, summed over batch and outputs.
    """
    var = torch.diagonal(cov, dim1=-2, dim2=-1).clamp(min=0) + sigma_noise**2
    targets = targets.reshape(mean.shape).to(mean.dtype)
    return 0.5 * (torch.log(2 * math.pi * var) + (targets - mean) ** 2 / var).sum()
