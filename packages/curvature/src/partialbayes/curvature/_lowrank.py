"""The Kronecker algebra of one block (``E = λ_G λ_Aᵀ / T + δ``), whole or low-rank (rank ``r`` + isotropic rest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from partialbayes.predictive.internal import check_finite


def clamped_eigh(
    matrix: Tensor,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    what: str = "factor",
) -> tuple[Tensor, Tensor]:
    """``(λ [n], Q [n, n])`` of a PSD factor (shape checked by the caller), round-off below 0 clamped."""
    check_finite(matrix, f"{what} holds non-finite values (NaN or inf)")
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


#: Sketch columns beyond the rank kept (``q = r + OVERSAMPLE``).
OVERSAMPLE = 10


@dataclass(frozen=True)
class LowRankFactor:
    """A PSD factor ``U diag(s) Uᵀ + rest · (I − U Uᵀ)``: ``U [n, r]`` orthonormal, ``s [r] ≥ 0``, 0-d ``rest``."""

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
    """The rank-``rank`` `LowRankFactor` from a sketch ``y = F Ω`` ``[n, q]``, ``omega`` and ``tr F``."""
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
    """Streamed ``F = Σ d dᵀ``: whole, or (``rank < n``) sketched ``Y = F Ω`` ``[n, q]`` with ``tr F``."""

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
    """``log det P`` from the extended eigenvalues ``E`` ``[r_G + 1, r_A + 1]`` and the multiplicities."""
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
    """Multiply ``z [..., n_G, n_A]``'s coordinates in the extended eigenbasis by ``w``."""
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
    """``J Σ Jᵀ`` ``[B, K, K]`` of one block with low-rank factors."""
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
