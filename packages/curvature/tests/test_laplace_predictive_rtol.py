"""``KronLaplace(predictive_rtol=ε)``: the truncated predictive against the exact one and dense references.

Factors with geometrically decaying spectra make the truncation drop pairs with non-zero curvature, so the
``1 + ε`` bound is exercised, not only the exact zeros of rank-deficient factors.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset
from test_laplace_predictive import MODELS, _batch, _dense_cov

from partialbayes.curvature import KronLaplace
from partialbayes.curvature._laplace_projected import frobenius_products
from partialbayes.selection import linear_modules, modules, sparse_kfac

SETTINGS = settings(
    max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)


def _decaying(n, g, decades):
    """PSD ``[n, n]`` with eigenvalues ``10^0 … 10^-decades`` in a random basis."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.logspace(0, -decades, n, dtype=torch.float64)) @ q.T


def _factors(la, seed, scale):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in la.modules:
        r, _, c = la._dims[m]
        out[m] = SimpleNamespace(G=_decaying(r, g, 4) * scale, A=_decaying(c, g, 3))
    return out


def _fit(la, factors):
    return la.fit_curvature(factors, map_loss=3.0, n_data=10, n_outputs=3)


def _check_bound(approx, exact, rtol, rounding=1e-10):
    """``exact ≤ approx``, ``approx − exact`` PSD-bounded: ``|Δ_kl| ≤ ε √(v_k v_l)`` (up to rounding)."""
    v = torch.diagonal(exact, dim1=-2, dim2=-1)
    scale = (v[..., :, None] * v[..., None, :]).sqrt()
    bound = (rtol + rounding) * scale + 1e-10 * v.amax()
    diff = approx - exact
    assert bool((diff.abs() <= bound).all()), float((diff.abs() - bound).max())
    dv = torch.diagonal(diff, dim1=-2, dim2=-1)
    assert bool((dv >= -rounding * v - 1e-10 * v.amax()).all())  # never below the exact variance


@SETTINGS
@given(
    n=st.integers(1, 9),
    r=st.integers(1, 5),
    cw=st.integers(1, 5),
    n_cls=st.integers(1, 3),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_frobenius_products_equal_formed_jacobians(device, n, r, cw, n_cls, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cw, generator=g, dtype=torch.float64)
    d = torch.randn(n_cls, n, r, generator=g, dtype=torch.float64)
    xt = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1) if bias else x
    jac = torch.einsum("ktr,tc->krc", d, xt).reshape(n_cls, -1)
    got = frobenius_products(x.to(device), d.to(device), bias)
    torch.testing.assert_close(got.cpu(), jac @ jac.T)


@SETTINGS
@given(
    kind=st.sampled_from(sorted(MODELS)),
    percent=st.sampled_from([40, 100]),
    b=st.integers(1, 3),
    length=st.integers(1, 6),
    prior=st.floats(0.05, 3.0),
    scale=st.sampled_from([1.0, 100.0]),
    rtol=st.sampled_from([1e-3, 0.1, 0.5]),
    seed=st.integers(0, 1000),
)
def test_truncated_predictive_within_rtol_on_transformers(
    device, kind, percent, b, length, prior, scale, rtol, seed
):
    """Padded sequences, S-KFAC row / column blocks with biases, Conv1D: exact ≤ approx ≤ (1 + ε) exact."""
    torch.manual_seed(seed)
    model = MODELS[kind]().double().eval().to(device)
    subset = (
        modules(model, list(linear_modules(model)))
        if percent == 100
        else sparse_kfac(model, percent)
    )
    factors = _factors(KronLaplace(model, subset), seed, scale)
    exact = _fit(KronLaplace(model, subset, prior_precision=prior), factors)
    approx = _fit(KronLaplace(model, subset, prior_precision=prior, predictive_rtol=rtol), factors)
    batch = {k: v.to(device) for k, v in _batch(b, length, seed).items()}
    f, cov = approx.logit_mean_cov(batch, chunk_size=2)
    f_exact, cov_exact = exact.logit_mean_cov(batch)
    torch.testing.assert_close(f, f_exact)
    torch.testing.assert_close(cov_exact.cpu(), _dense_cov(exact, factors, prior, batch))
    _check_bound(cov, cov_exact, rtol)


def test_unshared_layers_grid_and_tiny_rtol():
    """One position per example (an MLP with a Conv1D), a grid of priors, and ε → 0 giving the exact result."""
    model = TinyNet(0)
    subset = kron_subset(model)
    factors = _factors(KronLaplace(model, subset), 1, 30.0)
    x, _ = classification_data(7, 2)
    grid = [0.05, 0.5, 4.0]
    exact = _fit(KronLaplace(model, subset), factors)
    for rtol in (1e-12, 0.05, 0.3):
        approx = _fit(KronLaplace(model, subset, predictive_rtol=rtol), factors)
        *_, covs = approx._covariances(
            *approx._read(x), [approx._resolve_prior(v) for v in grid], 1.0
        )
        *_, refs = exact._covariances(*exact._read(x), [exact._resolve_prior(v) for v in grid], 1.0)
        for cov, ref in zip(covs, refs, strict=True):
            _check_bound(cov, ref, rtol)
            if rtol == 1e-12:
                torch.testing.assert_close(cov, ref, rtol=1e-9, atol=1e-12)
    # a float32 posterior: products in float32, the final combination in float64
    la32 = KronLaplace(model.float(), subset, dtype=torch.float32, predictive_rtol=0.05)
    _fit(la32, factors)
    _, cov32 = la32.logit_mean_cov(x.float())
    model.double()
    _check_bound(cov32.double(), exact.logit_mean_cov(x)[1], 0.05, rounding=1e-4)
    # the truncation really drops directions here (else the bound above would be vacuous)
    rtol = 0.3
    approx = _fit(KronLaplace(model, subset, predictive_rtol=rtol), factors)
    _, cov = approx.logit_mean_cov(x)
    assert not torch.allclose(cov, exact.logit_mean_cov(x)[1], rtol=1e-9, atol=0)


def test_predictive_rtol_validated_and_saved(tmp_path):
    model = TinyNet(0)
    subset = kron_subset(model)
    for bad in (-0.1, 1.0, True, "0.1", float("nan")):
        with pytest.raises(
            TypeError if isinstance(bad, (bool, str)) else ValueError, match="predictive_rtol"
        ):
            KronLaplace(model, subset, predictive_rtol=bad)
    la = _fit(
        KronLaplace(model, subset, predictive_rtol=0.2),
        _factors(KronLaplace(model, subset), 0, 5.0),
    )
    la.save(tmp_path / "la.safetensors")
    back = KronLaplace.load(tmp_path / "la.safetensors", model)
    assert back.predictive_rtol == 0.2
    x, _ = classification_data(4, 0)
    torch.testing.assert_close(back.logit_mean_cov(x)[1], la.logit_mean_cov(x)[1])


def test_predictive_rtol_set_after_a_predictive_is_used(device):
    """The memoised blocks follow ``predictive_rtol`` (a public attribute) when it changes after a call."""
    torch.manual_seed(0)
    model = MODELS["bert"]().double().eval().to(device)
    subset = modules(model, list(linear_modules(model)))
    factors = _factors(KronLaplace(model, subset), 0, 100.0)
    la = _fit(KronLaplace(model, subset, prior_precision=0.5), factors)
    fresh = _fit(KronLaplace(model, subset, prior_precision=0.5, predictive_rtol=0.5), factors)
    batch = {k: v.to(device) for k, v in _batch(2, 4, 0).items()}
    _, exact = la.logit_mean_cov(batch)
    la.predictive_rtol = 0.5
    _, got = la.logit_mean_cov(batch)
    _, want = fresh.logit_mean_cov(batch)
    assert not torch.equal(want, exact)  # the truncation changes the result here
    assert torch.equal(got, want)
