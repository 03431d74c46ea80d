import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.predictive import (
    gaussian_predictive,
    laplace_bridge,
    laplace_bridge_alpha,
    probit,
    probit_binary,
)

from ._refs import gh_sigmoid, probit_sup_error

F64 = torch.float64


def test_probit_sup_error_constant():
    assert 0.0176 < probit_sup_error() < 0.0178


@given(mu=st.floats(-8, 8), var=st.floats(0, 50))
def test_probit_binary_within_known_bound_of_quadrature(mu, var):
    approx = probit_binary(torch.tensor(mu, dtype=F64), torch.tensor(var, dtype=F64)).item()
    exact = gh_sigmoid(mu, var)
    assert abs(approx - exact) <= probit_sup_error() + 1e-9


def test_probit_binary_vectorised_against_quadrature(device):
    mu = torch.linspace(-5, 5, 21, dtype=F64)
    var = torch.linspace(0, 20, 21, dtype=F64)
    m, v = torch.meshgrid(mu, var, indexing="ij")
    out = probit_binary(m.to(device), v.to(device)).cpu()
    ref = torch.tensor([[gh_sigmoid(a, b) for b in var.tolist()] for a in mu.tolist()], dtype=F64)
    err = (out - ref).abs()
    assert err.max() <= probit_sup_error()
    # exact at zero variance and, by symmetry, at zero mean
    torch.testing.assert_close(out[:, 0], torch.sigmoid(mu))
    torch.testing.assert_close(out[10], torch.full((21,), 0.5, dtype=F64))
    # the approximation is much better than the worst case for most inputs
    assert err.mean() < 0.006


@given(seed=st.integers(0, 2**31), c=st.integers(2, 6), b=st.integers(1, 5))
def test_multiclass_probit_formula_and_diag_of_full_cov(seed, c, b):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(b, c, dtype=F64, generator=g) * 3
    a = torch.randn(b, c, c, dtype=F64, generator=g)
    cov = a @ a.mT
    var = cov.diagonal(dim1=-2, dim2=-1)
    expected = np.exp(mu.numpy() / np.sqrt(1 + np.pi / 8 * var.numpy()))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(probit(mu, cov).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(probit(mu, var).numpy(), expected, rtol=1e-12)


@given(mu=st.floats(-6, 6), var=st.floats(0, 20))
def test_multiclass_probit_reduces_to_binary(mu, var):
    # second logit fixed at 0 with zero variance: softmax([k mu, 0]) = sigmoid(k mu)
    m = torch.tensor([[mu, 0.0]], dtype=F64)
    v = torch.tensor([[var, 0.0]], dtype=F64)
    binary = probit_binary(torch.tensor([mu], dtype=F64), torch.tensor([var], dtype=F64))
    torch.testing.assert_close(probit(m, v)[0, 0], binary[0])


def _alpha_to_gaussian(alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Laplace approximation of Dir(alpha) in the softmax basis (Hobbhahn et al., Eq. 8-9)."""
    k = alpha.shape[-1]
    log_a = np.log(alpha)
    mu = log_a - log_a.mean(-1, keepdims=True)
    var = (1 - 2 / k) / alpha + (1 / alpha).sum(-1, keepdims=True) / k**2
    return mu, var


@given(seed=st.integers(0, 2**31), k=st.integers(2, 8), b=st.integers(1, 4))
def test_bridge_inverts_dirichlet_laplace_closed_form(seed, k, b):
    rng = np.random.default_rng(seed)
    alpha = rng.uniform(0.2, 20, size=(b, k))
    mu, var = _alpha_to_gaussian(alpha)
    got = laplace_bridge_alpha(torch.tensor(mu), torch.tensor(var), correct_mean=False)
    np.testing.assert_allclose(got.numpy(), alpha, rtol=1e-9)
    probs = laplace_bridge(torch.tensor(mu), torch.tensor(var), correct_mean=False)
    np.testing.assert_allclose(probs.numpy(), alpha / alpha.sum(-1, keepdims=True), rtol=1e-9)


def _bridge_loop(mu: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """Naive per-class loop with the sum-to-zero correction."""
    k = mu.shape[0]
    one = np.ones(k)
    s = cov @ one
    tot = one @ cov @ one
    mu = mu - s * (one @ mu) / tot
    cov = cov - np.outer(s, s) / tot
    alpha = np.empty(k)
    for i in range(k):
        acc = sum(math.exp(-mu[j]) for j in range(k))
        alpha[i] = (1 - 2 / k + math.exp(mu[i]) * acc / k**2) / cov[i, i]
    return alpha / alpha.sum()


@given(seed=st.integers(0, 2**31), k=st.integers(2, 6))
def test_bridge_sums_to_one_and_matches_loop(seed, k):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(3, k, dtype=F64, generator=g) * 2
    a = torch.randn(3, k, k, dtype=F64, generator=g)
    cov = a @ a.mT + 0.1 * torch.eye(k, dtype=F64)
    p = laplace_bridge(mu, cov)
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=F64))
    assert bool((p > 0).all())
    for i in range(3):
        np.testing.assert_allclose(
            p[i].numpy(), _bridge_loop(mu[i].numpy(), cov[i].numpy()), rtol=1e-10
        )


def test_bridge_devices_and_large_means_stay_finite(device):
    mu = torch.tensor([[300.0, -300.0, 0.0]], dtype=F64, device=device)
    var = torch.ones(1, 3, dtype=F64, device=device)
    p = laplace_bridge(mu, var, correct_mean=False)
    assert bool(torch.isfinite(p).all())
    torch.testing.assert_close(p.sum(-1).cpu(), torch.ones(1, dtype=F64))


@pytest.mark.peers
def test_bridge_and_probit_match_laplace_torch():
    pytest.importorskip("laplace")
    from laplace.baselaplace import BaseLaplace

    class _Stub:
        _device = torch.device("cpu")
        _dtype = F64

        def __init__(self, mu, cov):
            self.mu, self.cov = mu, cov

        def _glm_predictive_distribution(self, x, joint=False):
            return self.mu.clone(), self.cov.clone()

    g = torch.Generator().manual_seed(0)
    mu = torch.randn(7, 4, dtype=F64, generator=g)
    a = torch.randn(7, 4, 4, dtype=F64, generator=g)
    cov = a @ a.mT + 0.1 * torch.eye(4, dtype=F64)
    stub = _Stub(mu, cov)
    for link, ours in (("probit", probit(mu, cov)), ("bridge", laplace_bridge(mu, cov))):
        theirs = BaseLaplace._glm_forward_call(stub, None, "classification", link_approx=link)
        torch.testing.assert_close(ours, theirs)


def test_gaussian_predictive_adds_noise(device):
    m = torch.randn(4, 2, dtype=F64, device=device)
    v = torch.rand(4, 2, dtype=F64, device=device)
    mean, var = gaussian_predictive(m, v, 0.5)
    torch.testing.assert_close(var, v + 0.5)
    assert mean is m or torch.equal(mean, m)
    a = torch.randn(4, 2, 2, dtype=F64, device=device)
    cov = a @ a.mT
    _, pv = gaussian_predictive(m, cov, torch.tensor([0.1, 0.2], dtype=F64, device=device))
    torch.testing.assert_close(
        pv, cov + torch.diag(torch.tensor([0.1, 0.2], dtype=F64, device=device))
    )
