import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import mannwhitneyu, norm

from partialbayes.predictive import (
    accuracy,
    apply_temperature,
    auroc,
    brier,
    fit_temperature,
    gaussian_nll,
    nll,
)

F64 = torch.float64


def _probs(seed, n, c, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, c, dtype=F64, generator=g) * 2, -1)
    y = torch.randint(0, c, (n,), generator=g)
    return p.to(device), y.to(device)


@given(seed=st.integers(0, 2**31), n=st.integers(1, 40), c=st.integers(2, 6))
def test_scores_against_numpy(seed, n, c):
    p, y = _probs(seed, n, c)
    pn, yn = p.numpy(), y.numpy()
    onehot = np.eye(c)[yn]
    np.testing.assert_allclose(accuracy(p, y).item(), np.mean(pn.argmax(1) == yn))
    np.testing.assert_allclose(nll(p, y).item(), -np.mean(np.log(pn[np.arange(n), yn])), rtol=1e-12)
    np.testing.assert_allclose(
        nll(p, y, reduction="none").numpy(), -np.log(pn[np.arange(n), yn]), rtol=1e-12
    )
    np.testing.assert_allclose(
        brier(p, y).item(), np.mean(((pn - onehot) ** 2).sum(1)), rtol=1e-10, atol=1e-14
    )
    np.testing.assert_allclose(
        brier(p, y, reduction="sum").item(), ((pn - onehot) ** 2).sum(), rtol=1e-10, atol=1e-14
    )


def test_scores_on_device_and_zero_probability(device):
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=F64, device=device)
    y = torch.tensor([1, 0], device=device)
    out = nll(p, y, reduction="none").cpu()
    assert math.isfinite(out[0].item())
    assert out[0].item() > 700
    assert brier(p, y).item() == pytest.approx((2.0 + 0.5) / 2)
    assert accuracy(p, y).item() == pytest.approx(0.5)


@given(seed=st.integers(0, 2**31), n=st.integers(1, 30))
def test_gaussian_nll_against_scipy(seed, n):
    rng = np.random.default_rng(seed)
    m, t = rng.normal(size=n), rng.normal(size=n)
    v = rng.uniform(0.05, 3, size=n)
    ours = gaussian_nll(torch.tensor(m), torch.tensor(v), torch.tensor(t), reduction="none")
    np.testing.assert_allclose(ours.numpy(), -norm.logpdf(t, m, np.sqrt(v)), rtol=1e-12)
    np.testing.assert_allclose(
        gaussian_nll(torch.tensor(m), 0.7, torch.tensor(t)).item(),
        -norm.logpdf(t, m, np.sqrt(0.7)).mean(),
        rtol=1e-12,
    )


def _auroc_pairs(s, pos):
    sp, sn = s[pos], s[~pos]
    gt = (sp[:, None] > sn[None, :]).sum()
    eq = (sp[:, None] == sn[None, :]).sum()
    return (gt + 0.5 * eq) / (len(sp) * len(sn))


@given(
    seed=st.integers(0, 2**31),
    n=st.integers(2, 60),
    levels=st.sampled_from([2, 3, 5, 1000]),
)
def test_auroc_equals_pairwise_formula_with_ties(seed, n, levels):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, levels, size=n).astype(np.float64)  # few levels: many ties
    pos = rng.random(n) < 0.4
    pos[0], pos[1] = True, False
    ours = auroc(torch.tensor(s), torch.tensor(pos)).item()
    assert ours == pytest.approx(_auroc_pairs(s, pos), abs=1e-12)
    u = mannwhitneyu(s[pos], s[~pos]).statistic
    assert ours == pytest.approx(u / (pos.sum() * (~pos).sum()), abs=1e-12)


def test_auroc_known_values(device):
    s = torch.tensor([0.1, 0.4, 0.35, 0.8], dtype=F64, device=device)
    y = torch.tensor([0, 0, 1, 1], device=device)
    assert auroc(s, y).item() == pytest.approx(0.75)
    assert auroc(torch.ones(4, dtype=F64, device=device), y).item() == pytest.approx(0.5)
    assert auroc(s, y.bool()).item() == auroc(-s, ~y.bool()).item()


@pytest.mark.peers
def test_auroc_matches_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    s = np.round(rng.normal(size=500), 1)
    pos = rng.random(500) < 0.3
    assert auroc(torch.tensor(s), torch.tensor(pos)).item() == pytest.approx(
        metrics.roc_auc_score(pos, s), abs=1e-12
    )


@pytest.mark.parametrize("t_star", [0.5, 2.5])
def test_temperature_scaling_recovers_planted_temperature(t_star, device):
    g = torch.Generator().manual_seed(int(t_star * 10))
    n, c = 20_000, 5
    z = torch.randn(n, c, dtype=F64, generator=g) * 3
    y = torch.multinomial(torch.softmax(z / t_star, -1), 1, generator=g).squeeze(1)
    t = fit_temperature(z.to(device), y.to(device)).cpu()
    assert t.dtype == F64
    # standard error of the MLE of log T from the observed Fisher information

    def summed_nll(log_t):
        return torch.nn.functional.cross_entropy(z * torch.exp(-log_t), y, reduction="sum")

    info = torch.autograd.functional.hessian(summed_nll, t.log().reshape(()))
    se = float(info) ** -0.5
    assert abs(math.log(float(t)) - math.log(t_star)) <= 5 * se
    # the fit is a minimum: nudging T either way does not improve the NLL
    base = summed_nll(t.log())
    for delta in (-0.01, 0.01):
        assert summed_nll(t.log() + delta) >= base
    torch.testing.assert_close(apply_temperature(z, t), z / t)


def test_temperature_scaling_errors():
    z = torch.randn(10, 3)
    y = torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="labels must lie in"):
        fit_temperature(z, torch.full((10,), 3))
    with pytest.raises(ValueError, match=r"logits must have shape \[N, C\]"):
        fit_temperature(z[:, :1], torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="init"):
        fit_temperature(z, y, init=0.0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        apply_temperature(z, -1.0)
    # perfectly separable: the NLL keeps falling as T -> 0
    sep = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    with pytest.raises(ValueError, match="separable"):
        fit_temperature(sep, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no information"):
        fit_temperature(sep, torch.tensor([1, 0]))
    # one mistake makes the optimum finite again
    t = fit_temperature(torch.cat([sep, sep[:1]]), torch.tensor([0, 1, 1]))
    assert 0 < float(t) < 100
