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
* ``Σ vec(V) = vec(Q_G ((Q_Gᵀ V Q_A) / E) Q_Aᵀ)``,
* a sample ``θ = vec(Q_G (ε / √E) Q_Aᵀ)`` with ``ε ~ N(0, I)`` has covariance ``Σ = P⁻¹``,
* for Jacobian rows ``J_k`` (``[r, c]`` each), ``(J Σ Jᵀ)_kl = Σ_ij M_k,ij M_l,ij / E_ij`` with
  ``M_k = Q_Gᵀ J_k Q_A``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clamped_eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric PSD factor with eigenvalues clamped at 0.

    Args:
        matrix: Symmetric matrix, shape ``[n, n]`` (symmetrised before decomposing).

    Returns:
        ``(eigenvalues [n], eigenvectors [n, n])`` with ``matrix ≈ Q diag(λ) Qᵀ`` and ``λ ≥ 0``.

    Raises:
        ValueError: If ``matrix`` is not square or holds non-finite values.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"factor must be a square matrix, got shape {tuple(matrix.shape)}")
    if not torch.isfinite(matrix).all():
        raise ValueError("factor holds non-finite values (NaN or inf)")
    sym = 0.5 * (matrix + matrix.T)
    eigenvalues, eigenvectors = torch.linalg.eigh(sym)
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


def kron_log_det(eigenvalues: Tensor) -> Tensor:
    """Log-determinant of the block precision from its eigenvalues ``E`` (any shape): ``Σ log E``."""
    return eigenvalues.log().sum()


def kron_rotate(q_g: Tensor, q_a: Tensor, matrix: Tensor) -> Tensor:
    """Apply ``Q_G ⊗ Q_A`` to row-major vecs: ``X ↦ Q_G X Q_Aᵀ``.

    Args:
        q_g: ``[r, r]``.
        q_a: ``[c, c]``.
        matrix: ``[..., r, c]``.

    Returns:
        ``[..., r, c]``.
    """
    return q_g @ matrix @ q_a.T


def kron_unrotate(q_g: Tensor, q_a: Tensor, matrix: Tensor) -> Tensor:
    """Apply ``(Q_G ⊗ Q_A)ᵀ`` to row-major vecs: ``X ↦ Q_Gᵀ X Q_A``; shapes as in `kron_rotate`."""
    return q_g.T @ matrix @ q_a


def kron_sample(q_g: Tensor, q_a: Tensor, eigenvalues: Tensor, noise: Tensor) -> Tensor:
    """Zero-mean posterior samples ``Q_G (ε / √E) Q_Aᵀ`` with covariance ``P⁻¹``.

    Args:
        q_g: ``[r, r]`` eigenvectors of ``G``.
        q_a: ``[c, c]`` eigenvectors of ``A``.
        eigenvalues: ``E`` of shape ``[r, c]`` (all positive).
        noise: Standard normal ``ε``, shape ``[n, r, c]``.

    Returns:
        Samples, shape ``[n, r, c]`` (row-major vec of each is one sample of the block).
    """
    return kron_rotate(q_g, q_a, noise * eigenvalues.rsqrt())


def kron_solve(q_g: Tensor, q_a: Tensor, eigenvalues: Tensor, matrix: Tensor) -> Tensor:
    """Covariance times vectors: ``V ↦ Q_G ((Q_Gᵀ V Q_A) / E) Q_Aᵀ``, i.e. ``P⁻¹ vec(V)``.

    Args:
        q_g: ``[r, r]``.
        q_a: ``[c, c]``.
        eigenvalues: ``E``, shape ``[r, c]``.
        matrix: ``V``, shape ``[..., r, c]``.

    Returns:
        ``[..., r, c]``.
    """
    return kron_rotate(q_g, q_a, kron_unrotate(q_g, q_a, matrix) / eigenvalues)


def kron_project_jacobian(q_g: Tensor, q_a: Tensor, jacobian: Tensor) -> Tensor:
    """Jacobians in the eigenbasis: ``M = Q_Gᵀ J Q_A``.

    Args:
        q_g: ``[r, r]``.
        q_a: ``[c, c]``.
        jacobian: Per-example logit Jacobians of the block, shape ``[B, C, r, c]``.

    Returns:
        ``M``, shape ``[B, C, r, c]``; it does not depend on the prior or the temperature.
    """
    return kron_unrotate(q_g, q_a, jacobian)


def kron_functional_covariance_projected(projected: Tensor, eigenvalues: Tensor) -> Tensor:
    """``J Σ Jᵀ`` from projected Jacobians: ``Σ_ij M_k,ij M_l,ij / E_ij``.

    Args:
        projected: ``M = Q_Gᵀ J Q_A``, shape ``[B, C, r, c]``.
        eigenvalues: ``E``, shape ``[r, c]``.

    Returns:
        Per-example functional covariance, shape ``[B, C, C]``.
    """
    scaled = projected * eigenvalues.rsqrt()
    flat = scaled.flatten(start_dim=2)
    return flat @ flat.transpose(1, 2)


def kron_functional_covariance(
    q_g: Tensor, q_a: Tensor, eigenvalues: Tensor, jacobian: Tensor
) -> Tensor:
    """Per-example functional covariance ``J Σ Jᵀ`` of one block without forming ``Σ``.

    Args:
        q_g: ``[r, r]``.
        q_a: ``[c, c]``.
        eigenvalues: ``E``, shape ``[r, c]``.
        jacobian: ``J``, shape ``[B, C, r, c]`` (row-major vec of the block per logit).

    Returns:
        ``[B, C, C]``.
    """
    return kron_functional_covariance_projected(
        kron_project_jacobian(q_g, q_a, jacobian), eigenvalues
    )


def kron_dense_covariance(q_g: Tensor, q_a: Tensor, eigenvalues: Tensor) -> Tensor:
    """The dense block covariance ``P⁻¹`` (``[rc, rc]``); for small blocks and tests only."""
    q = torch.kron(q_g, q_a)
    return (q / eigenvalues.reshape(-1)) @ q.T
