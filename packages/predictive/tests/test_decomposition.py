import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.predictive import (
    average_softmax,
    decompose_classification,
    decompose_regression,
    log_average_softmax,
)

F64 = torch.float64


def _np_entropy(p):
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)


@given(
    seed=st.integers(0, 2**31),
    s=st.integers(1, 8),
    b=st.integers(1, 5),
    c=st.integers(2, 6),
    scale=st.sampled_from([0.1, 1.0, 10.0, 100.0]),
)
def test_decomposition_identities_against_numpy(seed, s, b, c, scale):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(s, b, c, dtype=F64, generator=g) * scale
    u = decompose_classification(f)
    p = torch.softmax(f, -1).numpy()
    pbar = p.mean(0)
    np.testing.assert_allclose(average_softmax(f).numpy(), pbar, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(u.total.numpy(), _np_entropy(pbar), atol=1e-12)
    np.testing.assert_allclose(u.aleatoric.numpy(), _np_entropy(p).mean(0), atol=1e-12)
    np.testing.assert_allclose((u.aleatoric + u.epistemic).numpy(), u.total.numpy(), atol=1e-10)
    assert bool((u.epistemic >= 0).all())
    assert bool((u.total <= math.log(c) + 1e-12).all())
    for t in (u.total, u.aleatoric, u.epistemic):
        assert t.shape == (b,)
        assert bool(torch.isfinite(t).all())


@given(seed=st.integers(0, 2**31), s=st.integers(1, 6), c=st.integers(2, 5))
def test_epistemic_zero_when_samples_agree(seed, s, c):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(1, 3, c, dtype=F64, generator=g).expand(s, 3, c)
    # logits that differ by a per-sample constant give the same softmax
    f = f + torch.randn(s, 1, 1, dtype=F64, generator=g)
    u = decompose_classification(f)
    torch.testing.assert_close(u.epistemic, torch.zeros(3, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(u.total, u.aleatoric)


def test_mutual_information_of_disagreeing_point_masses(device):
    # two confident samples that disagree: total = log 2, aleatoric ~ 0, epistemic ~ log 2
    f = torch.tensor([[[1000.0, 0.0]], [[0.0, 1000.0]]], dtype=F64, device=device)
    u = decompose_classification(f)
    torch.testing.assert_close(u.total.cpu(), torch.tensor([math.log(2)], dtype=F64))
    torch.testing.assert_close(u.epistemic.cpu(), torch.tensor([math.log(2)], dtype=F64))
    assert u.aleatoric.item() == 0.0
    lp = log_average_softmax(f)
    assert bool(torch.isfinite(lp).all())


def test_log_average_softmax_stays_finite_where_probs_underflow(device):
    f = torch.tensor([[[0.0, -1e4]], [[0.0, -2e4]]], dtype=F64, device=device)
    lp = log_average_softmax(f).cpu()
    torch.testing.assert_close(lp[0, 1], torch.tensor(-1e4 - math.log(2), dtype=F64))


@given(seed=st.integers(0, 2**31), s=st.integers(1, 10), b=st.integers(1, 4))
def test_regression_law_of_total_variance(seed, s, b):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(s, b))
    v = rng.uniform(0.1, 2, size=(s, b))
    u = decompose_regression(torch.tensor(m), torch.tensor(v))
    # moments of the mixture (1/S) sum N(m_s, v_s), from E[y^2] - E[y]^2
    ey = m.mean(0)
    ey2 = (v + m**2).mean(0)
    np.testing.assert_allclose(u.total.numpy(), ey2 - ey**2, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(u.aleatoric.numpy(), v.mean(0))
    np.testing.assert_allclose(u.epistemic.numpy(), m.var(0), atol=1e-12)
    homo = decompose_regression(torch.tensor(m), 0.3)
    np.testing.assert_allclose(homo.aleatoric.numpy(), np.full(b, 0.3))
    if s > 1 and np.ptp(m, axis=0).min() > 0:
        assert bool((homo.epistemic > 0).all())


def test_decomposition_errors():
    with pytest.raises(ValueError, match="logit_samples"):
        decompose_classification(torch.tensor([[[0.0, math.nan]]]))
    with pytest.raises(ValueError, match=r"\[S, \.\.\., C\]"):
        decompose_classification(torch.zeros(3))
    with pytest.raises(ValueError, match="var_samples must be non-negative"):
        decompose_regression(torch.zeros(2, 3), torch.full((2, 3), -1.0))
    with pytest.raises(ValueError, match="does not broadcast"):
        decompose_regression(torch.zeros(2, 3), torch.ones(4))
