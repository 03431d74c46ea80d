"""Low-rank Kronecker factors against dense float64 references of P = c (Ĝ ⊗ Â) / T + δ I."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _alloc_guard import LargestTensor

from partialbayes.curvature._kfac import (
    OVERSAMPLE,
    FactorAccumulator,
    LowRankFactor,
    lowrank_covariance,
    lowrank_log_det,
    nystrom_factor,
    precision_eigenvalues,
    scale_in_basis,
    whole_factor,
)
from partialbayes.selection import modules

FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
F64 = torch.float64


def _psd(n, rank, g, device):
    x = torch.randn(n, rank, generator=g, dtype=F64)
    return (x @ x.T).to(device)


def _random_lowrank(n, r, g, device) -> LowRankFactor:
    """A factor with a random orthonormal ``U`` [n, r], eigenvalues and remainder (``r = n``: whole)."""
    u = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64)).Q[:, :r]
    s = torch.rand(r, generator=g, dtype=F64) * 3
    rest = torch.rand((), generator=g, dtype=F64) if r < n else torch.zeros((), dtype=F64)
    return LowRankFactor(u.to(device), s.to(device), rest.to(device))


def _dense(f: LowRankFactor) -> torch.Tensor:
    n = f.U.shape[0]
    eye = torch.eye(n, dtype=F64, device=f.U.device)
    return (f.U * f.s) @ f.U.T + f.rest * (eye - f.U @ f.U.T)


def _extended_e(g, a, delta, T, scale=1.0):
    return precision_eigenvalues(g, a, delta, T, scale)


def _sample_matrix(g, a, E):
    """The dense matrix of the sampler ``ε ↦ P^{-1/2} ε`` (one column per unit block)."""
    ng, na = g.U.shape[0], a.U.shape[0]
    units = torch.eye(ng * na, dtype=F64, device=g.U.device).reshape(ng * na, ng, na)
    return scale_in_basis(units, g, a, E.rsqrt()).reshape(ng * na, -1).T


def _dense_covariance(x, d, p_inv):
    """``J P⁻¹ Jᵀ`` with ``J_k = Σ_t d_k,t x_tᵀ`` formed densely: ``[B, K, K]``."""
    jac = torch.einsum("kbti,btj->bkij", d, x).flatten(2)  # [B, K, n_G n_A]
    return jac @ p_inv @ jac.transpose(1, 2)


shapes = dict(
    ng=st.integers(1, 6),
    na=st.integers(1, 6),
    cut_g=st.integers(0, 5),
    cut_a=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    T=st.sampled_from([0.5, 1.0, 3.0]),
    delta=st.floats(0.05, 20.0),
)


@FIXTURE_OK
@given(**shapes)
def test_lowrank_algebra_equals_dense(device, ng, na, cut_g, cut_a, seed, T, delta):
    """log det, sample covariance and J Σ Jᵀ of the low-rank block equal the dense ones of its matrices."""
    g = torch.Generator().manual_seed(seed)
    fg = _random_lowrank(ng, max(1, ng - cut_g), g, device)
    fa = _random_lowrank(na, max(1, na - cut_a), g, device)
    E = _extended_e(fg, fa, delta, T, scale=0.7)
    eye = torch.eye(ng * na, dtype=F64, device=device)
    P = 0.7 * torch.kron(_dense(fg), _dense(fa)) / T + delta * eye
    torch.testing.assert_close(lowrank_log_det(E, fg, fa), torch.logdet(P))
    S = _sample_matrix(fg, fa, E)
    p_inv = torch.linalg.inv(P)
    torch.testing.assert_close(S @ S.T, p_inv)
    b, t, k = 2, 3, 4
    x = torch.randn(b, t, na, generator=g, dtype=F64).to(device)
    d = torch.randn(k, b, t, ng, generator=g, dtype=F64).to(device)
    want = _dense_covariance(x, d, p_inv)
    for jacobians in (True, False):  # formed Jacobians, or token Gram matrices
        torch.testing.assert_close(lowrank_covariance(x, d, fg, fa, 1 / E, jacobians), want)


@FIXTURE_OK
@given(**shapes)
def test_rank_full_is_the_exact_kron_algebra(device, ng, na, cut_g, cut_a, seed, T, delta):
    """Factors kept whole: the eigenvalues of `_kron_algebra`, and log det and ``P^{-1/2}`` of the dense ``P``."""
    g = torch.Generator().manual_seed(seed)
    G, A = _psd(ng, 1 + cut_g, g, device), _psd(na, 1 + cut_a, g, device) / 5
    fg, fa = whole_factor(G), whole_factor(A)
    E = _extended_e(fg, fa, delta, T)
    want = torch.outer(torch.linalg.eigvalsh(G), torch.linalg.eigvalsh(A)) / T + delta
    torch.testing.assert_close(E[:-1, :-1], want)
    torch.testing.assert_close(E[-1], torch.full_like(E[-1], delta))  # no remainder: δ
    P = torch.kron(G, A) / T + delta * torch.eye(ng * na, dtype=F64, device=device)
    torch.testing.assert_close(lowrank_log_det(E, fg, fa), torch.logdet(P))
    lam, q = torch.linalg.eigh(P)
    z = torch.randn(3, ng, na, generator=g, dtype=F64).to(device)
    want = (z.reshape(3, -1) @ (q * lam.rsqrt()) @ q.T).reshape(3, ng, na)
    torch.testing.assert_close(scale_in_basis(z, fg, fa, E.rsqrt()), want)


def test_isotropic_remainder_over_estimates_log_det(device):
    """Exact top-r eigenvectors, remainder = mean of the rest: log det ≥ exact (Jensen), trace kept."""
    g = torch.Generator().manual_seed(3)
    G, A = _psd(9, 9, g, device), _psd(4, 4, g, device)
    s, u = torch.linalg.eigh(G)
    for r in (1, 4, 8):
        top = LowRankFactor(u[:, -r:], s[-r:], s[:-r].mean())
        torch.testing.assert_close(torch.trace(_dense(top)), torch.trace(G))
        E = _extended_e(top, whole_factor(A), 0.3, 1.0)
        exact = torch.logdet(torch.kron(G, A) + 0.3 * torch.eye(36, dtype=F64, device=device))
        assert lowrank_log_det(E, top, whole_factor(A)) >= exact - 1e-10


def _streamed(n, rank, parts):
    """``G = Σ dᵀd`` of ``parts`` through a `FactorAccumulator` (one input column): ``(G, accumulator)``."""
    dev = parts[0].device
    acc = FactorAccumulator(n, 1, F64, dev, max_rank=rank)
    for d in parts:
        acc.add(torch.ones(d.shape[0], 1, dtype=F64, device=dev), d.shape[0], d)
    kmod = modules(torch.nn.Sequential(torch.nn.Linear(1, n, bias=False)), ["0"]).kron_modules()[
        "0"
    ]
    return acc.result("0", kmod, 1, None).G, acc


@pytest.mark.parametrize("rows", [3, 9])
def test_nystrom_is_exact_when_the_rank_fits_the_sketch(device, rows):
    """F = Σ dᵀd from fewer rows than the sketch's columns: recovered to rounding, streamed in batches."""
    g = torch.Generator().manual_seed(rows)
    n, rank = 40, 6
    d = torch.randn(rows, n, generator=g, dtype=F64).to(device)
    f, _ = _streamed(n, rank, d.split(2))
    F = d.T @ d
    if rows <= rank:
        torch.testing.assert_close(_dense(f), F, atol=1e-9, rtol=0)
    else:  # rank 9 > r = 6: the top 6 eigenpairs of F, remainder from the exact trace
        s = torch.linalg.eigvalsh(F)
        torch.testing.assert_close(f.s, s.flip(0)[:rank], atol=1e-8, rtol=1e-8)
        torch.testing.assert_close(f.rest, s.flip(0)[rank:].sum() / (n - rank))
    torch.testing.assert_close(f.U.T @ f.U, torch.eye(rank, dtype=F64, device=device))


def test_nystrom_error_within_the_streaming_bound(device):
    """Tropp et al. (2017) Thm 4.1 in expectation: ‖F − F̂_r‖_* ≤ (1 + r / (q − r − 1)) ‖F − [[F]]_r‖_*."""
    g = torch.Generator().manual_seed(0)
    n, r, q = 60, 5, 15
    decay = torch.logspace(0, -3, n, dtype=F64)
    Q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64)).Q
    F = ((Q * decay) @ Q.T).to(device)
    errs = []
    for seed in range(8):  # the bound is on the mean over test matrices
        omega = torch.linalg.qr(
            torch.randn(n, q, generator=torch.Generator().manual_seed(seed), dtype=F64)
        ).Q
        f = nystrom_factor(F @ omega.to(device), omega.to(device), torch.trace(F), r)
        low = (f.U * f.s) @ f.U.T
        errs.append(torch.linalg.matrix_norm(F - low, ord="nuc"))
    best = decay[r:].sum()
    assert float(torch.stack(errs).mean()) <= (1 + r / (q - r - 1)) * float(best)


def test_a_rank_at_least_the_size_keeps_the_sum_whole(device):
    """No rank, or one not below ``n``: the exact sum, returned as the matrix (allocated by the first rows)."""
    g = torch.Generator().manual_seed(1)
    d = torch.randn(7, 5, generator=g, dtype=F64).to(device)
    for rank in (None, 5, 8):
        acc = FactorAccumulator(5, 1, F64, torch.device(device), max_rank=rank)
        assert acc.sums == [None, None]
        G, _ = _streamed(5, rank, [d[:3], d[3:]])
        torch.testing.assert_close(G, d.T @ d)


def test_sketch_of_a_50k_factor_never_forms_it(device):
    """n = 50,257 (GPT-2's vocabulary): sketch, factor and one sample stay O(n q), far below n²."""
    n, rank = 50257, 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with LargestTensor(limit=64 * n) as guard:
            parts = [torch.randn(5, n, dtype=F64, device=device) for _ in range(3)]
            f, acc = _streamed(n, rank, parts)
            fa = whole_factor(torch.eye(3, dtype=F64, device=device))
            E = _extended_e(f, fa, 1.0, 1.0)
            z = torch.randn(1, n, 3, dtype=F64, device=device)
            theta = scale_in_basis(z, f, fa, E.rsqrt())
    assert f.U.shape == (n, rank)
    assert theta.shape == (1, n, 3)
    assert guard.largest <= (rank + OVERSAMPLE) * n  # Y and Ω: n × q
    torch.testing.assert_close(f.s.sum() + f.rest * (n - rank), acc.traces[0])
