import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.predictive import ece, mce, reliability

F64 = torch.float64


def _naive(p, y, n_bins, binning):
    conf, pred = p.max(1), p.argmax(1)
    correct = (pred == y).astype(float)
    n = len(conf)
    if binning == "equal_width":
        members = []
        for k in range(n_bins):
            lo, hi = k / n_bins, (k + 1) / n_bins
            members.append(
                [
                    i
                    for i in range(n)
                    if (conf[i] > lo or (k == 0 and conf[i] >= lo)) and conf[i] <= hi
                ]
            )
    else:
        order = np.argsort(conf, kind="stable")
        members = [list(ch) for ch in np.array_split(order, n_bins)]
    out_conf, out_acc, out_cnt = [], [], []
    for m in members:
        out_cnt.append(len(m))
        out_conf.append(np.mean(conf[m]) if m else 0.0)
        out_acc.append(np.mean(correct[m]) if m else 0.0)
    cnt = np.array(out_cnt)
    gaps = np.abs(np.array(out_acc) - np.array(out_conf))
    return np.array(out_conf), np.array(out_acc), cnt, (cnt * gaps).sum() / n, gaps[cnt > 0].max()


@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 80),
    c=st.integers(2, 5),
    n_bins=st.integers(1, 25),
    binning=st.sampled_from(["equal_width", "equal_mass"]),
    temp=st.sampled_from([0.3, 1.0, 4.0]),
)
def test_reliability_matches_naive_loop(seed, n, c, n_bins, binning, temp):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, c, dtype=F64, generator=g) * temp, -1)
    y = torch.randint(0, c, (n,), generator=g)
    r = reliability(p, y, n_bins=n_bins, binning=binning)
    conf, acc, cnt, e, m = _naive(p.numpy(), y.numpy(), n_bins, binning)
    np.testing.assert_array_equal(r.count.numpy(), cnt)
    np.testing.assert_allclose(r.confidence.numpy(), conf, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(r.accuracy.numpy(), acc, rtol=1e-12, atol=1e-15)
    assert ece(p, y, n_bins=n_bins, binning=binning).item() == pytest.approx(e, abs=1e-12)
    assert mce(p, y, n_bins=n_bins, binning=binning).item() == pytest.approx(m, abs=1e-12)
    assert r.edges.shape == (n_bins + 1,)


def test_equal_width_edges_and_ties(device):
    # confidences exactly on a bin edge go to the lower bin, (lo, hi]
    p = torch.tensor([[0.5, 0.5], [0.75, 0.25], [1.0, 0.0], [0.6, 0.4]], dtype=F64, device=device)
    y = torch.tensor([0, 0, 0, 1], device=device)
    r = reliability(p, y, n_bins=4, binning="equal_width")
    assert r.count.tolist() == [0, 1, 2, 1]
    torch.testing.assert_close(r.edges.cpu(), torch.tensor([0, 0.25, 0.5, 0.75, 1.0], dtype=F64))
    torch.testing.assert_close(r.confidence.cpu(), torch.tensor([0, 0.5, 0.675, 1.0], dtype=F64))
    torch.testing.assert_close(r.accuracy.cpu(), torch.tensor([0, 1.0, 0.5, 1.0], dtype=F64))


@pytest.mark.parametrize("binning", ["equal_width", "equal_mass"])
def test_ece_near_zero_on_calibrated_data_and_large_when_not(binning, device):
    g = torch.Generator().manual_seed(0)
    n, c, n_bins = 20_000, 3, 20
    e = torch.empty(n, c, dtype=F64).exponential_(generator=g)
    p = e / e.sum(-1, keepdim=True)  # Dirichlet(1, ..., 1), drawn from the seeded generator
    y = torch.multinomial(p, 1, generator=g).squeeze(1)
    p, y = p.to(device), y.to(device)
    # each bin mean of Bernoulli(conf) deviates by <= 0.5/sqrt(n_b); summed with weights n_b/N
    # this is <= 0.5 sqrt(n_bins / N) in expectation; allow twice that
    bound = 2 * 0.5 * math.sqrt(n_bins / n)
    assert ece(p, y, n_bins=n_bins, binning=binning).item() < bound
    sharp = p**4 / (p**4).sum(-1, keepdim=True)  # overconfident
    assert ece(sharp, y, n_bins=n_bins, binning=binning).item() > 0.1
    r = reliability(sharp, y, n_bins=n_bins, binning=binning)
    populated = r.count >= 200  # per-bin accuracy then has standard error <= 0.036
    assert bool((r.accuracy[populated] <= r.confidence[populated] + 0.15).all())
    assert r.gaps[populated].mean() > 0.1


def test_equal_mass_bins_balanced():
    p, y = torch.softmax(torch.randn(103, 4, dtype=F64), -1), torch.randint(0, 4, (103,))
    r = reliability(p, y, n_bins=10)
    assert sorted(r.count.tolist()) == [10] * 7 + [11] * 3
    assert bool((r.edges[1:] >= r.edges[:-1]).all())
