"""Continual learning: the previous episode's Laplace posterior as the next prior (issue 35).

Dense float64 reference: on a linear-Gaussian problem (one output, so KFAC is exact and the factors of two
episodes add up to those of their union), two Laplace updates on the two halves of the data equal one update
on all of it: the same precision, the same linearised predictive, and evidences that chain,
``log p(D₁) + log p(D₂ | D₁) = log p(D)``.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace, LaplaceBase
from partialbayes.selection import KronBlock, Subset

SIGMA, DELTA = 0.7, 1.5


def problem(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, d, generator=g, dtype=torch.float64)
    y = x @ torch.randn(d, 1, generator=g, dtype=torch.float64) + 0.3
    return x, y + SIGMA * torch.randn(2 * n, 1, generator=g, dtype=torch.float64)


def features(x):
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)  # bias folded: (x, 1)


def map_and_precision(x, y, prior_mean, prior_precision):
    """The closed-form posterior of (weight, bias) under N(prior_mean, prior_precision⁻¹)."""
    f = features(x)
    precision = prior_precision + f.T @ f / SIGMA**2
    mean = torch.linalg.solve(precision, prior_precision @ prior_mean + f.T @ y[:, 0] / SIGMA**2)
    return mean, precision


def model_at(theta, d):
    model = nn.Linear(d, 1).double().eval()
    with torch.no_grad():
        model.weight.copy_(theta[:d].view(1, d))
        model.bias.copy_(theta[d:])
    return model


def laplace(cls, model, x, y, **kw):
    subset = Subset.from_model(model, {"weight": KronBlock(), "bias": KronBlock()})
    return cls(model, subset, likelihood="regression", sigma_noise=SIGMA, prior_precision=DELTA)


def fit(cls, theta, x, y, d, previous=None):
    model = model_at(theta, d)
    post = laplace(cls, model, x, y)
    return post.fit([(x[i : i + 3], y[i : i + 3]) for i in range(0, len(x), 3)], previous=previous)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(4, 9), d=st.integers(1, 3))
def test_two_kron_updates_on_two_halves_equal_one_update_on_all(seed, n, d):
    x, y = problem(seed, n, d)
    (x1, y1), (x2, y2) = (x[:n], y[:n]), (x[n:], y[n:])
    zero, prior = (
        torch.zeros(d + 1, dtype=torch.float64),
        DELTA * torch.eye(d + 1, dtype=torch.float64),
    )
    theta1, p1 = map_and_precision(x1, y1, zero, prior)
    theta2, p2 = map_and_precision(x2, y2, theta1, p1)  # the second episode with the first as prior
    theta_all, p_all = map_and_precision(x, y, zero, prior)
    torch.testing.assert_close(p2, p_all)
    torch.testing.assert_close(theta2, theta_all)  # Bayes' rule, the reference's own check
    first = fit(KronLaplace, theta1, x1, y1, d)
    second = fit(KronLaplace, theta2, x2, y2, d, previous=first)
    once = fit(KronLaplace, theta_all, x, y, d)
    assert second.n_seen == once.n_seen == 2 * n
    torch.testing.assert_close(second.log_det(), torch.logdet(p_all), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(once.log_det(), torch.logdet(p_all), rtol=1e-10, atol=1e-10)
    test = torch.randn(5, d, dtype=torch.float64)
    for a, b in zip(second.logit_mean_cov(test), once.logit_mean_cov(test), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    chained = first.log_marginal_likelihood() + second.log_marginal_likelihood()
    torch.testing.assert_close(chained, once.log_marginal_likelihood(), rtol=1e-10, atol=1e-9)
    # ... and against the exact evidence of the linear-Gaussian model
    f = features(x)
    cov = SIGMA**2 * torch.eye(2 * n, dtype=torch.float64) + f @ f.T / DELTA
    exact = torch.distributions.MultivariateNormal(torch.zeros(2 * n, dtype=torch.float64), cov)
    torch.testing.assert_close(chained, exact.log_prob(y[:, 0]), rtol=1e-10, atol=1e-9)
    # the training term: the penalty is ½ (θ − θ₁)ᵀ P₁ (θ − θ₁), and episode 2's loss is minimal at θ_all
    model = model_at(theta_all, d)
    pen = first.penalty(model)
    dev = theta_all - theta1
    torch.testing.assert_close(pen, 0.5 * dev @ p1 @ dev, rtol=1e-10, atol=1e-12)
    loss = ((model(x2) - y2) ** 2).sum() / (2 * SIGMA**2) + pen
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert max(float(gr.abs().max()) for gr in grads) < 1e-9


def test_two_diag_updates_add_the_diagonals_and_centre_the_prior_on_the_previous_map():
    x, y = problem(0, 6, 3)
    theta = torch.randn(4, dtype=torch.float64)
    first = fit(DiagLaplace, theta, x[:6], y[:6], 3)
    second = fit(DiagLaplace, theta + 0.1, x[6:], y[6:], 3, previous=first)
    once = fit(DiagLaplace, theta + 0.1, x, y, 3)
    torch.testing.assert_close(second.log_det(), once.log_det(), rtol=1e-12, atol=0)
    test = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(second.logit_mean_cov(test)[1], once.logit_mean_cov(test)[1])
    # evidence of episode 2: log p(D₂|θ₂) − ½ (log det P₂ − log det P₁) − ½ (θ₂ − θ₁)ᵀ P₁ (θ₂ − θ₁)
    p1 = torch.cat([first._h[n] for n in ("weight", "bias")]) + DELTA
    dev = torch.full((4,), 0.1, dtype=torch.float64)
    expected = (
        second.log_likelihood()
        - 0.5 * (second.log_det() - p1.log().sum())
        - 0.5 * (p1 * dev**2).sum()
    )
    torch.testing.assert_close(second.log_marginal_likelihood(), expected)
    torch.testing.assert_close(first.penalty(model_at(theta + 0.1, 3)), 0.5 * (p1 * dev**2).sum())
    # a temperature enters both: P = H / T + P_prev with P_prev = H_prev / T + δ
    warm = [laplace(DiagLaplace, model_at(theta, 3), x, y) for _ in range(2)]
    for w in warm:
        w.temperature = 2.0
    a = warm[0].fit([(x[:6], y[:6])])
    b = warm[1].fit([(x[6:], y[6:])], previous=a)
    h = torch.cat([b._h[n] for n in ("weight", "bias")])
    torch.testing.assert_close(b.log_det(), (h / 2 + DELTA).log().sum())


def test_previous_is_checked_and_a_loaded_posterior_keeps_what_it_can(tmp_path):
    x, y = problem(1, 6, 2)
    theta = torch.zeros(3, dtype=torch.float64)
    first = fit(KronLaplace, theta, x[:6], y[:6], 2)
    with pytest.raises(TypeError, match="previous must be a fitted KronLaplace"):
        fit(KronLaplace, theta, x, y, 2, previous=fit(DiagLaplace, theta, x, y, 2))
    with pytest.raises(TypeError, match="DenseLaplace does not take a previous"):
        fit(DenseLaplace, theta, x, y, 2, previous=first)
    with pytest.raises(NotImplementedError, match="DenseLaplace has no penalty"):
        fit(DenseLaplace, theta, x, y, 2).penalty()
    model = model_at(theta, 2)
    cold = laplace(KronLaplace, model, x, y)
    cold.temperature = 0.5
    with pytest.raises(ValueError, match="temperature"):
        cold.fit([(x, y)], previous=first)
    with pytest.raises(RuntimeError, match="not fitted"):
        fit(KronLaplace, theta, x, y, 2, previous=laplace(KronLaplace, model, x, y))
    second = fit(KronLaplace, theta + 0.2, x[6:], y[6:], 2, previous=first)
    assert second._previous._previous is None  # no chain of every episode is kept
    third = fit(KronLaplace, theta + 0.3, x[:3], y[:3], 2, previous=second)
    assert third.n_seen == 15
    assert math.isfinite(float(third.log_marginal_likelihood()))
    path = tmp_path / "second.safetensors"
    second.save(path)
    loaded = LaplaceBase.load(path, model_at(theta + 0.2, 2))
    assert loaded.n_seen == 12
    torch.testing.assert_close(loaded.log_det(), second.log_det())
    with pytest.raises(ValueError, match="does not keep the previous"):
        loaded.log_marginal_likelihood()
    again = fit(KronLaplace, theta + 0.3, x[:3], y[:3], 2, previous=loaded)  # still a prior
    torch.testing.assert_close(again.log_det(), third.log_det())


def test_kron_with_a_separate_bias_accumulates_like_one_fit_on_all_the_data():
    x, y = problem(2, 7, 3)
    theta = torch.randn(4, dtype=torch.float64)

    def fitted(xs, ys, previous=None):
        model = model_at(theta, 3)
        subset = Subset.from_model(model, {"weight": KronBlock(), "bias": KronBlock()})
        post = KronLaplace(
            model, subset, likelihood="regression", sigma_noise=SIGMA, bias="separate"
        )
        return post.fit([(xs, ys)], previous=previous)

    second = fitted(x[7:], y[7:], previous=fitted(x[:7], y[:7]))
    once = fitted(x, y)
    torch.testing.assert_close(second.log_det(), once.log_det(), rtol=1e-12, atol=1e-12)
    test = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(second.logit_mean_cov(test)[1], once.logit_mean_cov(test)[1])
