"""The streamed Kronecker predictive against dense float64 ``J Σ Jᵀ`` (hypothesis draws shapes and seeds)."""

import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import (
    autograd_block_jacobian,
    dense_kron_covariance,
    dense_precision,
    random_factors,
)

from partialbayes.curvature import KronLaplace, _laplace_projected
from partialbayes.curvature._kfac import precision_eigenvalues, whole_factor
from partialbayes.curvature._laplace_projected import shared_covariances, unshared_covariances
from partialbayes.selection import linear_modules, modules, sparse_kfac

FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
VOCAB, CLASSES = 40, 3


def _psd(n, g):
    x = torch.randn(n, n, generator=g, dtype=torch.float64)
    return x @ x.T


def _basis(r, c, g, prior):
    fg, fa = whole_factor(_psd(r, g)), whole_factor(_psd(c, g) / 5)
    return fg.U, fa.U, precision_eigenvalues(fg, fa, prior)[:-1, :-1]


@FIXTURE_OK
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 12),
    r=st.integers(1, 4),
    cw=st.integers(1, 4),
    n_cls=st.integers(1, 4),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shared_covariances_equal_dense(device, b, t, r, cw, n_cls, bias, seed):
    """Every rotation order (inputs / gradients before or after the token sum), with dropped tokens."""
    g = torch.Generator().manual_seed(seed)
    c = cw + bias
    x = torch.randn(b, t, cw, generator=g, dtype=torch.float64)
    d = torch.randn(n_cls, b, t, r, generator=g, dtype=torch.float64)
    keep = (
        torch.rand(b, t, generator=g) > 0.3
    )  # tokens the logits do not see: δ = 0 for every class
    d = d * keep[:, :, None]
    qg, qa, E = _basis(r, c, g, 0.4)
    E2 = E + 1.7
    xt = torch.cat([x, torch.ones(b, t, 1, dtype=x.dtype)], -1) if bias else x
    J = torch.einsum("kbtr,btc->bkrc", d, xt).reshape(b, n_cls, -1)
    refs = [J @ dense_kron_covariance(qg, qa, e) @ J.mT for e in (E, E2)]
    x, d, qg, qa, E, E2 = (v.to(device) for v in (x, d, qg, qa, E, E2))
    covs = shared_covariances(x, d, qg, qa, bias, [1 / E, 1 / E2], torch.float64)
    for cov, ref in zip(covs, refs, strict=True):
        torch.testing.assert_close(cov.cpu(), ref)
    # the prior grid's path: every prior contracted by one matrix product from the stacked 1 / E
    stacked = torch.stack([1 / E, 1 / E2], -1)
    views = [stacked[..., 0], stacked[..., 1]]
    covs = shared_covariances(x, d, qg, qa, bias, views, torch.float64, stacked)
    for cov, ref in zip(covs, refs, strict=True):
        torch.testing.assert_close(cov.cpu(), ref)
    with patch.object(_laplace_projected, "ROWS_IN_CACHE", 1):  # M formed one row at a time
        covs = shared_covariances(x, d, qg, qa, bias, views, torch.float64, stacked)
    for cov, ref in zip(covs, refs, strict=True):
        torch.testing.assert_close(cov.cpu(), ref)


@FIXTURE_OK
@given(
    b=st.integers(1, 4),
    r=st.integers(1, 5),
    c=st.integers(1, 5),
    n_cls=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_unshared_covariances_equal_dense(device, b, r, c, n_cls, seed):
    """Rank-1 Jacobians ``δ x̃ᵀ``: the contraction that never forms ``M``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, generator=g, dtype=torch.float64)
    d = torch.randn(n_cls, b, r, generator=g, dtype=torch.float64)
    qg, qa, E = _basis(r, c, g, 0.3)
    J = torch.einsum("kbr,bc->bkrc", d, x).reshape(b, n_cls, -1)
    ref = J @ dense_kron_covariance(qg, qa, E) @ J.mT
    xq, dq = (x @ qa).to(device), (d @ qg).to(device)
    (cov,) = unshared_covariances(xq, dq, [(1 / E).to(device)])
    torch.testing.assert_close(cov.cpu(), ref)


MODELS = {
    arch: lambda arch=arch: tiny_model(
        arch, vocab=VOCAB, num_labels=CLASSES, **({"pad_token_id": 0} if arch == "gpt2" else {})
    )
    for arch in ("distilbert", "bert", "gpt2")
}


def _batch(b, length, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # right padding
    ids = torch.randint(1, VOCAB, (b, length), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}


def _fitted(kind, percent, seed, prior, device):
    torch.manual_seed(seed)
    model = MODELS[kind]().double().eval().to(device)
    subset = (
        modules(model, list(linear_modules(model)))
        if percent == 100
        else sparse_kfac(model, percent)
    )
    la = KronLaplace(model, subset, prior_precision=prior)
    factors = random_factors(la, seed)
    la.fit_curvature(factors, map_loss=3.0, n_data=10, n_outputs=CLASSES)
    return model, la, factors


def _dense_cov(la, factors, prior, inputs):
    """``J Σ Jᵀ`` with J by generic reverse mode over the parameters and Σ the dense inverse."""
    J = autograd_block_jacobian(la, inputs).cpu()
    prior_vec = torch.full((len(la.modules),), prior, dtype=torch.float64)
    P = dense_precision(la, factors, prior_vec)
    return J @ torch.linalg.inv(P) @ J.mT


@settings(
    max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
@given(
    kind=st.sampled_from(sorted(MODELS)),
    percent=st.sampled_from([30, 60, 100]),
    b=st.integers(1, 4),
    length=st.integers(1, 7),
    chunk=st.sampled_from([None, 1, 2, 3]),
    prior=st.floats(0.1, 5.0),
    seed=st.integers(0, 1000),
)
def test_logit_mean_cov_equals_dense_on_transformers(
    device, kind, percent, b, length, chunk, prior, seed
):
    """S-KFAC row / column blocks with biases, Conv1D (GPT-2), padded sequences, chunks not dividing B."""
    model, la, factors = _fitted(kind, percent, seed, prior, device)
    batch = {k: v.to(device) for k, v in _batch(b, length, seed).items()}
    f, cov = la.logit_mean_cov(batch, chunk_size=chunk)
    torch.testing.assert_close(f, model(**batch).logits.detach())
    ref = _dense_cov(la, factors, prior, batch)
    torch.testing.assert_close(cov.cpu(), ref, rtol=1e-7, atol=1e-9)


def test_grid_of_priors_in_one_pass_equals_separate_calls():
    _, la, factors = _fitted("gpt2", 60, 3, 1.0, "cpu")
    batch = _batch(3, 6, 3)
    grid = [0.2, 1.0, 7.0]
    priors = [la._resolve_prior(v) for v in grid]
    *_, covs = la._covariances(*la._read(batch), priors, 1.0)
    for v, cov in zip(grid, covs, strict=True):
        la.prior_precision = v
        torch.testing.assert_close(la.logit_mean_cov(batch)[1], cov)
    torch.testing.assert_close(covs[2], _dense_cov(la, factors, 7.0, batch), rtol=1e-7, atol=1e-9)


def test_chunk_size_is_validated():
    _, la, _ = _fitted("bert", 100, 0, 1.0, "cpu")
    batch = _batch(2, 4, 0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            TypeError if isinstance(bad, bool) or not isinstance(bad, int) else ValueError,
            match="chunk_size",
        ):
            la.logit_mean_cov(batch, chunk_size=bad)
