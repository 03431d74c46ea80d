import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.selection import linear_modules, max_operator_norm, min_operator_norm
from partialbayes.selection._norms import (
    operator_norms,
    spectral_norm_gram,
    spectral_norm_power,
    spectral_norm_svd,
)
from partialbayes.selection.internal import rank_by_operator_norm


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 4),
    n=st.integers(1, 9),
    m=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_svd_matches_numpy(batch, n, m, seed, device):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(batch, n, m, generator=g, dtype=torch.float64)
    got = spectral_norm_svd(w.to(device)).cpu()
    ref = np.array([np.linalg.norm(x, 2) for x in w.numpy()])
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12)
    gram = spectral_norm_gram(w.to(device)).cpu()
    np.testing.assert_allclose(gram.numpy(), ref, rtol=1e-12)


def matrix_with_gap(n, m, gap, g):
    """Random (n x m) matrix whose top singular value is `gap` times the second."""
    r = min(n, m)
    u, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    s = torch.sort(torch.rand(r, generator=g, dtype=torch.float64) + 0.1, descending=True).values
    if r > 1:
        s[0] = s[1] * gap
    return u @ torch.diag(s) @ v.T


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 10),
    m=st.integers(1, 10),
    gap=st.floats(1.2, 5.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_power_iteration_matches_svd(n, m, gap, seed, device):
    g = torch.Generator().manual_seed(seed)
    w = torch.stack([matrix_with_gap(n, m, gap, g) for _ in range(3)]).to(device)
    power = spectral_norm_power(w, n_iter=2000, tol=1e-14)
    exact = spectral_norm_svd(w)
    torch.testing.assert_close(power, exact, rtol=1e-9, atol=0)
    assert bool((power <= exact * (1 + 1e-12)).all())  # ||W v|| with |v| = 1 is a lower bound


def test_operator_norms_gpt2_conv1d(gpt2):
    mods = linear_modules(gpt2)
    model = copy.deepcopy(gpt2).double()
    exact = operator_norms(model, method="svd")
    power = operator_norms(model, method="power", n_iter=1000, tol=1e-10)
    gram = operator_norms(model, method="gram")
    assert list(exact) == list(mods)
    for name, mod in mods.items():
        ref = np.linalg.norm(mod.weight.detach().double().numpy(), 2)
        assert exact[name] == pytest.approx(ref, rel=1e-12)
        assert power[name] == pytest.approx(ref, rel=1e-4)
        assert gram[name] == pytest.approx(ref, rel=1e-12)


def test_max_min_pick_argmax_in_order(distilbert):
    norms = {
        n: np.linalg.norm(m.weight.detach().double().numpy(), 2)
        for n, m in linear_modules(distilbert).items()
        if not n.endswith(("q_lin", "k_lin", "v_lin", "out_lin"))
    }
    ranked = [n for n, _ in rank_by_operator_norm(distilbert, "mlp")]
    assert ranked == sorted(norms, key=lambda n: -norms[n])
    assert [n for n, _ in rank_by_operator_norm(distilbert, "mlp", descending=False)] == ranked[
        ::-1
    ]
    assert [n for n, _ in rank_by_operator_norm(distilbert, "mlp", method="power")] == ranked
    assert [n for n, _ in rank_by_operator_norm(distilbert, "mlp", method="gram")] == ranked
    for k in range(len(ranked) + 1):
        top = max_operator_norm(distilbert, k, group="mlp")
        assert set(top.names) == {f"{n}.{p}" for n in ranked[:k] for p in ("weight", "bias")}
        bottom = min_operator_norm(distilbert, k, group="mlp")
        assert set(bottom.names) == {
            f"{n}.{p}" for n in ranked[::-1][:k] for p in ("weight", "bias")
        }
    attn = max_operator_norm(distilbert, 8, group="attention")
    assert all("attention" in n for n in attn.names)
    assert len(attn.names) == 16


def test_operator_norm_errors(distilbert):
    with pytest.raises(
        ValueError, match=r"k=7 is larger than the number of linear maps in group 'mlp' \(6\)"
    ):
        max_operator_norm(distilbert, 7, group="mlp")
    with pytest.raises(ValueError, match="method must be"):
        max_operator_norm(distilbert, 1, method="eig")
    with pytest.raises(ValueError, match="group='ffn'"):
        min_operator_norm(distilbert, 1, group="ffn")
    with pytest.raises(ValueError, match="k must be >= 0"):
        max_operator_norm(distilbert, -1)
    bad = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        bad[0].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="module '0'"):
        operator_norms(bad)
