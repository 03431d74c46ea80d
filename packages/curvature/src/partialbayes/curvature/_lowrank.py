"""Low-rank Kronecker factors: a rank-``r`` eigendecomposition plus an isotropic remainder, never ``n × n``.

A PSD factor ``F`` (``n × n``: 10 GB for the output factor of a 50,257-token LM head) is kept as
``F ≈ U diag(s) Uᵀ + f₀ (I − U Uᵀ)`` (``U [n, r]`` orthonormal) with ``f₀ = (tr F − Σ s) / (n − r)``, which
keeps the trace; ``r = n`` is a factor kept whole. The remainder is isotropic, not diagonal, so that
``[U, U⊥]`` is an eigenbasis: the *extended eigenvalues* ``(s₁, …, s_r, f₀)``, of multiplicities
``(1, …, 1, n − r)``, keep the Kronecker algebra of ``_kron_algebra`` exact for ``P = c (G ⊗ A) / T + δ I``
with either factor low-rank. ``P`` has eigenvalues ``E = c ĝ âᵀ / T + δ`` on the ``[r_G + 1, r_A + 1]`` grid,
``log det P = Σ_ij m_G,i m_A,j log E_ij`` (`lowrank_log_det`), and ``P^{-p} z`` multiplies the coordinates
of ``z`` in ``[U_G, U_G⊥] ⊗ [U_A, U_A⊥]`` by ``E^{-p}`` (`scale_in_basis`: samples with ``p = 1/2``);
``J Σ Jᵀ`` comes from token Gram matrices (`lowrank_covariance`). With the true leading eigenvectors, the
mean remainder over-estimates the left-out part of ``log det P`` (Jensen), equal when those are equal.

`NystromSketch` streams ``Y = F Ω`` (``F = Σ δ δᵀ``, so ``Y += δᵀ (δ Ω)``) and the exact ``tr F`` for a fixed
orthonormal ``Ω`` ``[n, q]``, ``q = r + oversample``: ``O(n q)`` memory. `nystrom_factor` is the stable
single-pass Nyström approximation (Tropp, Yurtsever, Udell & Cevher, NeurIPS 2017, Alg. 3) truncated to rank
``r``: exact when ``rank F ≤ q`` (fewer than ``q`` rows seen), and by their Theorem 4.1 of expected
nuclear-norm error at most ``1 + r / (q − r − 1)`` times that of the best rank-``r`` approximation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._kron_algebra import clamped_eigh

#: Sketch columns beyond the rank kept (``q = r + OVERSAMPLE``).
OVERSAMPLE = 10


@dataclass(frozen=True)
class LowRankFactor:
    """A PSD factor ``U diag(s) Uᵀ + rest · (I − U Uᵀ)``.

    Attributes:
        U: ``[n, r]`` orthonormal columns (``r = n``: the whole eigenbasis, no remainder).
        s: ``[r]`` eigenvalues, ``≥ 0``.
        rest: 0-d remainder eigenvalue ``f₀ ≥ 0`` (of multiplicity ``n − r``).
    """

    U: Tensor
    s: Tensor
    rest: Tensor

    @property
    def full(self) -> bool:
        """Whether the factor is kept whole (``r = n``)."""
        return self.U.shape[1] == self.U.shape[0]

    def extended(self) -> tuple[Tensor, Tensor]:
        """``(eigenvalues [r + 1], multiplicities [r + 1])``: ``(s, f₀)`` and ``(1, …, 1, n − r)``."""
        n, r = self.U.shape
        mult = torch.ones(r + 1, dtype=self.s.dtype, device=self.s.device)
        mult[-1] = n - r
        return torch.cat([self.s, self.rest.reshape(1)]), mult


def whole_factor(matrix: Tensor, *args: Any) -> LowRankFactor:
    """A factor kept whole: its clamped eigendecomposition (``r = n``, no remainder; ``args``: `clamped_eigh`'s)."""
    s, u = clamped_eigh(matrix, *args)
    return LowRankFactor(u, s, s.new_zeros(()))


def truncated(f: LowRankFactor, rank: int) -> LowRankFactor:
    """A whole factor's ``rank`` largest eigenpairs, the others as the remainder (their mean: trace kept)."""
    n = f.U.shape[0]
    if rank >= n:
        return f
    top = f.s.argsort(descending=True)[:rank]
    rest = ((f.s.sum() - f.s[top].sum()) / (n - rank)).clamp_min(0.0)
    return LowRankFactor(f.U[:, top].contiguous(), f.s[top], rest)


def nystrom_factor(y: Tensor, omega: Tensor, trace: Tensor | float, rank: int) -> LowRankFactor:
    """The rank-``r`` factor from a Nyström sketch ``Y = F Ω`` and the exact trace of ``F``.

    Args:
        y: ``[n, q]`` sketch ``F Ω``.
        omega: ``[n, q]`` orthonormal test matrix.
        trace: ``tr F``.
        rank: ``r ≤ q``: eigenpairs kept; the remainder ``f₀`` keeps the trace.

    Returns:
        The `LowRankFactor` (``U [n, r]``).
    """
    n = y.shape[0]
    info = torch.finfo(y.dtype)
    nu = (n**0.5 * info.eps * torch.linalg.matrix_norm(y, ord=2)).clamp_min(info.tiny)
    y_nu = y + nu * omega
    b = omega.T @ y_nu
    chol = torch.linalg.cholesky(0.5 * (b + b.T))
    e = torch.linalg.solve_triangular(chol, y_nu.T, upper=False).T  # Y_ν L⁻ᵀ: F̂ = E Eᵀ
    u, sv, _ = torch.linalg.svd(e, full_matrices=False)
    s = (sv[:rank] ** 2 - nu).clamp_min(0.0)
    rest = (torch.as_tensor(trace, dtype=y.dtype, device=y.device) - s.sum()).clamp_min(0.0)
    return LowRankFactor(u[:, :rank].contiguous(), s, rest / max(n - rank, 1))


class NystromSketch:
    """Streamed ``F = Σ_m d_m d_mᵀ``: whole (``Y = F``), or sketched (``Y = F Ω`` ``[n, q]``) with ``tr F``.

    Sketched when ``rank < n``, ``q = min(n, rank + OVERSAMPLE)``, ``Ω`` drawn from ``generator`` (any device;
    seeded, it is the same on every rank); ``Y`` is allocated by the first rows.
    """

    def __init__(
        self,
        n: int,
        rank: int | None = None,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        self.n, self.rank = n, n if rank is None else min(rank, n)
        self.trace = torch.zeros((), dtype=dtype, device=device)
        self.y: Tensor | None = None
        self.omega: Tensor | None = None  # None: kept whole, Y = F
        if self.rank < n:
            dev = generator.device if generator is not None else device
            q = min(n, self.rank + OVERSAMPLE)
            g = torch.randn(n, q, generator=generator, dtype=dtype, device=dev)
            self.omega = torch.linalg.qr(g.to(device)).Q

    def add(self, d: Tensor) -> None:
        """Add rows ``d`` ``[m, n]``: ``F += dᵀ d``."""
        d = d.to(self.trace.dtype)
        if self.omega is not None:
            self.trace += d.square().sum()
        dd = d if self.omega is None else d @ self.omega
        if self.y is None:
            self.y = d.T @ dd
        else:
            self.y.addmm_(d.T, dd)

    def sums(self) -> list[Tensor]:
        """The running sums ``[Y, tr F]`` (to reduce over ranks)."""
        if self.y is None:
            q = self.n if self.omega is None else self.omega.shape[1]
            self.y = self.trace.new_zeros(self.n, q)
        return [self.y, self.trace]

    def factor(self, scale: float = 1.0) -> Tensor | LowRankFactor:
        """``scale · F`` (e.g. ``1 / count`` for an averaged factor): the matrix, or its `LowRankFactor`."""
        y = self.sums()[0] * scale
        if self.omega is None:
            return y
        return nystrom_factor(y, self.omega, self.trace * scale, self.rank)


def lowrank_log_det(eigenvalues: Tensor, g: LowRankFactor, a: LowRankFactor) -> Tensor:
    """``log det P`` from the extended precision eigenvalues ``E`` ``[r_G + 1, r_A + 1]`` and multiplicities.

    ``E`` is ``_kron_algebra.precision_eigenvalues`` of ``g.extended()[0]`` and ``a.extended()[0]``.
    """
    mg, ma = g.extended()[1], a.extended()[1]
    return (torch.outer(mg, ma) * eigenvalues.log()).sum()


def _scale_cols(y: Tensor, a: LowRankFactor, w: Tensor) -> Tensor:
    """``y`` ``[..., m, n_A]`` with its coordinates in ``[U_A, U_A⊥]`` multiplied by ``w`` ``[m | 1, r_A + 1]``."""
    v = a.U
    yv = y @ v
    out = (yv * w[..., :-1]) @ v.T
    if not a.full:
        out = out + (y - yv @ v.T) * w[..., -1:]
    return out


def scale_in_basis(z: Tensor, g: LowRankFactor, a: LowRankFactor, w: Tensor) -> Tensor:
    """Multiply the coordinates of ``z`` in the basis ``[U_G, U_G⊥] ⊗ [U_A, U_A⊥]`` by ``w``.

    Args:
        z: ``[..., n_G, n_A]`` blocks (row-major ``vec``).
        g: Output factor.
        a: Input factor.
        w: ``[r_G + 1, r_A + 1]`` weights on the extended grid (the last row / column: the remainders).

    Returns:
        ``[..., n_G, n_A]``, in ``O(n_G n_A (r_G + r_A))``. ``w = E^{-1/2}`` gives ``P^{-1/2} z``: for
        ``z ~ N(0, I)`` a zero-mean posterior sample (covariance ``P⁻¹``); ``w = 1/E`` gives ``P⁻¹ z``.
    """
    u = g.U
    zc = u.T @ z  # [..., r_G, n_A]
    out = u @ _scale_cols(zc, a, w[:-1])
    if not g.full:
        out = out + _scale_cols(z - u @ zc, a, w[-1:])
    return out


def lowrank_covariance(
    x: Tensor,
    d: Tensor,
    g: LowRankFactor,
    a: LowRankFactor,
    inv_eigenvalues: Tensor,
    jacobians: bool | None = None,
) -> Tensor:
    """``J Σ Jᵀ`` of one block for Jacobians ``J_k = Σ_t d_k,t x_tᵀ`` per example.

    With ``jacobians`` (a LoRA map: ``J`` ``[n_G, n_A]``, one side its rank, is smaller than the token Gram
    matrices), ``(J Σ Jᵀ)_kl = <J_k, Σ J_l>_F`` with ``Σ J_l`` by `scale_in_basis` (``w = 1/E``). Else (an
    LM head), with ``D = d U_G``, ``X = x U_A`` and the remainders ``d⊥ = d − D U_Gᵀ``, ``x⊥ = x − X U_Aᵀ``:
    ``Σ_ij M_k,ij M_l,ij w_ij`` (``M_k = Dᵀ_k X``) plus the remainder blocks from the token Gram matrices
    ``x⊥ x⊥ᵀ`` and ``d⊥ d⊥ᵀ``, at ``K T (n_G r_G + n_A r_A) + K² T² n_G`` per example.

    Args:
        x: ``[B, T, n_A]`` inputs (with the constant 1 last when the bias is folded in).
        d: ``[K, B, T, n_G]`` output gradients, one slice per output ``k``.
        g: Output factor.
        a: Input factor.
        inv_eigenvalues: ``1 / E`` ``[r_G + 1, r_A + 1]``.
        jacobians: Form ``J`` (``None``: when smaller than the Gram matrices).

    Returns:
        ``[B, K, K]``.
    """
    w = inv_eigenvalues
    k, _, t, n_g = d.shape
    if jacobians or (jacobians is None and n_g * x.shape[-1] <= (k * t) ** 2):
        jac = torch.einsum("kbti,btj->bkij", d, x)  # [B, K, n_G, n_A]
        return torch.einsum("bkij,blij->bkl", jac, scale_in_basis(jac, g, a, w))
    dc, xc = d @ g.U, x @ a.U  # [K, B, T, r_G], [B, T, r_A]
    m = torch.einsum("kbti,btj->bkij", dc, xc)
    cov = torch.einsum("bkij,blij->bkl", m * w[:-1, :-1], m)
    if not a.full:
        gram_x = x @ x.transpose(1, 2) - xc @ xc.transpose(1, 2)  # x⊥ x⊥ᵀ  [B, T, T]
        cov = cov + torch.einsum("kbti,lbsi,bts->bkl", dc * w[:-1, -1], dc, gram_x)
    if not g.full:
        gram_d = torch.einsum("kbti,lbsi->bktls", d, d) - torch.einsum("kbti,lbsi->bktls", dc, dc)
        wx = (xc * w[-1, :-1]) @ xc.transpose(1, 2)
        if not a.full:
            wx = wx + w[-1, -1] * gram_x
        cov = cov + torch.einsum("bktls,bts->bkl", gram_d, wx)
    return cov
