"""Uncertainty-weighted merging against its closed form, and the squared-gradient precisions."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.ivon import (
    IVON,
    GaussianPosterior,
    MultiIVON,
    ivon_posterior,
    merge,
    squared_gradients,
)


def _linear(d, device, theta=None):
    model = torch.nn.Linear(d, 1, bias=False).to(device=device, dtype=torch.float64)
    if theta is not None:
        with torch.no_grad():
            model.weight.copy_(theta[None])
    return model


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    d=st.integers(1, 6),
    tasks=st.integers(1, 3),
    h0=st.sampled_from([0.0, 0.3, 5.0]),
    seed=st.integers(0, 1000),
)
def test_merge_of_linear_regressions_equals_training_on_all_tasks(d, tasks, h0, seed, device):
    """Task t: ½‖X_t θ − y_t‖² with orthogonal columns (diagonal Hessian H_t), fine-tuned to its least-squares
    θ_t. The merge with H_t is the exact minimiser of Σ_t ½‖X_t θ − y_t‖² + ½ h₀ ‖θ − θ₀‖² (dense solve)."""
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(d, generator=g, dtype=torch.float64).to(device)
    posteriors, normal, rhs = [], h0 * torch.eye(d, dtype=torch.float64), h0 * theta0.cpu()
    for _ in range(tasks):
        q, _ = torch.linalg.qr(torch.randn(d + 5, d, generator=g, dtype=torch.float64))
        scale = torch.rand(d, generator=g, dtype=torch.float64) * 3 + 0.1
        x, y = q * scale, torch.randn(d + 5, generator=g, dtype=torch.float64)
        hess = scale**2  # X_tᵀX_t = diag(scale²)
        theta_t = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
        posteriors.append(
            GaussianPosterior(
                {"weight": theta_t[None].to(device)},
                {"weight": hess.rsqrt()[None].to(device)},  # σ_t² = 1/H_t
                _linear(d, device, theta_t.to(device)),
            )
        )
        normal, rhs = normal + x.T @ x, rhs + x.T @ y
    joint = torch.linalg.solve(normal, rhs)
    base = _linear(d, device, theta0)
    merged = merge(posteriors, base, base_precision=h0)
    torch.testing.assert_close(merged["weight"][0].cpu(), joint, rtol=1e-9, atol=1e-10)
    assert merged["weight"].device == posteriors[0].mean["weight"].device
    given_precisions = [{"weight": p.std["weight"] ** -2} for p in posteriors]
    again = merge(
        posteriors, {"weight": theta0[None]}, precisions=given_precisions, base_precision=h0
    )
    torch.testing.assert_close(again["weight"], merged["weight"], rtol=1e-12, atol=1e-12)


def test_equal_precisions_are_plain_averaging_and_no_information_falls_back_to_it():
    means = [torch.tensor([[1.0, 4.0]]), torch.tensor([[3.0, 0.0]])]
    model = torch.nn.Linear(2, 1, bias=False)
    posts = [GaussianPosterior({"weight": m}, {"weight": torch.ones(1, 2)}, model) for m in means]
    torch.testing.assert_close(merge(posts)["weight"], torch.tensor([[2.0, 2.0]]))
    ones = [{"weight": torch.ones(1, 2)}] * 2
    torch.testing.assert_close(merge(posts, precisions=ones)["weight"], torch.tensor([[2.0, 2.0]]))
    zeros = [{"weight": torch.tensor([[0.0, 1.0]])}, {"weight": torch.tensor([[0.0, 3.0]])}]
    torch.testing.assert_close(merge(posts, precisions=zeros)["weight"], torch.tensor([[2.0, 1.0]]))
    sigma0 = [GaussianPosterior({"weight": m}, {"weight": torch.zeros(1, 2)}) for m in means]
    torch.testing.assert_close(
        merge(sigma0)["weight"], torch.tensor([[2.0, 2.0]])
    )  # σ = 0: no information


def test_merge_of_ivon_fine_tunes_loads_into_the_model():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    posts = []
    for task in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        model.load_state_dict(base.state_dict())
        x, y = torch.randn(16, 3), torch.randint(2, (16,)) * task
        opt = IVON(model.parameters(), lr=0.1, ess=16, beta2=0.9)
        for _ in range(5):
            with opt.sampled_params(train=True):
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        posts.append(ivon_posterior(opt, model))
    merged = merge(posts, base, base_precision=1.0)
    assert set(merged) == {n for n, _ in base.named_parameters()}
    base.load_state_dict(merged, strict=False)
    assert torch.equal(base[0].weight.detach(), merged["0.weight"])


def test_merge_bad_input_names_the_first_mismatch():
    a = GaussianPosterior(
        {"w": torch.zeros(2), "b": torch.zeros(1)}, {"w": torch.ones(2), "b": torch.ones(1)}
    )
    b = GaussianPosterior({"w": torch.zeros(2)}, {"w": torch.ones(2)})
    c = GaussianPosterior(
        {"w": torch.zeros(3), "b": torch.zeros(1)}, {"w": torch.ones(3), "b": torch.ones(1)}
    )
    with pytest.raises(ValueError, match="parameter 'b' is missing from posterior 1"):
        merge([a, b])
    with pytest.raises(ValueError, match="parameter 'b' is missing from posterior 0"):
        merge([b, a])
    with pytest.raises(
        ValueError, match=r"'w' has shape \(3,\) in posterior 1, \(2,\) in posterior 0"
    ):
        merge([a, c])
    with pytest.raises(ValueError, match="do not carry their start point: pass base="):
        merge([a, a], base_precision=1.0)
    with pytest.raises(ValueError, match=r"parameter 'b' of the posteriors is missing in base"):
        merge([a, a], {"w": torch.zeros(2)}, base_precision=1.0)
    with pytest.raises(ValueError, match="base_precision must be a finite number >= 0"):
        merge([a, a], base_precision=-1.0)
    with pytest.raises(
        ValueError, match=r"precisions\[1\]\['w'\] must be a tensor >= 0 of shape \(2,\)"
    ):
        merge(
            [a, a],
            precisions=[
                {"w": torch.ones(2), "b": torch.ones(1)},
                {"w": -torch.ones(2), "b": torch.ones(1)},
            ],
        )
    with pytest.raises(ValueError, match="1 precisions for 2 posteriors"):
        merge([a, a], precisions=[{"w": torch.ones(2), "b": torch.ones(1)}])
    with pytest.raises(TypeError, match="posterior 1 is a MultiIVON"):
        merge([a, MultiIVON([a])])
    with pytest.raises(ValueError, match="at least one"):
        merge([])
    # Issue 34: one posterior, not a list, was a raw "has no len()".
    with pytest.raises(
        TypeError, match="posteriors must be a list of GaussianPosterior, got a Gauss"
    ):
        merge(a)
    torch.testing.assert_close(merge(p for p in (a, a))["w"], merge([a, a])["w"])  # a generator


def test_squared_gradients_equal_the_per_example_closed_form(device):
    """Linear softmax model: ∂ℓ_n/∂W = (p_n − y_n) x_nᵀ, ∂ℓ_n/∂b = p_n − y_n; -100 examples are skipped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4).to(device=device, dtype=torch.float64)
    opt = IVON(model.parameters(), lr=0.1, ess=10)
    post = ivon_posterior(opt, model)
    x = torch.randn(7, 3, dtype=torch.float64, device=device)
    y = torch.tensor([0, 3, -100, 1, 2, 2, 0], device=device)
    sg = squared_gradients(post, [(x[:3], y[:3]), (x[3:], y[3:])], sampled=False)
    kept = y != -100
    resid = torch.softmax(model(x[kept]), -1).detach() - torch.nn.functional.one_hot(y[kept], 4)
    torch.testing.assert_close(
        sg["weight"], (resid[:, :, None] * x[kept][:, None, :]).square().sum(0)
    )
    torch.testing.assert_close(sg["bias"], resid.square().sum(0))
    gen = torch.Generator(device).manual_seed(1)
    sampled = squared_gradients(post, [(x, y)], generator=gen)
    again = squared_gradients(post, [(x, y)], generator=torch.Generator(device).manual_seed(1))
    assert torch.equal(sampled["weight"], again["weight"])  # same seed, same weight samples
    assert not torch.equal(sampled["weight"], sg["weight"])
    for p, m in zip(model.parameters(), post.mean.values(), strict=True):
        assert torch.equal(p.detach(), m)  # the samples were swapped out again
    with pytest.raises(ValueError, match="no labelled example"):
        squared_gradients(post, [(x, torch.full_like(y, -100))])
