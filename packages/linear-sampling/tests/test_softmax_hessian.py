"""The softmax Hessian as O(C) products equals the dense ``[n, C, C]`` blocks it replaced (issue #23).

``B = diag(p) − p pᵀ + jitter·I`` is never formed; every product is checked here against the dense
float64 block of the previous implementation, including near-one-hot probabilities and tiny jitters.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    effective_dimension,
    linearised_targets,
    posterior_mean,
    softmax_hessian,
)

F64 = torch.float64
CASES = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def dense_block(logits, jitter):
    """The previous implementation's ``[n, m, m]`` blocks (symmetrised), from the logits."""
    p = logits.softmax(-1)
    eye = torch.eye(logits.shape[1], dtype=logits.dtype, device=logits.device)
    hess = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1) + jitter * eye
    return 0.5 * (hess + hess.transpose(1, 2))


def draw(n, m, seed, scale, device):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(n, m, generator=g, dtype=F64)).to(device), g


@CASES
@given(
    n=st.integers(1, 4),
    m=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.1, 1.0, 8.0, 60.0]),  # 60: near one-hot (entries below 1e-20)
    jitter=st.sampled_from([1e-8, 1e-6, 1e-2, 1.0]),
)
def test_products_equal_the_dense_blocks(device, n, m, seed, scale, jitter):
    logits, g = draw(n, m, seed, scale, device)
    b = dense_block(logits, jitter)
    noise = softmax_hessian(logits, jitter=jitter)
    idx = torch.arange(n, device=device)
    v = torch.randn(n, m, 3, generator=g, dtype=F64).to(device)
    # entries are differences of terms up to max(p) + jitter: round-off is relative to that scale
    norm = (logits.softmax(-1).amax(1) + jitter).reshape(n, 1, 1)
    torch.testing.assert_close(noise.apply(idx, v), b @ v, rtol=0, atol=1e-14)
    eye = torch.eye(m, dtype=F64, device=device).expand(n, m, m)
    s = noise.apply_sqrt(idx, eye)  # the square root as a matrix
    assert bool(((s @ s.transpose(1, 2) - b).abs() <= 1e-13 * norm).all())
    # the inverse transposed square root undoes Sᵀ, so S⁻ᵀ ε ~ N(0, B⁻¹) for ε ~ N(0, I)
    back = noise.apply_inv_sqrt_t(idx, s.transpose(1, 2) @ v)
    assert bool(((back - v).abs() <= 1e-9 * v.abs().amax()).all())
    # B⁻¹ by Sherman–Morrison: a small residual relative to ‖B‖‖x‖ (B has condition ~ 1/jitter)
    x = noise.solve(idx, v)
    res = (b @ x - v).norm(dim=1)
    assert bool((res <= 1e-12 * norm[:, 0] * x.norm(dim=1) + 1e-13 * v.norm(dim=1)).all())
    logdet = torch.linalg.slogdet(b)[1].sum()
    torch.testing.assert_close(noise.logdet(n, m), logdet, rtol=1e-7, atol=1e-7)


@CASES
@given(n=st.integers(2, 8), m=st.integers(2, 5), d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_solves_match_the_dense_blocks(device, n, m, d, seed):
    logits, g = draw(n, m, seed, 3.0, device)
    phi = torch.randn(n, m, d, generator=g, dtype=F64).to(device)
    y = torch.randn(n, m, generator=g, dtype=F64).to(device)
    feats, prior, alpha = Features.dense(phi), Prior(torch.tensor(0.8, dtype=F64)), 0.8
    noise, b = softmax_hessian(logits, jitter=1e-4), dense_block(logits, 1e-4)
    eye = torch.eye(d, dtype=F64, device=device)
    h = torch.einsum("nmd,nmk,nke->de", phi, b, phi) + alpha * eye
    mean = torch.linalg.solve(h, torch.einsum("nmd,nmk,nk->d", phi, b, y))
    torch.testing.assert_close(posterior_mean(feats, y, noise, prior).mean, mean)
    z = torch.randn(d, 4, generator=g, dtype=F64).to(device)
    gamma = (z * (torch.einsum("nmd,nmk,nke->de", phi, b, phi) @ z)).sum() / 4
    torch.testing.assert_close(effective_dimension(feats, noise, prior, z), gamma.reshape(1))
    labels = torch.randint(0, m, (n,), generator=g).to(device)
    theta = torch.randn(d, generator=g, dtype=F64).to(device)
    resid = torch.nn.functional.one_hot(labels, m) - logits.softmax(-1)
    targets = phi @ theta + torch.linalg.solve(b, resid)
    got = linearised_targets(feats, theta, logits, labels, noise)
    torch.testing.assert_close(got, targets, rtol=1e-8, atol=1e-8)


def test_float32_logits_and_operands():
    logits = 20 * torch.randn(3, 50_000, generator=torch.Generator().manual_seed(0))
    noise = softmax_hessian(logits)  # float32 logits: probabilities are kept in float64
    assert noise.value.dtype == F64
    assert noise.to(torch.float32, torch.device("cpu")) is noise
    e = torch.randn(3, 50_000, 2, generator=torch.Generator().manual_seed(1))
    out = noise.apply_sqrt(torch.arange(3), e)
    assert out.dtype == torch.float32
    ref = noise.apply_sqrt(torch.arange(3), e.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_bad_probabilities_and_jitter():
    p = torch.tensor([[0.5, 0.5]], dtype=F64)
    with pytest.raises(ValueError, match="give jitter exactly when"):
        NoisePrecision(p)
    with pytest.raises(ValueError, match="give jitter exactly when"):
        NoisePrecision(torch.tensor(1.0), jitter=1e-3)
    with pytest.raises(ValueError, match="jitter must be a finite number > 0"):
        NoisePrecision(p, jitter=0.0)
    with pytest.raises(ValueError, match="rows summing to one"):
        NoisePrecision(torch.tensor([[0.5, 0.7]], dtype=F64), jitter=1e-3)
    with pytest.raises(ValueError, match="rows summing to one"):
        NoisePrecision(torch.tensor([[1.5, -0.5]], dtype=F64), jitter=1e-3)
    with pytest.raises(ValueError, match=r"expected \[\], \[2\] or \[2, 3\]"):
        softmax_hessian(torch.zeros(1, 3)).check(2, 3)
