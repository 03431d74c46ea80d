"""Sensitivities and the leave-one-out estimate against dense Jacobians and exact leave-one-out retraining."""

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.ivon import IVON, GaussianPosterior, MultiIVON, ivon_posterior, sensitivity


class Logistic(torch.nn.Module):
    """Binary logistic regression as two logits ``[0, f]`` (so softmax = sigmoid of ``f``)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, 1).double()

    def forward(self, x):
        f = self.lin(x)
        return torch.cat([torch.zeros_like(f), f], -1)


def _data(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64) * 1.5
    y = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(x @ w)).long()
    return x, y


def _newton(x, y, tau, theta=None):
    """MAP of Σ_i ℓ_i + τ/2 ‖θ‖² (θ = [w, b]), float64 Newton; also returns the Hessian there."""
    xt = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    theta = torch.zeros(xt.shape[1], dtype=x.dtype) if theta is None else theta.clone()
    for _ in range(100):
        p = torch.sigmoid(xt @ theta)
        grad = xt.T @ (p - y.double()) + tau * theta
        hess = (xt * (p * (1 - p))[:, None]).T @ xt + tau * torch.eye(len(theta), dtype=x.dtype)
        step = torch.linalg.solve(hess, grad)
        theta = theta - step
        if step.abs().max() < 1e-13:
            break
    return theta, hess


def _exact_loo(x, y, tau, theta):
    """For every i: −log p(y_i) and the logit f_i after retraining without example i, and f_i with it."""
    nll, f_loo = [], []
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        t_i, _ = _newton(x[keep], y[keep], tau, theta)
        f = x[i] @ t_i[:-1] + t_i[-1]
        f_loo.append(f)
        nll.append(-torch.nn.functional.logsigmoid(f if y[i] == 1 else -f))
    return torch.stack(nll).mean().item(), torch.stack(f_loo)


def _spearman(a, b):
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _bind(model, theta):
    with torch.no_grad():
        model.lin.weight.copy_(theta[:-1][None])
        model.lin.bias.copy_(theta[-1:])


@settings(max_examples=8, deadline=None)
@given(n=st.integers(40, 70), d=st.integers(1, 3), seed=st.integers(0, 1000))
def test_loo_estimate_matches_exact_leave_one_out_retraining(n, d, seed):
    """Mean-field Laplace posterior (precision diag H at the MAP) of a logistic regression."""
    x, y = _data(n, d, seed)
    tau = 1.0
    theta, hess = _newton(x, y, tau)
    model = Logistic(d)
    _bind(model, theta)
    std = hess.diagonal().rsqrt()
    post = GaussianPosterior(
        {"lin.weight": theta[:-1][None].clone(), "lin.bias": theta[-1:].clone()},
        {"lin.weight": std[:-1][None], "lin.bias": std[-1:]},
        model,
    )
    loader = [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]
    sens = sensitivity(post, loader)
    exact, f_loo = _exact_loo(x, y, tau, theta)
    f = x @ theta[:-1] + theta[-1]
    assert sens.nll < exact  # the training loss is optimistic ...
    assert abs(sens.loo_nll - exact) <= 0.1 * exact  # ... the estimate is within 10 % of exact LOO
    assert abs(sens.loo_nll - exact) < 0.5 * abs(
        sens.nll - exact
    )  # and much closer than the training NLL
    # the scores rank the examples by their exact leave-one-out change; with one feature the diagonal
    # posterior drops the weight-bias correlation that reorders some examples (61 draws: d = 1 down to
    # 0.46, d = 2-3 all >= 0.85)
    assert _spearman(sens.scores, (f_loo - f).abs()) >= (0.8 if d > 1 else 0.4)
    torch.testing.assert_close(sens.logits[:, 1], f)
    assert torch.equal(sens.index, torch.arange(n))


@pytest.mark.parametrize("tempering", [1, 10])
def test_loo_estimate_of_an_ivon_trained_logistic_regression(tempering):
    """The posterior of a real IVON run (full batch, ess = N, or a cold ess = 10 N read back with
    ``rescaled(10)``), against exact leave-one-out of the MAP."""
    n, d, tau = 60, 2, 1.0
    x, y = _data(n, d, 3)
    model = Logistic(d)
    opt = IVON(model.parameters(), lr=0.5, ess=n * tempering, hess_init=0.1, beta2=0.99,
               weight_decay=tau / (n * tempering), generator=torch.Generator().manual_seed(0))  # fmt: skip
    for _ in range(3000):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    cold = sensitivity(opt, [(x, y)], model=model)
    sens = cold.rescaled(tempering)
    torch.testing.assert_close(sens.variance, cold.variance * tempering)
    theta, _ = _newton(x, y, tau)
    exact, f_loo = _exact_loo(x, y, tau, theta)
    assert abs(sens.loo_nll - exact) <= 0.1 * exact, (sens.loo_nll, exact, sens.nll)
    assert _spearman(sens.scores, (f_loo - (x @ theta[:-1] + theta[-1])).abs()) >= 0.8
    post_sens = sensitivity(ivon_posterior(opt, model), [(x, y)])  # the same through a posterior
    torch.testing.assert_close(post_sens.variance, cold.variance)


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n_in=st.integers(1, 4),
    hidden=st.integers(1, 5),
    classes=st.integers(2, 4),
    seed=st.integers(0, 1000),
)
def test_variance_equals_the_dense_jacobian_form(n_in, hidden, classes, seed, device):
    """V_i = J_i diag(σ²) J_iᵀ with J_i from torch.func.jacrev (a plain module: vmap is fine here)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes)
    ).to(device=device, dtype=torch.float64)
    std = {n: torch.rand_like(p) for n, p in model.named_parameters()}
    std["0.bias"] = torch.zeros_like(std["0.bias"])  # σ = 0: no part in V
    post = GaussianPosterior(
        {n: p.detach().clone() for n, p in model.named_parameters()}, std, model
    )
    x = torch.randn(5, n_in, dtype=torch.float64, device=device)
    y = torch.randint(classes, (5,), device=device)
    sens = sensitivity(post, [(x[:2], y[:2]), (x[2:], y[2:])])
    params = {n: p.detach() for n, p in model.named_parameters()}
    for i in range(5):

        def f(ps, i=i):
            return torch.func.functional_call(model, ps, (x[i : i + 1],))[0]

        jac = torch.func.jacrev(f)(params)
        dense = sum(
            (jac[n].reshape(classes, -1) * std[n].reshape(-1) ** 2) @ jac[n].reshape(classes, -1).T
            for n in params
        )
        torch.testing.assert_close(sens.variance[i], dense, rtol=1e-10, atol=1e-12)
    residual = sens.logits.softmax(-1) - torch.nn.functional.one_hot(y, classes)
    torch.testing.assert_close(sens.shift, (sens.variance @ residual[..., None])[..., 0])
    assert model.training  # eval mode inside, restored after


def test_a_hugging_face_model_gives_the_same_variance_in_any_batch_composition():
    transformers = pytest.importorskip("transformers")
    del transformers
    from tiny_models import tiny_model

    model = tiny_model("bert", seed=0, size="xs")
    opt = IVON(model.parameters(), lr=0.1, ess=100.0, hess_init=0.3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 30, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 6:] = 0
    labels = torch.tensor([0, 1, -100, 1])  # example 2 has no label: skipped
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    together = sensitivity(opt, [batch], model=model)
    one_by_one = sensitivity(
        opt,
        [{k: v[i : i + 1] for k, v in batch.items()} for i in (0, 1, 3)],
        model=model,
    )
    assert together.index.tolist() == [0, 1, 3]
    torch.testing.assert_close(together.variance, one_by_one.variance, rtol=1e-4, atol=1e-9)
    assert (torch.linalg.eigvalsh(together.variance) > -1e-9).all()
    assert math.isfinite(together.loo_nll)
    assert model.training


def test_bad_input_is_named():
    x, y = _data(8, 2, 0)
    model = Logistic(2)
    opt = IVON(model.parameters(), lr=0.1, ess=8)
    post = ivon_posterior(opt, model)
    with pytest.raises(ValueError, match="batch 0 has no labels"):
        sensitivity(post, [x])
    with pytest.raises(ValueError, match="no labelled example"):
        sensitivity(post, [(x, torch.full_like(y, -100))])
    with pytest.raises(ValueError, match="no labelled example"):
        sensitivity(post, [])
    with pytest.raises(ValueError, match=r"batch 1: empty batch"):
        sensitivity(post, [(x, y), (x[:0], y[:0])])
    with pytest.raises(ValueError, match="batch 0: labels must be one class index"):
        sensitivity(post, [(x, y.double())])
    with pytest.raises(ValueError, match="needs model="):
        sensitivity(opt, [(x, y)])
    with pytest.raises(TypeError, match="GaussianPosterior or an IVON"):
        sensitivity(MultiIVON([post, post]), [(x, y)])
    with pytest.raises(RuntimeError, match="inside sampled_params"), opt.sampled_params():
        sensitivity(opt, [(x, y)], model=model)
    with pytest.raises(ValueError, match="factor must be a finite number >= 0"):
        sensitivity(post, [(x, y)]).rescaled(-1.0)
    token = torch.nn.Sequential(
        torch.nn.Linear(2, 3)
    ).double()  # [B, T, C] outputs from [B, T, 2] inputs
    tpost = ivon_posterior(IVON(token.parameters(), lr=0.1, ess=8), token)
    with pytest.raises(ValueError, match=r"logits \[B, C\].*got shape \(1, 4, 3\)"):
        sensitivity(tpost, [(torch.randn(2, 4, 2, dtype=torch.float64), torch.tensor([0, 1]))])


def test_batches_without_labelled_examples_are_skipped_with_one_warning():
    x, y = _data(8, 2, 0)
    model = Logistic(2)
    post = ivon_posterior(IVON(model.parameters(), lr=0.1, ess=8), model)
    with pytest.warns(
        UserWarning, match="skipped 2 of 3 batches with no labelled outputs"
    ) as record:
        sens = sensitivity(
            post, [(x[:4], torch.full((4,), -100)), (x, y), (x[:2], torch.full((2,), -100))]
        )
    assert len(record) == 1
    assert sens.index.tolist() == list(range(4, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sensitivity(post, [(x, y)])
