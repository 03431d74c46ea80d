import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    posterior_mean,
    posterior_samples,
    softmax_hessian,
)

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


def problem(n, m, d, seed, kind, device, groups=False):
    g = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, m, d, generator=g, dtype=F64)
    theta = torch.randn(d, generator=g, dtype=F64)
    y = torch.einsum("nmd,d->nm", phi, theta) + 0.5 * torch.randn(n, m, generator=g, dtype=F64)
    if kind == "scalar":
        noise = NoisePrecision(torch.tensor(1.7, dtype=F64))
        bmat = 1.7 * torch.eye(m, dtype=F64).expand(n, m, m)
    elif kind == "per_obs":
        v = 0.5 + torch.rand(n, generator=g, dtype=F64)
        noise = NoisePrecision(v)
        bmat = v[:, None, None] * torch.eye(m, dtype=F64)
    else:
        noise = softmax_hessian(torch.randn(n, m, generator=g, dtype=F64), jitter=0.05)
        bmat = dense_noise(noise)
    if groups:
        grp = torch.randint(0, 2, (d,), generator=g)
        grp[0], grp[-1] = 0, 1
        prior = Prior(torch.tensor([0.7, 3.0], dtype=F64), grp)
    else:
        prior = Prior(torch.tensor(1.3, dtype=F64))
    a = prior.diag(d, F64, torch.device("cpu"))
    h = torch.einsum("nmd,nmk,nke->de", phi, bmat, phi) + torch.diag(a)
    mean = torch.linalg.solve(h, torch.einsum("nmd,nmk,nk->d", phi, bmat, y))
    dev = torch.device(device)
    feats = Features.dense(phi.to(dev))
    return feats, y.to(dev), noise, prior, h.to(dev), mean.to(dev), bmat.to(dev), a.to(dev)


kinds = st.sampled_from(["scalar", "per_obs", "matrix"])


@FIXTURE_OK
@given(
    n=st.integers(1, 12),
    m=st.integers(1, 3),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    kind=kinds,
    groups=st.booleans(),
)
def test_cg_mean_is_closed_form(device, n, m, d, seed, kind, groups):
    if groups and d < 2:
        groups = False
    feats, y, noise, prior, _, mean, _, _ = problem(n, m, d, seed, kind, device, groups)
    out = posterior_mean(feats, y, noise, prior, batch_size=5)
    assert out.info.converged
    torch.testing.assert_close(out.mean, mean, rtol=1e-6, atol=1e-8)


@FIXTURE_OK
@given(
    n=st.integers(4, 16),
    m=st.integers(1, 3),
    d=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    kind=kinds,
)
def test_full_batch_sgd_mean_is_closed_form(device, n, m, d, seed, kind):
    feats, y, noise, prior, _, mean, _, _ = problem(n, m, d, seed, kind, device)
    cfg = SGDConfig(batch_size=n, polyak=0.0, max_epochs=5000, tol=1e-10)
    out = posterior_mean(
        feats, y, noise, prior, method="sgd", sgd=cfg, generator=torch.Generator().manual_seed(0)
    )
    assert out.info.converged
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings(
    "ignore:posterior_mean. the sgd solver stopped:RuntimeWarning"
)  # plain SGD: noise floor
def test_plain_minibatch_sgd_mean_with_polyak_averaging(device):
    feats, y, noise, prior, _, mean, _, _ = problem(200, 3, 8, 3, "matrix", device)
    cfg = SGDConfig(batch_size=50, max_epochs=300, tol=1e-7, variance_reduction=False)
    out = posterior_mean(
        feats, y, noise, prior, method="sgd", sgd=cfg, generator=torch.Generator().manual_seed(0)
    )
    assert len(out.info.history) > 0
    err = float((out.mean - mean).norm() / mean.norm())
    assert err < 5e-3
    no_avg = posterior_mean(
        feats,
        y,
        noise,
        prior,
        method="sgd",
        sgd=SGDConfig(
            batch_size=50, max_epochs=300, tol=1e-7, polyak=0.0, variance_reduction=False
        ),
        generator=torch.Generator().manual_seed(0),
    )
    assert (
        float((no_avg.mean - mean).norm() / mean.norm()) > err
    )  # averaging removes minibatch noise


@FIXTURE_OK
@given(
    n=st.integers(1, 10),
    m=st.integers(1, 3),
    d=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    kind=kinds,
)
def test_sample_moments_approach_zero_and_inverse_precision(device, n, m, d, seed, kind):
    feats, _, noise, prior, h, _, _, _ = problem(n, m, d, seed, kind, device)
    k = 3000
    z = posterior_samples(
        feats, noise, prior, k, method="cg", generator=torch.Generator().manual_seed(seed)
    ).samples
    cov = torch.linalg.inv(h)
    var = cov.diagonal()
    # standard errors of the sample mean and of the (known-zero-mean) sample covariance entries
    se_mean = (var / k).sqrt()
    se_cov = ((var[:, None] * var[None, :] + cov**2) / k).sqrt()
    assert bool(((z.mean(1)).abs() <= 5 * se_mean).all())
    assert bool(((z @ z.T / k - cov).abs() <= 5 * se_cov).all())


def dense_objectives(phi, bmat, a, theta0, eps_std):
    """Both sample-then-optimise objectives in dense form; eps_std ~ N(0, I) per observation."""
    chol = torch.linalg.cholesky(bmat)
    eps = torch.linalg.solve_triangular(chol.transpose(1, 2), eps_std.unsqueeze(2), upper=True)[
        ..., 0
    ]
    theta_n = theta0 + torch.einsum("nmd,nmk,nk->d", phi, chol, eps_std) / a

    def standard(z):
        r = torch.einsum("nmd,d->nm", phi, z) - eps
        return 0.5 * torch.einsum("nm,nmk,nk->", r, bmat, r) + 0.5 * (a * (z - theta0) ** 2).sum()

    def low_variance(z):
        f = torch.einsum("nmd,d->nm", phi, z)
        return 0.5 * torch.einsum("nm,nmk,nk->", f, bmat, f) + 0.5 * (a * (z - theta_n) ** 2).sum()

    return standard, low_variance


@FIXTURE_OK
@given(
    n=st.integers(1, 10),
    m=st.integers(1, 3),
    d=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    kind=kinds,
)
def test_both_objectives_share_the_minimiser(n, m, d, seed, kind):
    feats, _, _, _, h, _, bmat, a = problem(n, m, d, seed, kind, "cpu")
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(d, generator=g, dtype=F64) / a.sqrt()
    eps = torch.randn(n, m, generator=g, dtype=F64)
    chol = torch.linalg.cholesky(bmat)
    z_star = torch.linalg.solve(
        h, a * theta0 + torch.einsum("nmd,nmk,nk->d", feats.matrix, chol, eps)
    )
    for fn in dense_objectives(feats.matrix, bmat, a, theta0, eps):
        z = z_star.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(fn(z), z)
        assert float(grad.norm()) <= 1e-8 * (1 + float((h @ z_star).norm()))


@pytest.mark.parametrize("objective", ["low_variance", "standard"])
def test_sgd_samples_match_cg_samples(device, objective):
    feats, _, noise, prior, _, _, _, _ = problem(40, 2, 5, 11, "matrix", device)
    cfg = SGDConfig(batch_size=40, polyak=0.0, max_epochs=4000, tol=1e-10)
    sgd = posterior_samples(
        feats,
        noise,
        prior,
        3,
        method="sgd",
        objective=objective,
        sgd=cfg,
        generator=torch.Generator().manual_seed(5),
    )
    cg = posterior_samples(
        feats,
        noise,
        prior,
        3,
        method="cg",
        objective=objective,
        generator=torch.Generator().manual_seed(5),
    )
    assert sgd.info.converged
    torch.testing.assert_close(sgd.samples, cg.samples, rtol=1e-5, atol=1e-6)


def test_low_variance_objective_has_quieter_gradients_at_the_optimum():
    # Paper's argument: at the minimiser the standard objective's minibatch gradients carry the noise
    # targets ε, the low-variance objective's do not. Spread over a partition into minibatches.
    n, d, bsz = 400, 4, 20
    feats, _, _, _, h, _, bmat, a = problem(n, 1, d, 2, "scalar", "cpu")
    phi = feats.matrix
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(d, generator=g, dtype=F64) / a.sqrt()
    eps_std = torch.randn(n, 1, generator=g, dtype=F64)
    chol = torch.linalg.cholesky(bmat)
    proj = torch.einsum("nmd,nmk,nk->d", phi, chol, eps_std)
    z = torch.linalg.solve(h, a * theta0 + proj)
    theta_n = theta0 + proj / a
    eps = torch.linalg.solve_triangular(chol.transpose(1, 2), eps_std.unsqueeze(2), upper=True)[
        ..., 0
    ]
    low, std = [], []
    for b in range(0, n, bsz):
        p, bm, e = phi[b : b + bsz], bmat[b : b + bsz], eps[b : b + bsz]
        fz = torch.einsum("nmd,d->nm", p, z)
        low.append(n / bsz * torch.einsum("nmd,nmk,nk->d", p, bm, fz) + a * (z - theta_n))
        std.append(n / bsz * torch.einsum("nmd,nmk,nk->d", p, bm, fz - e) + a * (z - theta0))
    low, std = torch.stack(low), torch.stack(std)
    torch.testing.assert_close(low.mean(0), torch.zeros(d, dtype=F64), atol=1e-9, rtol=0)
    torch.testing.assert_close(std.mean(0), torch.zeros(d, dtype=F64), atol=1e-9, rtol=0)
    assert float(low.var(0).sum()) < 0.5 * float(std.var(0).sum())
