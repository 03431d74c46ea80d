import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.swag._sample import swag_sample


def assert_close(actual, expected, rtol=1e-7, atol=1e-12):
    """numpy's assert_allclose on tensors (torch.testing imports torch.distributed: slow to import)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


def _problem(d, k, seed, device):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=g, dtype=torch.float64).to(device)
    var = torch.rand(d, generator=g, dtype=torch.float64).to(device) + 0.1
    dev = torch.randn(d, k, generator=g, dtype=torch.float64).to(device)
    return mean, var, dev


@given(d=st.integers(1, 5), k=st.integers(2, 6), seed=st.integers(0, 2**16), low_rank=st.booleans())
def test_sample_mean_and_covariance_match_swag_covariance(d, k, seed, low_rank):
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        mean, var, dev = _problem(d, k, seed, device)
        scale = 0.7
        n = 20_000
        g = torch.Generator(device=device).manual_seed(seed + 1)
        samples = swag_sample(
            mean, var, dev if low_rank else None, n_samples=n, scale=scale, generator=g
        )
        assert samples.shape == (n, d)
        if low_rank:
            cov = scale * (0.5 * torch.diag(var) + dev @ dev.T / (2 * (k - 1)))
        else:
            cov = scale * torch.diag(var)
        cov = cov.cpu().numpy()
        x = samples.cpu().numpy()
        # Mean: standard error sqrt(Σ_ii / n); covariance entries of a Gaussian: sqrt((Σ_ij² + Σ_ii Σ_jj)/n).
        se_mean = np.sqrt(np.diag(cov) / n)
        assert np.all(np.abs(x.mean(0) - mean.cpu().numpy()) < 6 * se_mean)
        se_cov = np.sqrt((cov**2 + np.outer(np.diag(cov), np.diag(cov))) / n)
        emp = np.cov(x, rowvar=False).reshape(d, d)
        assert np.all(np.abs(emp - cov) < 6 * se_cov + 1e-12)


@given(d=st.integers(1, 5), k=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_sample_is_the_documented_affine_map_of_z1_then_z2(d, k, seed):
    mean, var, dev = _problem(d, k, seed, "cpu")
    out = swag_sample(
        mean, var, dev, n_samples=3, scale=2.0, generator=torch.Generator().manual_seed(seed)
    )
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(3, d, generator=g, dtype=torch.float64)
    z2 = torch.randn(3, k, generator=g, dtype=torch.float64)
    expected = mean + math.sqrt(2.0) * (
        var.sqrt() * z1 / math.sqrt(2) + z2 @ dev.T / math.sqrt(2 * (k - 1))
    )
    assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_same_seed_same_sample_and_single_sample_shape(device):
    mean, var, dev = _problem(4, 3, 0, device)
    a = swag_sample(mean, var, dev, generator=torch.Generator(device=device).manual_seed(5))
    b = swag_sample(mean, var, dev, generator=torch.Generator(device=device).manual_seed(5))
    c = swag_sample(mean, var, dev, generator=torch.Generator(device=device).manual_seed(6))
    assert a.shape == (4,)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_scale_zero_returns_the_mean(device):
    mean, var, dev = _problem(4, 3, 0, device)
    assert_close(swag_sample(mean, var, dev, scale=0.0), mean)
