"""Prior precision: parsing and validation, and the Gaussian marginal likelihood."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

PriorSpec = float | int | Tensor | Mapping[str, float]


def prior_vector(
    spec: PriorSpec, modules: Sequence[str], *, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``[len(modules)]`` prior precisions from a positive scalar, a ``[M]`` tensor or ``{module: δ}`` (differentiable)."""
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
    """Laplace evidence ``log p(D|θ*) - ½ (log det P - log det P₀) - ½ scatter`` (the ``2π`` factors cancel)."""
    return log_likelihood - 0.5 * (log_det_posterior - log_det_prior) - 0.5 * scatter
