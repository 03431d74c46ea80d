"""Kronecker posterior algebra against dense float64 references of P = (G ⊗ A) / T + δ I."""

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import dense_kron_covariance

from partialbayes.curvature._kfac import (
    lowrank_log_det,
    precision_eigenvalues,
    scale_in_basis,
    whole_factor,
)


def _psd(n: int, rank: int, g: torch.Generator, device) -> torch.Tensor:
    x = torch.randn(n, rank, generator=g, dtype=torch.float64)
    return (x @ x.T).to(device)


def _setup(r, c, rank_g, rank_a, seed, device):
    g = torch.Generator().manual_seed(seed)
    G = _psd(r, rank_g, g, device)
    A = _psd(c, rank_a, g, device) / 7.0
    return G, A, g


def _dense_precision(G, A, T, delta):
    n = G.shape[0] * A.shape[0]
    return torch.kron(G, A) / T + delta * torch.eye(n, dtype=G.dtype, device=G.device)


FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = dict(
    r=st.integers(1, 5),
    c=st.integers(1, 5),
    rank_g=st.integers(1, 6),
    rank_a=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    T=st.sampled_from([0.5, 1.0, 3.0]),
    delta=st.floats(0.05, 20.0),
)


@FIXTURE_OK
@given(**shapes)
def test_eigenbasis_and_log_det_equal_dense(device, r, c, rank_g, rank_a, seed, T, delta):
    """``P = (Q_G ⊗ Q_A) diag(E) (Q_G ⊗ Q_A)ᵀ``; the tests' dense covariance oracle is its inverse."""
    G, A, _ = _setup(r, c, rank_g, rank_a, seed, device)
    fg, fa = whole_factor(G), whole_factor(A)
    E_ext = precision_eigenvalues(fg, fa, delta, T)
    E = E_ext[:-1, :-1]  # whole factors: no remainder
    P = _dense_precision(G, A, T, delta)
    q = torch.kron(fg.U, fa.U)
    torch.testing.assert_close((q * E.reshape(-1)) @ q.T, P)
    torch.testing.assert_close(dense_kron_covariance(fg.U, fa.U, E), torch.linalg.inv(P))
    torch.testing.assert_close(lowrank_log_det(E_ext, fg, fa), torch.logdet(P))


def test_singular_factors_are_clamped_no_nan(device):
    # rank-1 factors with round-off negative eigenvalues: clamping keeps E >= δ.
    v = torch.tensor([1.0, 1e-9, -1.0], dtype=torch.float64, device=device)
    G = torch.outer(v, v) - 1e-12 * torch.eye(3, dtype=torch.float64, device=device)
    fg = whole_factor(G)
    assert (fg.s >= 0).all()
    E = precision_eigenvalues(fg, fg, 1e-3)
    assert torch.isfinite(E.log().sum())
    assert (E >= 1e-3).all()


def test_whole_factor_rejects_bad_factors():
    with pytest.raises(ValueError, match="non-finite"):
        whole_factor(torch.full((2, 2), float("nan")))


@pytest.mark.parametrize("seed", [0, 1])
def test_sample_covariance_matches_dense(device, seed):
    r, c, n = 3, 2, 40_000
    G, A, _ = _setup(r, c, 2, 3, seed, device)
    fg, fa = whole_factor(G), whole_factor(A)
    w = precision_eigenvalues(fg, fa, 0.5, 2.0).rsqrt()
    sigma = torch.linalg.inv(_dense_precision(G, A, 2.0, 0.5))
    gen = torch.Generator(device=device).manual_seed(seed)
    eps = torch.randn(n, r, c, generator=gen, dtype=torch.float64, device=device)
    s = scale_in_basis(eps, fg, fa, w).reshape(n, -1)
    emp = s.T @ s / n
    # Var of an empirical second moment entry: (Σ_ii Σ_jj + Σ_ij²) / n  ->  6 standard errors.
    d = torch.diagonal(sigma)
    tol = 6 * torch.sqrt((torch.outer(d, d) + sigma**2) / n)
    assert ((emp - sigma).abs() <= tol).all()


def test_log_det_is_differentiable_in_prior():
    G, A, _ = _setup(3, 2, 3, 2, 0, "cpu")
    fg, fa = whole_factor(G), whole_factor(A)
    delta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    ld = lowrank_log_det(precision_eigenvalues(fg, fa, delta), fg, fa)
    (grad,) = torch.autograd.grad(ld, delta)
    sigma = torch.linalg.inv(_dense_precision(G, A, 1.0, 0.7))
    # d/dδ log det P = tr(P⁻¹)
    assert math.isclose(grad.item(), torch.trace(sigma).item(), rel_tol=1e-9)
