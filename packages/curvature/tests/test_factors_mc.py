"""Monte-Carlo Fisher: unbiased for the exact one, error shrinking like 1/sqrt(k); reproducible."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partialbayes.curvature import diag_curvature, kfac
from partialbayes.selection import KronBlock, Subset, modules


def _setup(seed: int, n: int = 4, c: int = 3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, c, bias=False)).double().eval()
    x = torch.randn(n, 3, dtype=torch.float64)
    return model, x


def _exact_entry_sd(model, x) -> torch.Tensor:
    """Per-entry standard deviation of the one-sample MC estimate of G for the last layer (δ = p - e_y).

    Enumerates y for each example: Var[(p - e_y)(p - e_y)ᵀ] summed over the independent examples.
    """
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    c = p.shape[1]
    var = torch.zeros(c, c, dtype=torch.float64)
    for pn in p:
        z = torch.stack([torch.outer(pn - e, pn - e) for e in torch.eye(c, dtype=torch.float64)])
        mean = (pn[:, None, None] * z).sum(0)
        var += (pn[:, None, None] * z**2).sum(0) - mean**2
    return var.sqrt()


@pytest.mark.parametrize("k", [16, 256, 4096])
def test_mc_approaches_exact(k, device):
    model, x = _setup(0)
    s = modules(model, ["2"])
    data = [(x.to(device), torch.zeros(len(x), dtype=torch.long, device=device))]
    model.to(device)
    exact = kfac(model, data, s, fisher="exact")["2"]
    g = torch.Generator().manual_seed(123)
    mc = kfac(model, data, s, fisher="mc", mc_samples=k, generator=g)["2"]
    torch.testing.assert_close(mc.A, exact.A)  # A does not depend on the labels
    sd = _exact_entry_sd(model.cpu(), x) / k**0.5
    err = (mc.G - exact.G).abs().cpu()
    assert bool((err <= 5 * sd + 1e-12).all()), (err / sd).max()


def test_mc_same_seed_same_result_and_diag_mc(device):
    model, x = _setup(1)
    model.to(device)
    data = [(x.to(device), torch.zeros(len(x), dtype=torch.long, device=device))]
    s = modules(model, ["0"])
    a = kfac(model, data, s, fisher="mc", mc_samples=3, generator=torch.Generator().manual_seed(5))
    b = kfac(model, data, s, fisher="mc", mc_samples=3, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a["0"].G, b["0"].G, rtol=0, atol=0)
    sd = Subset.from_model(model, {"2.weight": KronBlock()})
    exact = diag_curvature(model, data, sd)["2.weight"]
    mc = diag_curvature(
        model, data, sd, fisher="mc", mc_samples=4000, generator=torch.Generator().manual_seed(0)
    )["2.weight"]
    torch.testing.assert_close(mc, exact, rtol=0.2, atol=2e-3)  # ~6 sd at k = 4000


def test_regression_mc_approaches_exact(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2)).double().eval().to(device)
    x = torch.randn(5, 2, dtype=torch.float64)
    data = [(x.to(device), torch.zeros(5, 2, dtype=torch.float64, device=device))]
    s = modules(model, ["2"])
    exact = kfac(model, data, s, likelihood="regression", sigma_noise=0.5)["2"]
    k = 4096
    mc = kfac(
        model,
        data,
        s,
        likelihood="regression",
        sigma_noise=0.5,
        fisher="mc",
        mc_samples=k,
        generator=torch.Generator().manual_seed(0),
    )["2"]
    # G = Σ_n ε εᵀ / σ² with ε ~ N(0, I): Var of entry (i, j) = n (1 + [i = j]) / σ⁴ / k
    sd = (5 * (1 + torch.eye(2, dtype=torch.float64)) / 0.5**4 / k).sqrt()
    assert bool(((mc.G - exact.G).abs().cpu() <= 5 * sd).all())
