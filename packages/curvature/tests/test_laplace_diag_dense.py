"""DiagLaplace and DenseLaplace against dense float64 references, on elementwise (mask) subsets."""

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data

from partialbayes.curvature import DenseLaplace, DiagLaplace
from partialbayes.selection import KronBlock, MaskBlock, Subset


def mask_subset(model, seed):
    g = torch.Generator().manual_seed(seed)
    return Subset.from_model(
        model,
        {
            "l0.bias": MaskBlock(torch.tensor([True, False, True, True, False])),
            "c1.weight": MaskBlock(torch.rand(5, 4, generator=g) > 0.6),
            "l2.weight": KronBlock(rows=torch.tensor([0, 2])),
            "l2.bias": KronBlock(),
        },
    )


def reference_jacobian(model, x, subset):
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
    cols = [
        jac[n].reshape(*jac[n].shape[:2], -1)[..., subset.mask(n).reshape(-1)] for n in subset.names
    ]
    return torch.cat(cols, dim=-1)


def entry_prior(la, prior):
    return torch.cat(
        [
            torch.full(
                (la.subset.num_entries(n),),
                prior[la.modules[la._param_module[n]]],
                dtype=torch.float64,
            )
            for n in la.subset.names
        ]
    )


def flat_map(la):
    return torch.cat([la._map[n] for n in la.subset.names]).cpu()


def _fit(cls, seed, prior, temperature, device="cpu"):
    model = TinyNet(seed).to(device)
    subset = mask_subset(model, seed)
    la = cls(model, subset, prior_precision=prior, temperature=temperature)
    g = torch.Generator().manual_seed(seed)
    p = subset.num_entries()
    if cls is DiagLaplace:
        h = torch.rand(p, generator=g, dtype=torch.float64) * 5
        h[0] = 0.0  # a zero-curvature entry
        curv = {n: h[s] for n, s in zip(subset.names, _slices(subset), strict=True)}
        H = torch.diag(h)
    else:
        x = torch.randn(p, p - 2, generator=g, dtype=torch.float64)  # rank deficient
        H = curv = x @ x.T
    la.fit_curvature(curv, map_loss=7.0, n_data=11, n_outputs=3)
    return model, subset, la, H


def _slices(subset):
    out, start = [], 0
    for n in subset.names:
        k = subset.num_entries(n)
        out.append(slice(start, start + k))
        start += k
    return out


PRIORS = st.sampled_from(
    [1.0, 0.2, {"l0": 0.5, "c1": 3.0, "l2": 1.5}, {"l0": 2.0, "c1": 2.0, "l2": 0.1}]
)


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cls=st.sampled_from([DiagLaplace, DenseLaplace]),
    seed=st.integers(0, 100),
    prior=PRIORS,
    temperature=st.sampled_from([1.0, 0.5]),
)
def test_against_dense_reference(cls, seed, prior, temperature, device):
    model, subset, la, H = _fit(cls, seed, prior, temperature, device)
    pdict = prior if isinstance(prior, dict) else dict.fromkeys(la.modules, prior)
    delta = entry_prior(la, pdict)
    P = H / temperature + torch.diag(delta)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(P))
    theta = flat_map(la)
    hand = (
        -7.0 / temperature
        - 0.5 * (torch.logdet(P) - delta.log().sum())
        - 0.5 * (delta * theta) @ theta
    )
    torch.testing.assert_close(la.log_marginal_likelihood().cpu(), hand)
    x, _ = classification_data(3, seed)
    f, cov = la.logit_mean_cov(x.to(device))
    model.cpu()
    J = reference_jacobian(model, x, subset)
    torch.testing.assert_close(f.cpu(), model(x).detach())
    torch.testing.assert_close(cov.cpu(), J @ torch.linalg.inv(P) @ J.mT)


@pytest.mark.parametrize("cls", [DiagLaplace, DenseLaplace])
@pytest.mark.parametrize("prior", [0.7, {"l0": 0.5, "c1": 3.0, "l2": 1.5}])
def test_samples_match_dense_covariance(cls, prior, device):
    _, subset, la, H = _fit(cls, 3, prior, 1.0, device)
    pdict = prior if isinstance(prior, dict) else dict.fromkeys(la.modules, prior)
    sigma = torch.linalg.inv(H + torch.diag(entry_prior(la, pdict)))
    n = 20_000
    s = la.sample(n, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([s[k] for k in subset.names], dim=1).cpu() - flat_map(la)
    d = torch.diagonal(sigma)
    assert (flat.mean(0).abs() <= 6 * torch.sqrt(d / n)).all()
    emp = flat.T @ flat / n
    assert ((emp - sigma).abs() <= 6 * torch.sqrt((torch.outer(d, d) + sigma**2) / n)).all()


@pytest.mark.parametrize("cls", [DiagLaplace, DenseLaplace])
def test_differentiable_per_module_prior(cls, device):
    _, _, la, _ = _fit(cls, 1, 1.0, 1.0, device)
    t = torch.tensor([0.5, 2.0, 1.3], dtype=torch.float64, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(t), t)
    for i in range(3):
        d = t.detach().clone()
        d[i] += 1e-6
        num = (la.log_marginal_likelihood(d) - la.log_marginal_likelihood(t.detach())) / 1e-6
        assert math.isclose(grad[i].item(), num.item(), rel_tol=1e-4, abs_tol=1e-6)


def test_prior_grid_matches_dense_optimum(device):
    _, subset, la, H = _fit(DenseLaplace, 2, 1.0, 1.0, device)
    grid = torch.logspace(-2, 2, 9)
    theta = flat_map(la)
    x, y = classification_data(5, 2)
    ref_model = TinyNet(2)  # the same weights, on the CPU
    J = reference_jacobian(ref_model, x, subset)
    f = ref_model(x).detach()
    lml, nll = [], []
    for v in grid.tolist():
        P = H + v * torch.eye(H.shape[0], dtype=torch.float64)
        lml.append(
            -7.0 - 0.5 * (torch.logdet(P) - theta.numel() * math.log(v)) - 0.5 * v * theta @ theta
        )
        var = torch.diagonal(J @ torch.linalg.inv(P) @ J.mT, dim1=-2, dim2=-1)
        p = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * var), -1)
        nll.append(-p[torch.arange(5), y].log().mean())
    assert la.optimize_prior_precision(grid=grid) == pytest.approx(
        grid[int(torch.stack(lml).argmax())].item()
    )
    best = la.optimize_prior_precision(
        "val_nll", val_loader=[(x.to(device), y.to(device))], grid=grid
    )
    assert best == pytest.approx(grid[int(torch.stack(nll).argmin())].item())


def test_bad_input():
    model = TinyNet(0)
    subset = mask_subset(model, 0)
    with pytest.raises(ValueError, match="max_entries"):
        DenseLaplace(model, subset, max_entries=3)
    la = DiagLaplace(model, subset)
    with pytest.raises(ValueError, match=r"diagonal curvature has no 'l0\.bias', 'c1\.weight'"):
        la.fit_curvature({}, map_loss=1.0, n_data=1, n_outputs=3)
    bad = {n: torch.ones(subset.num_entries(n), dtype=torch.float64) for n in subset.names}
    bad["c1.weight"][0] = float("inf")
    with pytest.raises(ValueError, match=r"c1\.weight"):
        la.fit_curvature(bad, map_loss=1.0, n_data=1, n_outputs=3)
    dl = DenseLaplace(model, subset)
    with pytest.raises(ValueError, match="shape"):
        dl.fit_curvature(torch.eye(3), map_loss=1.0, n_data=1, n_outputs=3)
    with pytest.raises(ValueError, match="n_data"):
        dl.fit_curvature(torch.eye(subset.num_entries()), map_loss=1.0, n_data=0, n_outputs=3)
