"""KronLaplace against dense float64 references of the block-diagonal (G ⊗ A) / T + δ I posterior."""

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import (
    TinyNet,
    classification_data,
    dense_precision,
    kron_subset,
    random_factors,
    reference_block_jacobian,
)

from partialbayes.curvature import KronLaplace
from partialbayes.selection import KronBlock, MaskBlock, Subset

FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def _fitted(seed=0, prior=0.7, temperature=1.0, rank=None, loss=12.5, n=20, device="cpu"):
    model = TinyNet(seed).to(device)
    subset = kron_subset(model)
    la = KronLaplace(model, subset, prior_precision=prior, temperature=temperature)
    factors = random_factors(la, seed, rank)
    la.fit_curvature(factors, map_loss=loss, n_data=n, n_outputs=3)
    return model, subset, la, factors


def _prior_vec(la, prior):
    return torch.as_tensor(prior, dtype=torch.float64).expand(len(la.modules))


def _block_map(la):
    return torch.cat([la.params_to_block(m, la._map).reshape(-1) for m in la.modules])


@settings(max_examples=8, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 1000),
    prior=st.floats(0.05, 10.0),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    rank=st.sampled_from([None, 1, 2]),
)
def test_log_det_functional_cov_and_marglik_equal_dense(device, seed, prior, temperature, rank):
    model, subset, la, factors = _fitted(seed, prior, temperature, rank, device=device)
    P = dense_precision(la, factors, _prior_vec(la, prior), temperature)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(P))
    x, _ = classification_data(4, seed)
    f, cov = la.logit_mean_cov(x.to(device))
    model.cpu()
    J = reference_block_jacobian(model, x, subset)
    torch.testing.assert_close(f.cpu(), model(x).detach())
    torch.testing.assert_close(cov.cpu(), J @ torch.linalg.inv(P) @ J.mT)
    # hand evidence: -loss/T - ½(log det P - d log δ) - ½ δ |θ|²
    theta = _block_map(la).cpu()
    d = theta.numel()
    hand = (
        -12.5 / temperature
        - 0.5 * (torch.logdet(P) - d * math.log(prior))
        - 0.5 * prior * theta @ theta
    )
    torch.testing.assert_close(la.log_marginal_likelihood().cpu(), hand)


def test_per_module_prior_matches_dense():
    model, subset, la, factors = _fitted(1)
    prior = {"l0": 0.3, "c1": 2.0, "l2": 5.0}
    la.prior_precision = prior
    vec = torch.tensor([prior[m] for m in la.modules], dtype=torch.float64)
    P = dense_precision(la, factors, vec)
    torch.testing.assert_close(la.log_det(), torch.logdet(P))
    x, _ = classification_data(3, 1)
    J = reference_block_jacobian(model, x, subset)
    torch.testing.assert_close(la.logit_mean_cov(x)[1], J @ torch.linalg.inv(P) @ J.mT)
    # differentiable in a per-module tensor: gradient equals the dense derivative
    t = vec.clone().requires_grad_(True)
    lml = la.log_marginal_likelihood(prior_precision=t)
    (grad,) = torch.autograd.grad(lml, t)
    eps = 1e-6
    for i in range(3):
        dv = vec.clone()
        dv[i] += eps
        num = (la.log_marginal_likelihood(dv) - la.log_marginal_likelihood(vec)) / eps
        assert math.isclose(grad[i].item(), num.item(), rel_tol=1e-4, abs_tol=1e-6)


def test_samples_mean_and_covariance_match_dense(device):
    _, subset, la, factors = _fitted(2, prior=1.5, temperature=2.0, device=device)
    P = dense_precision(la, factors, _prior_vec(la, 1.5), 2.0)
    sigma = torch.linalg.inv(P)
    n = 20_000
    s = la.sample(n, generator=torch.Generator(device=device).manual_seed(0))
    s = {k: v.cpu() for k, v in s.items()}
    assert set(s) == set(subset.names)
    for name in subset.names:
        assert s[name].shape == (n, subset.num_entries(name))
    blocks = torch.cat([la.params_to_block(m, s).reshape(n, -1) for m in la.modules], dim=1)
    centered = blocks - _block_map(la).cpu()
    d = torch.diagonal(sigma)
    mean_tol = 6 * torch.sqrt(d / n)
    assert (centered.mean(0).abs() <= mean_tol).all()
    emp = centered.T @ centered / n
    tol = 6 * torch.sqrt((torch.outer(d, d) + sigma**2) / n)
    assert ((emp - sigma).abs() <= tol).all()
    s2 = la.sample(n, generator=torch.Generator(device=device).manual_seed(0))
    torch.testing.assert_close(s2["c1.weight"].cpu(), s["c1.weight"])


def test_block_mapping_round_trip_and_gather_order():
    model, subset, la, _ = _fitted(3)
    for m in la.modules:
        r, _, c = la._dims[m]
        blk = torch.arange(r * c, dtype=torch.float64).reshape(r, c)
        params = la.block_to_params(m, blk)
        torch.testing.assert_close(la.params_to_block(m, params), blk)
    # the MAP in block order equals W[R][:, C] | b[R] of the logical weight
    km = subset.kron_modules()["c1"]
    W = model.c1.weight.detach().T  # logical n_out x n_in
    expected = torch.cat([W[km.rows][:, km.cols], model.c1.bias.detach()[km.rows, None]], dim=1)
    torch.testing.assert_close(la.params_to_block("c1", la._map), expected)


def test_swapped_restores_map_on_exception(device):
    model, subset, la, _ = _fitted(4, device=device)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator(device=device)
    sample = {k: v[0] for k, v in la.sample(1, generator=gen.manual_seed(1)).items()}
    seen = {}

    def run():
        with la.swapped(sample) as m:
            for name in subset.names:
                seen[name] = subset.gather(name, dict(m.named_parameters())[name].detach()).clone()
            seen["outside"] = m.c1.weight[0, 0].detach().clone()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run()
    for name in subset.names:
        torch.testing.assert_close(seen[name], sample[name])
    # entries outside the subset are untouched
    assert torch.equal(seen["outside"], before["c1.weight"][0, 0])
    for k, v in model.named_parameters():
        assert torch.equal(v.detach(), before[k]), k
    x, _ = classification_data(2, 0)
    x = x.to(device)
    with la.sampled(generator=gen.manual_seed(3)):
        changed = model(x)
    assert not torch.allclose(changed, model(x))


def _dense_grid(la, factors, grid, x, y):
    theta = _block_map(la)
    J = reference_block_jacobian(la.model, x, la.subset)
    f = la.model(x).detach()
    lml, nll = [], []
    for v in grid.tolist():
        P = dense_precision(la, factors, _prior_vec(la, v))
        d = theta.numel()
        lml.append(-12.5 - 0.5 * (torch.logdet(P) - d * math.log(v)) - 0.5 * v * theta @ theta)
        var = torch.diagonal(J @ torch.linalg.inv(P) @ J.mT, dim1=-2, dim2=-1)
        probs = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * var), dim=-1)
        nll.append(-probs[torch.arange(len(y)), y].log().mean())
    return torch.stack(lml), torch.stack(nll)


@pytest.mark.parametrize("seed", [0, 5])
def test_prior_optimisation_finds_dense_grid_optimum(seed):
    _, _, la, factors = _fitted(seed, rank=2)
    grid = torch.logspace(-2, 3, 11)
    x, y = classification_data(6, seed + 10)
    lml, nll = _dense_grid(la, factors, grid, x, y)
    torch.testing.assert_close(la.grid_val_nll([(x[:4], y[:4]), (x[4:], y[4:])], grid), nll)
    assert la.optimize_prior_precision("marglik", grid=grid) == pytest.approx(
        grid[int(lml.argmax())].item()
    )
    assert la.prior_precision[0].item() == pytest.approx(grid[int(lml.argmax())].item())
    chosen = la.optimize_prior_precision("val_nll", val_loader=[(x, y)], grid=grid)
    assert chosen == pytest.approx(grid[int(nll.argmin())].item())
    floats = [float(v) for v in torch.logspace(-2, 3, 11, dtype=torch.float64)]
    assert (
        la.optimize_prior_precision("marglik", grid=floats) in floats
    )  # exact, not float32-rounded
    assert (
        la.optimize_prior_precision("marglik")
        in torch.logspace(-1, 3, 21, dtype=torch.float64).tolist()
    )


def test_bad_input():
    model = TinyNet(0)
    mask = Subset.from_model(model, {"l0.weight": MaskBlock(torch.rand(5, 3) > 0.5)})
    with pytest.raises(TypeError, match="DiagLaplace"):
        KronLaplace(model, mask)
    subset = kron_subset(model)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prior_precision"):
            KronLaplace(model, subset, prior_precision=bad)
    with pytest.raises(
        ValueError, match=r"prior_precision \(modules .*\) has unknown modules \['zz'\]"
    ):
        KronLaplace(model, subset, prior_precision={"l0": 1.0, "c1": 1.0, "l2": 1.0, "zz": 1.0})
    with pytest.raises(ValueError, match=r"prior_precision \(modules .*\) has no 'c1', 'l2'"):
        KronLaplace(model, subset, prior_precision={"l0": 1.0})
    with pytest.raises(ValueError, match="temperature"):
        KronLaplace(model, subset, temperature=0.0)
    with pytest.raises(ValueError, match="likelihood"):
        KronLaplace(model, subset, likelihood="poisson")
    la = KronLaplace(model, subset)
    with pytest.raises(RuntimeError, match="not fitted"):
        la.sample(2)
    factors = random_factors(la, 0)
    factors["l2"].G = factors["l2"].G[:1, :1]
    with pytest.raises(ValueError, match="'l2'"):
        la.fit_curvature(factors, map_loss=1.0, n_data=3, n_outputs=3)
    factors = random_factors(la, 0)
    factors["c1"].A = factors["c1"].A * float("nan")
    with pytest.raises(ValueError, match=r"'c1'.*non-finite"):
        la.fit_curvature(factors, map_loss=1.0, n_data=3, n_outputs=3)
    la.fit_curvature(random_factors(la, 0), map_loss=1.0, n_data=3, n_outputs=3)
    with pytest.raises(ValueError, match="method"):
        la.optimize_prior_precision("laplace")
    with pytest.raises(ValueError, match="val_loader"):
        la.optimize_prior_precision("val_nll")
    with pytest.raises(ValueError, match="grid"):
        la.optimize_prior_precision(grid=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="missing"), la.swapped({"l0.weight": torch.zeros(15)}):
        pass
    sub2 = Subset.from_model(model, {"l0.weight": KronBlock()})
    assert KronLaplace(model, sub2).modules == ("l0",)


def test_summary_and_num_floats():
    _, _, la, _ = _fitted(0)
    # l0: G 5x5, A 3x3 ; c1: r=3, c=2+1 ; l2: r=2, c=3+1
    expected = (25 + 5 + 9 + 3) + (9 + 3 + 9 + 3) + (4 + 2 + 16 + 4)
    assert la.num_floats == expected
    text = la.summary()
    assert "G 3x3 ⊗ A 3x3" in text
    assert str(expected) in text


def test_regression_evidence_rescales_curvature_with_sigma():
    model = TinyNet(0)
    subset = kron_subset(model)
    la = KronLaplace(model, subset, likelihood="regression", sigma_noise=0.5, prior_precision=2.0)
    factors = random_factors(la, 0)
    sse, n, c = 4.0, 10, 3
    la.fit_curvature(factors, map_loss=sse, n_data=n, n_outputs=c)
    theta = _block_map(la)
    for sigma in (0.5, 1.3):
        P = dense_precision(la, factors, _prior_vec(la, 2.0), scale=0.5**2 / sigma**2)
        loglik = -(sse / (2 * sigma**2) + n * c * math.log(sigma * math.sqrt(2 * math.pi)))
        d = theta.numel()
        hand = loglik - 0.5 * (torch.logdet(P) - d * math.log(2.0)) - 0.5 * 2.0 * theta @ theta
        torch.testing.assert_close(la.log_marginal_likelihood(sigma_noise=sigma), hand)
    s = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(sigma_noise=s), s)
    num = (
        la.log_marginal_likelihood(sigma_noise=0.8 + 1e-6)
        - la.log_marginal_likelihood(sigma_noise=0.8)
    ) / 1e-6
    assert math.isclose(grad.item(), num.item(), rel_tol=1e-4)
    with pytest.raises(ValueError, match="sigma_noise"):
        la.log_marginal_likelihood(sigma_noise=-1.0)


def test_fit_from_loader_records_map_loss_and_rejects_bad_data():
    model = TinyNet(0).eval()
    subset = kron_subset(model)
    x, y = classification_data(10, 0)
    loader = [(x[:6], y[:6]), (x[6:], y[6:])]
    la = KronLaplace(model, subset).fit(loader)
    assert la.n_data == 10
    hand = torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
    assert la.map_loss == pytest.approx(hand)
    assert torch.isfinite(la.log_marginal_likelihood())
    with pytest.raises(ValueError, match="empty"):
        KronLaplace(model, subset).fit([])
    with pytest.raises(ValueError, match="labels must lie in"):
        KronLaplace(model, subset).fit([(x, y + 5)])
    with pytest.raises(ValueError, match="num_classes"):
        KronLaplace(model, subset, num_classes=4).fit(loader)
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        again = KronLaplace(model, subset).fit(loader)
    assert model.training
    torch.testing.assert_close(again.log_det(), la.log_det())


def test_kron_modules_are_resolved_once_per_posterior(monkeypatch):
    """Construction resolves the Kronecker modules; fit and the predictive reuse them (issue #17)."""
    model = TinyNet(0).eval()
    subset = kron_subset(model)
    calls = []
    resolve = Subset.kron_modules
    monkeypatch.setattr(Subset, "kron_modules", lambda self: calls.append(1) or resolve(self))
    x, y = classification_data(6, 0)
    la = KronLaplace(model, subset).fit([(x[:3], y[:3]), (x[3:], y[3:])])
    la.logit_mean_cov(x)
    la.sample(2, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 1


def test_subset_of_another_model_is_refused_at_construction():
    subset = kron_subset(TinyNet(0))
    other = torch.nn.Sequential(torch.nn.Linear(3, 3)).double()
    with pytest.raises(
        ValueError, match=r"does not fit the subset: parameter 'l0.weight' is missing"
    ):
        KronLaplace(other, subset)
