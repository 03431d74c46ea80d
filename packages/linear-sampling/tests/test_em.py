import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize_scalar

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    effective_dimension,
    fit_prior_precision,
    mackay_update,
    posterior_samples,
    softmax_hessian,
)
from partialbayes.linear_sampling._em import feature_scales

F64 = torch.float64


def dense_noise(noise):
    """The ``[n, m, m]`` softmax Hessians ``diag(p) − p pᵀ + jitter·I`` of a noise, formed densely."""
    p = noise.value
    eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
    return torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1) + noise.jitter * eye


FIXTURE_OK = settings(
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.differing_executors,
    ]
)


def dense_log_evidence(phi, y, noise, prior):
    """Exact log evidence ``log p(Y | α)`` of the linear model (dense; differentiable in ``prior.alpha``).

    ``−½‖Y − Φθ̄‖²_B − ½‖θ̄‖²_A − ½ log det H + ½ log det A + ½ Σ_n log det B_n − (nm/2) log 2π``.
    """
    n, m, d = phi.shape
    idx = torch.arange(n)
    bphi = noise.apply(idx, phi)
    a = prior.alpha.to(phi).reshape(-1)[prior.group_index(d, phi.device)]
    h = torch.einsum("nmd,nme->de", phi, bphi) + torch.diag(a)
    mean = torch.linalg.solve(h, torch.einsum("nmd,nm->d", bphi, y))
    r = (y - phi @ mean).unsqueeze(2)
    quad = (r * noise.apply(idx, r)).sum() + (a * mean * mean).sum()
    logdets = torch.logdet(h) - a.log().sum() - noise.logdet(n, m)
    return -0.5 * (quad + logdets + n * m * math.log(2 * math.pi))


def problem(n, m, d, seed, kind, n_groups=1, feature_scale=None):
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, m, d, generator=g, dtype=F64)
    if feature_scale is not None:
        phi = phi * feature_scale
    theta = 2 * torch.randn(d, generator=g, dtype=F64)
    y = torch.einsum("nmd,d->nm", phi, theta) + 0.3 * torch.randn(n, m, generator=g, dtype=F64)
    if kind == "scalar":
        noise = NoisePrecision(torch.tensor(2.0, dtype=F64))
    else:
        noise = softmax_hessian(torch.randn(n, m, generator=g, dtype=F64), jitter=0.1)
    if n_groups == 1:
        prior = Prior(torch.tensor(1.0, dtype=F64))
    else:
        groups = torch.arange(d) % n_groups
        prior = Prior(torch.ones(n_groups, dtype=F64), groups)
    return phi, y, noise, prior


def dense_posterior(phi, y, noise, prior):
    n, _m, d = phi.shape
    idx = torch.arange(n)
    bphi = noise.apply(idx, phi)
    a = prior.diag(d, F64, phi.device)
    h = torch.einsum("nmd,nme->de", phi, bphi) + torch.diag(a)
    mean = torch.linalg.solve(h, torch.einsum("nmd,nm->d", bphi, y))
    return h, mean, a


def exact_gamma(phi, y, noise, prior):
    h, mean, a = dense_posterior(phi, y, noise, prior)
    groups = prior.group_index(phi.shape[2], phi.device)
    per = 1 - a * torch.linalg.inv(h).diagonal()
    return torch.zeros(prior.n_groups, dtype=F64).index_add_(0, groups, per), mean


def exact_mackay(phi, y, noise, prior, iters=50_000):
    """Exact MacKay iteration; None when α runs off to infinity (evidence maximal at α = ∞).

    The iteration converges linearly and can be slow near large α (one drawn case needs ~5,200 steps).
    """
    for _ in range(iters):
        if float(prior.alpha.max()) > 1e6:
            return None
        gamma, mean = exact_gamma(phi, y, noise, prior)
        new = mackay_update(mean, gamma, prior)
        if float(((new.alpha - prior.alpha).abs() / prior.alpha).max()) < 1e-12:
            return new
        prior = new
    raise AssertionError("exact MacKay iteration did not converge")


@FIXTURE_OK
@given(
    n=st.integers(6, 14),
    m=st.integers(1, 2),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["scalar", "matrix"]),
)
def test_mackay_fixed_point_maximises_exact_evidence_scalar(n, m, d, seed, kind):
    if kind == "matrix":
        m += 1  # a one-class softmax Hessian is only the jitter
    phi, y, noise, prior = problem(n, m, d, seed, kind)
    fixed = exact_mackay(phi, y, noise, prior)
    assume(fixed is not None)

    def neg(log_a):
        return -float(
            dense_log_evidence(phi, y, noise, Prior(torch.tensor(math.exp(log_a), dtype=F64)))
        )

    best = minimize_scalar(neg, bounds=(-12, 12), method="bounded", options={"xatol": 1e-10})
    assert abs(math.log(float(fixed.alpha)) - best.x) < 1e-4


@given(n=st.integers(8, 14), d=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_mackay_fixed_point_is_stationary_per_group(n, d, seed):
    phi, y, noise, prior = problem(n, 2, d, seed, "matrix", n_groups=2)
    fixed = exact_mackay(phi, y, noise, prior)
    assume(fixed is not None)
    log_a = fixed.alpha.log().clone().requires_grad_(True)
    ev = dense_log_evidence(phi, y, noise, Prior(log_a.exp(), fixed.groups))
    (grad,) = torch.autograd.grad(ev, log_a)
    assert float(grad.abs().max()) < 1e-7
    hess = torch.autograd.functional.hessian(
        lambda la: dense_log_evidence(phi, y, noise, Prior(la.exp(), fixed.groups)),
        fixed.alpha.log(),
    )
    assert float(torch.linalg.eigvalsh(hess).max()) < 0  # a maximum


@pytest.mark.parametrize("estimator", ["function", "weight"])
def test_effective_dimension_estimators_are_unbiased(device, estimator):
    phi, y, noise, prior = problem(30, 2, 4, 1, "matrix", n_groups=2)
    gamma, _ = exact_gamma(phi, y, noise, prior)
    feats = Features.dense(phi.to(device))
    k = 4000
    z = posterior_samples(
        feats, noise, prior, k, method="cg", generator=torch.Generator().manual_seed(0)
    ).samples
    est = effective_dimension(feats, noise, prior, z, estimator=estimator).cpu()
    # standard error from the per-sample terms of the estimator
    per = torch.stack(
        [
            effective_dimension(feats, noise, prior, z[:, j : j + 1], estimator=estimator).cpu()
            for j in range(0, k, 20)
        ]
    )
    se = per.std(0) / math.sqrt(k)
    assert bool(((est - gamma).abs() <= 5 * se + 1e-12).all()), (est, gamma, se)


@pytest.mark.parametrize(
    ("estimator", "n_groups", "g_prior"),
    [("function", 1, False), ("weight", 1, False), ("function", 2, False), ("function", 1, True)],
)
def test_sampled_em_reaches_the_evidence_maximiser(device, estimator, n_groups, g_prior):
    scale = torch.tensor([0.3, 1.0, 3.0]) if g_prior else None
    phi, y, noise, prior = problem(40, 2, 3, 7, "matrix", n_groups=n_groups, feature_scale=scale)
    feats = Features.dense(phi.to(device))
    k = 2000
    out = fit_prior_precision(
        feats,
        y.to(device),
        noise,
        prior,
        k=k,
        estimator=estimator,
        tol=0.02,
        max_iter=60,
        g_prior=g_prior,
        generator=torch.Generator().manual_seed(3),
    )
    assert out.converged
    if g_prior:
        s = feature_scales(feats, noise).cpu()
        torch.testing.assert_close(out.scale.cpu(), s)
        exact = exact_mackay(phi / s, y, noise, prior)
    else:
        exact = exact_mackay(phi, y, noise, prior)
    rel = (out.prior.alpha.reshape(-1) - exact.alpha.reshape(-1)).abs() / exact.alpha.reshape(-1)
    assert float(rel.max()) < 6 * math.sqrt(2 / k) + 0.02
    # the returned mean is the posterior mean under the returned prior, in original coordinates
    bmat = dense_noise(noise)
    h = torch.einsum("nmd,nmk,nke->de", phi, bmat, phi) + torch.diag(out.precision_diag.cpu())
    mean = torch.linalg.solve(h, torch.einsum("nmd,nmk,nk->d", phi, bmat, y))
    torch.testing.assert_close(out.mean.cpu(), mean, rtol=1e-6, atol=1e-8)


def test_sgd_em_is_close_to_exact():
    phi, y, noise, prior = problem(60, 1, 3, 2, "scalar")
    feats = Features.dense(phi)
    out = fit_prior_precision(
        feats,
        y,
        noise,
        prior,
        k=64,
        method="sgd",
        tol=0.05,
        max_iter=15,
        sgd=SGDConfig(batch_size=30, max_epochs=200, tol=1e-5),
        generator=torch.Generator().manual_seed(0),
    )
    exact = exact_mackay(phi, y, noise, prior)
    assert abs(math.log(float(out.prior.alpha) / float(exact.alpha))) < 0.5
    assert len(out.history) >= 1


def test_feature_scales_probe_estimate_matches_exact():
    phi, _y, noise, _prior = problem(
        50, 2, 4, 4, "matrix", feature_scale=torch.tensor([0.5, 1.0, 2.0, 4.0])
    )
    dense = Features.dense(phi)
    ops = Features(dense.jvp, dense.vjp, 50, 2, 4, F64, torch.device("cpu"))  # no matrix: probes
    exact = feature_scales(dense, noise)
    idx = torch.arange(50)
    torch.testing.assert_close(exact**2, (phi * noise.apply(idx, phi)).sum((0, 1)))
    n_probes = 2000
    est = feature_scales(ops, noise, n_probes=n_probes, generator=torch.Generator().manual_seed(0))
    # rel. s.e. of a Rademacher diagonal estimate <= sqrt(2 / P); the square root halves it
    assert float(((est - exact) / exact).abs().max()) < 5 * 0.5 * math.sqrt(2 / n_probes)
