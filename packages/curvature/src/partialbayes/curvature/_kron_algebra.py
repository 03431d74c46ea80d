"""Kronecker-factored posterior algebra of one block, never forming the dense covariance.

A block is the row-major ``vec`` of an ``[r, c]`` matrix with precision ``P = (G ⊗ A) / T + δ I``; in the
eigenbasis ``Q_G ⊗ Q_A`` it is diagonal with eigenvalues ``E = λ_G λ_Aᵀ / T + δ``, so the prior is exact:
``log det P = Σ log E``, samples ``vec(Q_G (ε / √E) Q_Aᵀ)``, ``(J Σ Jᵀ)_kl = Σ M_k M_l / E`` with
``M_k = Q_Gᵀ J_k Q_A`` (``_laplace_projected``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def clamped_eigh(
    matrix: Tensor,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    what: str = "factor",
) -> tuple[Tensor, Tensor]:
    """``(λ [n], Q [n, n])`` of a symmetric PSD factor, round-off below 0 clamped to 0.

    Refuses a non-square or non-finite matrix, and ``λ_min < −max(√ε, 10 n ε) · max |λ|``.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{what} must be a square matrix, got shape {tuple(matrix.shape)}")
    if not torch.isfinite(matrix).all():
        raise ValueError(f"{what} holds non-finite values (NaN or inf)")
    m = matrix.to(device=device, dtype=dtype)
    eigenvalues, eigenvectors = torch.linalg.eigh(0.5 * (m + m.T))
    eps = max(torch.finfo(matrix.dtype).eps, torch.finfo(m.dtype).eps)
    tol = max(eps**0.5, 10 * m.shape[0] * eps)
    scale = float(eigenvalues.abs().max()) if m.numel() else 0.0
    lowest = float(eigenvalues.min()) if m.numel() else 0.0
    if lowest < -tol * scale:
        raise ValueError(
            f"{what} is not positive semi-definite: its most negative eigenvalue is {lowest:.3g}, "
            f"{lowest / scale:.3g} times its largest in magnitude (round-off stays within {tol:.1e}); "
            "a curvature factor is a sum of outer products"
        )
    # row-major like a loaded posterior's tensors: matmuls then round identically before and after load
    return eigenvalues.clamp(min=0.0), eigenvectors.contiguous()


def precision_eigenvalues(
    eig_g: Tensor,
    eig_a: Tensor,
    prior_precision: Tensor | float,
    temperature: float = 1.0,
    curvature_scale: Tensor | float = 1.0,
) -> Tensor:
    """``E [r, c]``, ``E_ij = s λ_G,i λ_A,j / T + δ``: the eigenvalues of ``P`` in ``Q_G ⊗ Q_A``."""
    return torch.outer(eig_g, eig_a) * (curvature_scale / temperature) + prior_precision
