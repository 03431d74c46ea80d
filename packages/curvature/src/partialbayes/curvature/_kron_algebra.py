"""Kronecker-factored posterior algebra for one block, without ever forming the dense covariance.

One block covers the row-major ``vec`` of an ``[r, c]`` matrix ``X`` (entry ``(i, j)`` is ``i * c + j``).
Its posterior precision is

    P = (G ⊗ A) / T + δ I,

with ``G = Q_G diag(λ_G) Q_Gᵀ`` (``[r, r]``, summed over the data) and ``A = Q_A diag(λ_A) Q_Aᵀ``
(``[c, c]``, averaged), temperature ``T`` and prior precision ``δ``. In the eigenbasis ``Q_G ⊗ Q_A`` the
precision is diagonal with eigenvalues ``E = λ_G λ_Aᵀ / T + δ`` (an ``[r, c]`` matrix), so the prior is added
exactly and every operation costs ``O(r³ + c³)`` at most:

* ``(Q_G ⊗ Q_A) vec(X) = vec(Q_G X Q_Aᵀ)`` (row-major vec),
* ``log det P = Σ_ij log E_ij``,
* a sample ``θ = vec(Q_G (ε / √E) Q_Aᵀ)`` with ``ε ~ N(0, I)`` has covariance ``Σ = P⁻¹``,
* for Jacobian rows ``J_k`` (``[r, c]`` each), ``(J Σ Jᵀ)_kl = Σ_ij M_k,ij M_l,ij / E_ij`` with
  ``M_k = Q_Gᵀ J_k Q_A`` (streamed from hooked activations in ``_laplace_projected``).

The dense ``P⁻¹`` is never formed here; the tests build it as their reference. `_lowrank` states the
log-determinant and the samples, for whole and low-rank factors alike (a whole factor has no remainder).
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
    """Eigendecomposition of a symmetric PSD factor with the round-off below 0 clamped to 0.

    A curvature factor is a sum of outer products, so a negative eigenvalue can only be round-off:
    ``λ_min ≥ −ε_r · max |λ|`` with ``ε_r = max(√ε, 10 n ε)`` (``ε`` of the coarser of the factor's and the
    decomposition's dtypes). Anything more negative is refused rather than clamped into a wrong posterior.

    Args:
        matrix: Symmetric matrix, shape ``[n, n]`` (symmetrised before decomposing).
        dtype: dtype of the decomposition (default: the matrix's).
        device: Its device (default: the matrix's).
        what: How errors name the matrix.

    Returns:
        ``(eigenvalues [n], eigenvectors [n, n])`` with ``matrix ≈ Q diag(λ) Qᵀ`` and ``λ ≥ 0``.

    Raises:
        ValueError: If ``matrix`` is not square, holds non-finite values, or is negative beyond round-off
            (the message gives its most negative eigenvalue relative to the largest).
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
    """Eigenvalues of ``P = s (G ⊗ A) / T + δ I`` in the basis ``Q_G ⊗ Q_A``.

    Args:
        eig_g: Eigenvalues of ``G``, shape ``[r]`` (clamped at 0).
        eig_a: Eigenvalues of ``A``, shape ``[c]`` (clamped at 0).
        prior_precision: ``δ > 0``, a scalar (float or 0-d tensor; differentiable).
        temperature: ``T > 0``.
        curvature_scale: ``s``, multiplies the curvature (e.g. ``σ_fit² / σ²`` when the noise changes).

    Returns:
        ``E`` of shape ``[r, c]``, ``E_ij = s λ_G,i λ_A,j / T + δ``.
    """
    return torch.outer(eig_g, eig_a) * (curvature_scale / temperature) + prior_precision
