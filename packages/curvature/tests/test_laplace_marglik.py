"""Prior precision (and noise) by gradient ascent on the Laplace evidence, against dense float64 optima."""

from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import optimize
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, dense_precision, kron_subset, random_factors

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace, MarglikFit
from partialbayes.selection import KronBlock, Subset, modules

FIXTURE = settings(
    max_examples=5,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _kron(seed: int, scales=(1.0, 1.0, 1.0), device="cpu", loss=12.5, n=20):
    """TinyNet with S-KFAC-like blocks, synthetic factors; the modules' MAP weights scaled by ``scales``."""
    model = TinyNet(seed).to(device)
    with torch.no_grad():
        for mod, s in zip((model.l0, model.c1, model.l2), scales, strict=True):
            for p in mod.parameters():
                p.mul_(s)
    la = KronLaplace(model, kron_subset(model))
    factors = random_factors(la, seed, rank=2)
    la.fit_curvature(factors, map_loss=loss, n_data=n, n_outputs=3)
    return la, factors


def _dense_evidence(la, factors, log_prior: np.ndarray) -> tuple[float, np.ndarray]:
    """Dense float64 evidence and its gradient in log δ (block-diagonal P, formulas written out)."""
    prior = torch.tensor(np.exp(log_prior), dtype=torch.float64)
    P = dense_precision(la, factors, prior)
    sizes = [torch.kron(factors[m].G, factors[m].A).shape[0] for m in la.modules]
    theta = torch.cat([la.params_to_block(m, la._map).reshape(-1).cpu() for m in la.modules])
    cov_diag = torch.diagonal(torch.linalg.inv(P))
    d = torch.tensor(sizes, dtype=torch.float64)
    sq = torch.stack([t.pow(2).sum() for t in theta.split(sizes)])
    tr = torch.stack([c.sum() for c in cov_diag.split(sizes)])
    value = (
        -la.map_loss
        - 0.5 * torch.logdet(P)
        + 0.5 * (d * prior.log()).sum()
        - 0.5 * (prior * sq).sum()
    )
    grad = 0.5 * (d - prior * tr - prior * sq)
    return float(value), grad.numpy()


def _dense_optimum(la, factors) -> np.ndarray:
    res = optimize.minimize(
        lambda v: tuple(-t for t in _dense_evidence(la, factors, v)),
        np.zeros(len(la.modules)),
        jac=True,
        method="L-BFGS-B",
        options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 1000},
    )
    # L-BFGS-B may stop ABNORMAL at gtol=1e-12 once the line search hits round-off: accept a vanishing gradient
    assert res.success or np.abs(res.jac).max() < 1e-6, res.message
    return np.exp(res.x)


@FIXTURE
@given(seed=st.integers(0, 1000), init=st.floats(0.05, 20.0))
def test_gradient_reaches_the_dense_per_module_optimum(device, seed, init):
    # modules of very different weight scales want very different priors
    la, factors = _kron(seed, scales=(4.0, 1.0, 0.25), device=device)
    ref = _dense_optimum(la, factors)
    fit = la.maximize_evidence(init_prior_precision=init, tol=1e-7, max_steps=5000)
    assert isinstance(fit, MarglikFit)
    assert fit.converged
    assert fit.max_scaled_gradient <= 1e-7
    assert fit.modules == la.modules
    np.testing.assert_allclose(fit.prior_precision.numpy(), ref, rtol=1e-4)
    # stored on the posterior, and the evidence reported is the evidence there
    torch.testing.assert_close(la.prior_precision.cpu(), fit.prior_precision)
    assert fit.log_marginal_likelihood == pytest.approx(
        float(la.log_marginal_likelihood()), abs=1e-9
    )
    assert fit.log_marginal_likelihood == pytest.approx(
        _dense_evidence(la, factors, np.log(ref))[0], abs=1e-6
    )
    assert fit.sigma_noise is None
    assert len(fit.history) == fit.steps + 1
    # per-module values differ when the modules differ: the small-weight module wants the largest prior
    assert fit.prior_precision.max() / fit.prior_precision.min() > 4
    assert int(fit.prior_precision.argmax()) == 2
    assert fit.as_dict() == dict(zip(la.modules, fit.prior_precision.tolist(), strict=True))


@pytest.mark.parametrize("cls", [KronLaplace, DiagLaplace, DenseLaplace])
def test_gradient_beats_or_ties_the_grid(cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model = model.double().eval()
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,))
    la = cls(model, modules(model, ["0", "2", "4"])).fit([(x, y)])
    grid = torch.logspace(-2, 3, 201, dtype=torch.float64)
    best = la.optimize_prior_precision("marglik", grid=grid)
    best_value = float(la.log_marginal_likelihood())
    # one shared value by gradient: the grid's optimum, to within the grid's spacing
    shared = la.maximize_evidence(per_module=False)
    assert shared.converged
    assert torch.unique(shared.prior_precision).numel() == 1
    assert shared.log_marginal_likelihood >= best_value - 1e-9
    spacing = float(grid[1] / grid[0])
    assert best / spacing <= float(shared.prior_precision[0]) <= best * spacing
    # one value per module: at least as good, strictly better here (the first layer is scaled up)
    per = la.maximize_evidence(init_prior_precision=best)
    assert per.converged
    assert per.log_marginal_likelihood >= shared.log_marginal_likelihood - 1e-9
    assert per.log_marginal_likelihood > best_value + 0.1
    assert per.history[-1] >= per.history[0]
    # a local optimum: nudging any module's prior lowers the evidence
    for i in range(len(la.modules)):
        for f in (math.exp(-0.05), math.exp(0.05)):
            moved = per.prior_precision.clone()
            moved[i] *= f
            assert (
                float(la.log_marginal_likelihood(prior_precision=moved))
                < per.log_marginal_likelihood
            )


def _mackay(X: torch.Tensor, sse: float, theta_sq: float, c: int) -> tuple[float, float]:
    """Dense closed form: the stationary point of the linear-Gaussian evidence (MacKay's fixed point).

    With λ_j the eigenvalues of XᵀX (each C times), γ = C Σ λ_j / (λ_j + δσ²) effective parameters,
    δ = γ / ‖θ‖² and σ² = SSE / (N C - γ).
    """
    lam = torch.linalg.eigvalsh(X.T @ X)
    n = X.shape[0]
    delta, sigma2 = 1.0, 1.0
    for _ in range(100_000):
        gamma = c * float((lam / (lam + delta * sigma2)).sum())
        new = gamma / theta_sq, sse / (n * c - gamma)
        if abs(new[0] - delta) <= 1e-15 * delta and abs(new[1] - sigma2) <= 1e-15 * sigma2:
            break
        delta, sigma2 = new
    return delta, math.sqrt(sigma2)


@FIXTURE
@given(
    seed=st.integers(0, 1000),
    n=st.integers(8, 30),
    d=st.integers(1, 4),
    c=st.integers(1, 3),
    noise=st.floats(0.1, 2.0),
)
def test_regression_noise_matches_the_linear_gaussian_closed_form(device, seed, n, d, c, noise):
    """y = W x + ε: KFAC of one linear map is exact, so the Laplace evidence is the Gaussian one."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    W = torch.randn(c, d, generator=g, dtype=torch.float64)
    Y = X @ W.T + noise * torch.randn(n, c, generator=g, dtype=torch.float64)
    model = nn.Linear(d, c, bias=False).double().eval()
    with torch.no_grad():  # the ridge MAP at δσ² = 1
        model.weight.copy_(torch.linalg.solve(X.T @ X + torch.eye(d, dtype=X.dtype), X.T @ Y).T)
    model = model.to(device)
    sub = Subset.from_model(model, {"weight": KronBlock()})
    la = KronLaplace(model, sub, likelihood="regression", sigma_noise=0.7)
    la.fit([(X.to(device), Y.to(device))])
    sse = float(((X @ model.weight.detach().cpu().T - Y) ** 2).sum())
    delta, sigma = _mackay(X, sse, float(model.weight.detach().pow(2).sum()), c)
    fit = la.maximize_evidence(tol=1e-8, max_steps=5000)
    assert fit.converged
    assert fit.sigma_noise == pytest.approx(sigma, rel=1e-5)
    assert float(fit.prior_precision[0]) == pytest.approx(delta, rel=1e-4)
    assert la.sigma_noise == fit.sigma_noise
    # the noise can stay fixed
    fixed = la.maximize_evidence(fit_sigma_noise=False)
    assert fixed.sigma_noise is None
    assert la.sigma_noise == fit.sigma_noise


def test_save_load_keeps_fitted_values(tmp_path):
    X = torch.randn(20, 3, dtype=torch.float64)
    Y = X @ torch.randn(3, 2, dtype=torch.float64) + 0.3 * torch.randn(20, 2, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    la = KronLaplace(model, modules(model, ["0", "2"]), likelihood="regression").fit([(X, Y)])
    fit = la.maximize_evidence()
    la.save(tmp_path / "post")
    back = KronLaplace.load(tmp_path / "post", model)
    torch.testing.assert_close(back.prior_precision.cpu(), fit.prior_precision)
    assert back.sigma_noise == pytest.approx(fit.sigma_noise)
    assert float(back.log_marginal_likelihood()) == pytest.approx(fit.log_marginal_likelihood)


def test_non_convergence_is_reported():
    la, _ = _kron(0, scales=(4.0, 1.0, 0.25))
    with pytest.warns(
        UserWarning, match=r"did not converge in max_steps=3 steps.*tol=1e-06"
    ) as rec:
        fit = la.maximize_evidence(max_steps=3, tol=1e-6)
    assert rec[0].filename == __file__  # the user's line
    assert not fit.converged
    assert fit.steps == 3
    assert fit.max_scaled_gradient > 1e-6
    torch.testing.assert_close(la.prior_precision.cpu(), fit.prior_precision)  # set anyway


def test_bad_input():
    la, _ = _kron(0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="prior_precision"):
            la.maximize_evidence(init_prior_precision=bad)
    # the grid and the ascent are two methods: neither takes the other's options
    with pytest.raises(TypeError, match=r"'lr'.*options of maximize_evidence"):
        la.optimize_prior_precision("marglik", lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        la.optimize_prior_precision("marglik", optimizer="adam")
    with pytest.raises(TypeError, match="'grid'"):
        la.maximize_evidence(grid=[1.0, 2.0])
    with pytest.raises(TypeError, match="positional"):
        la.maximize_evidence("marglik")
    with pytest.raises(ValueError, match="regression"):
        la.maximize_evidence(fit_sigma_noise=True)
    with pytest.raises(ValueError, match="lr"):
        la.maximize_evidence(lr=0.0)
    with pytest.raises(ValueError, match="tol"):
        la.maximize_evidence(tol=-1.0)
    with pytest.raises(ValueError, match="max_steps"):
        la.maximize_evidence(max_steps=0)
    with pytest.raises(TypeError, match="per_module"):
        la.maximize_evidence(per_module="yes")
    fresh = KronLaplace(la.model, la.subset)
    with pytest.raises(RuntimeError, match="not fitted"):
        fresh.maximize_evidence()


@pytest.mark.peers
def test_matches_laplace_torch_marglik():
    """Same posterior as laplace-torch (no biases, KFAC on every weight): same evidence, same optimum."""
    laplace = pytest.importorskip("laplace")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 3, bias=False),
    )
    model = model.double().eval()
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    x, y = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 3, (40,))
    sub = Subset.from_model(model, {f"{n}.weight": KronBlock() for n in ("0", "2", "4")})
    ours = KronLaplace(model, sub).fit([(x[:20], y[:20]), (x[20:], y[20:])])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=20)
    peer = laplace.KronLaplace(model, "classification")
    peer.fit(loader, progress_bar=False)
    for value in (0.1, 1.0, 10.0):
        prior = torch.full((3,), value, dtype=torch.float64)
        assert float(ours.log_marginal_likelihood(prior)) == pytest.approx(
            float(peer.log_marginal_likelihood(prior)), rel=1e-12
        )

    def peer_marglik(n_steps):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # laplace-torch's reminder about link_approx
            peer.optimize_prior_precision(
                pred_type="glm", method="marglik", prior_structure="layerwise", n_steps=n_steps
            )
        return peer.prior_precision.detach().clone(), float(peer.log_marginal_likelihood())

    fit = ours.maximize_evidence(tol=1e-7, max_steps=5000)
    assert fit.converged
    _, short = peer_marglik(100)  # its default: a fixed budget, no stopping rule
    assert fit.log_marginal_likelihood >= short - 1e-9
    long_prior, long = peer_marglik(3000)
    torch.testing.assert_close(fit.prior_precision, long_prior, rtol=1e-3, atol=0)
    assert fit.log_marginal_likelihood == pytest.approx(long, abs=1e-6)


def test_the_deprecated_gradient_optimizer_forwards_to_maximize_evidence():
    la, _ = _kron(3)
    ref = copy.deepcopy(la).maximize_evidence(per_module=False, lr=0.2)
    with pytest.warns(FutureWarning, match="maximize_evidence"):
        fit = la.optimize_prior_precision("marglik", optimizer="gradient", per_module=False, lr=0.2)
    assert isinstance(fit, MarglikFit)
    assert torch.equal(fit.prior_precision, ref.prior_precision)
    assert fit.steps == ref.steps
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="method"):
        la.optimize_prior_precision("val_nll", optimizer="gradient")
    with pytest.warns(FutureWarning), pytest.raises(TypeError, match="'grid'"):
        la.optimize_prior_precision(optimizer="gradient", grid=[1.0, 2.0])
