import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from partialbayes.selection import KronBlock, Subset
from partialbayes.sgmcmc import SGMCMC, run_chain
from partialbayes.sgmcmc.internal import METHODS


def whole(model):
    return Subset.from_model(model, {n: KronBlock() for n, _ in model.named_parameters()})


def train(model, opt, batches, loss_fn, mask=None):
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if mask is not None:  # the reference optimizer sees only the subset's gradient
            for n, p in model.named_parameters():
                p.grad.mul_(mask[n])
        opt.step()


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    decay=st.sampled_from([0.0, 0.3]),
    lr=st.sampled_from([0.01, 0.2]),
)
def test_sghmc_at_zero_temperature_is_sgd_with_momentum_bit_for_bit(
    helpers, seed, momentum, decay, lr
):
    model = helpers.tiny_net(seed)
    ref = copy.deepcopy(model)
    batches = helpers.x_batches(model, n_batches=6, seed=seed)
    n = 100
    sampler = SGMCMC(
        model,
        whole(model),
        lr=lr,
        num_data=n,
        temperature=0.0,
        momentum=momentum,
        prior_precision=decay * n,
    )
    train(model, sampler, batches * 2, helpers.x_loss)
    train(
        ref,
        torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum, weight_decay=decay),
        batches * 2,
        helpers.x_loss,
    )
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(("method", "momentum"), [("sghmc", 0.8), ("sgld", 0.0)])
def test_zero_temperature_on_a_partial_subset_moves_only_its_entries_as_sgd(
    helpers, method, momentum
):
    model = helpers.tiny_net(1)
    subset = helpers.partial_subset(model)
    ref, before = copy.deepcopy(model), copy.deepcopy(model)
    batches = helpers.x_batches(model, seed=1)
    sampler = SGMCMC(
        model, subset, lr=0.1, num_data=32, method=method, temperature=0.0, momentum=momentum
    )
    train(model, sampler, batches, helpers.x_loss)
    mask = {
        n: (subset.mask(n) if n in subset else torch.zeros_like(p, dtype=torch.bool)).to(p.dtype)
        for n, p in ref.named_parameters()
    }
    train(
        ref,
        torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum),
        batches,
        helpers.x_loss,
        mask,
    )
    for (name, p), q, b in zip(
        model.named_parameters(), ref.parameters(), before.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-15, msg=name)
        outside = mask[name] == 0
        assert torch.equal(p[outside], b[outside]), name


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_same_chain_and_the_model_comes_back(helpers, method):
    model = helpers.tiny_net(2)
    subset = helpers.partial_subset(model)
    before = copy.deepcopy(model.state_dict())
    batches = helpers.x_batches(model, seed=2)
    kw = dict(
        n_steps=10, lr=0.05, num_data=64, method=method, loss_fn=helpers.x_loss, burn_in=4, thin=3
    )
    a, b = (run_chain(model, subset, batches, seed=5, **kw) for _ in range(2))
    c = run_chain(model, subset, batches, seed=6, **kw)
    assert len(a.samples) == 2  # steps 7 and 10
    for n in subset.names:
        assert torch.equal(a.samples[-1][n], b.samples[-1][n])
        assert not torch.equal(a.samples[-1][n], c.samples[-1][n])
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_state_dict_resumes_the_chain_exactly(helpers):
    model = helpers.tiny_net(3)
    subset = helpers.partial_subset(model)
    batches = helpers.x_batches(model, seed=3)
    g = torch.Generator().manual_seed(0)
    sampler = SGMCMC(model, subset, lr=0.05, num_data=64, method="sgnht", generator=g)
    train(model, sampler, batches[:2], helpers.x_loss)
    resumed_model = copy.deepcopy(model)
    resumed = SGMCMC(
        resumed_model,
        subset,
        lr=0.05,
        num_data=64,
        method="sgnht",
        generator=torch.Generator().set_state(g.get_state()),
    )
    resumed.load_state_dict(
        copy.deepcopy(sampler.state_dict())
    )  # as from a file: no shared tensors
    train(model, sampler, batches[2:], helpers.x_loss)
    train(resumed_model, resumed, batches[2:], helpers.x_loss)
    assert resumed.steps == sampler.steps == 4
    assert resumed.friction == sampler.friction
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_learning_rate_schedulers_drive_the_step(helpers):
    model = helpers.tiny_net(4)
    sampler = SGMCMC(model, whole(model), lr=0.1, num_data=10, temperature=0.0)
    sched = torch.optim.lr_scheduler.StepLR(sampler, step_size=1, gamma=0.5)
    train(model, sampler, helpers.x_batches(model, n_batches=1), helpers.x_loss)
    sched.step()
    assert sampler.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"method": "nuts"}, ValueError, "method"),
        ({"lr": 0.0}, ValueError, "lr"),
        ({"lr": float("nan")}, ValueError, "lr"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"prior_precision": -1.0}, ValueError, "prior_precision"),
        ({"num_data": 0}, ValueError, "num_data"),
        ({"num_data": 2.5}, TypeError, "num_data"),
        ({"thin": 0}, ValueError, "thin"),
        ({"burn_in": True}, TypeError, "burn_in"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_bad_settings_are_named(helpers, kwargs, error, match):
    model = helpers.tiny_net()
    options = {"lr": 0.1, "num_data": 10, **kwargs}
    with pytest.raises(error, match=match):
        SGMCMC(model, helpers.partial_subset(model), **options)


def test_bad_use_is_explained(helpers):
    model = helpers.tiny_net()
    subset = helpers.partial_subset(model)
    with pytest.raises(TypeError, match="Subset"):
        SGMCMC(model, {"fc1.weight": None}, lr=0.1, num_data=10)
    with pytest.raises(ValueError, match="subset is empty"):
        SGMCMC(model, Subset.from_model(model, {}), lr=0.1, num_data=10)
    sampler = SGMCMC(model, subset, lr=0.1, num_data=10)
    with pytest.raises(ValueError, match="no gradient"):
        sampler.step()
    with pytest.raises(ValueError, match="no sample kept"):
        sampler.posterior()
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(ValueError, match=r"NaN or inf entries in 'fc1\.weight' at step 1"):
        sampler.step()
    model = helpers.tiny_net()
    with pytest.raises(ValueError, match="non-finite loss"):
        run_chain(
            model,
            subset,
            [None],
            n_steps=1,
            lr=0.1,
            num_data=10,
            loss_fn=lambda m, b: torch.tensor(float("inf"), requires_grad=True),
        )
    with pytest.raises(ValueError, match="no batch"):
        run_chain(model, subset, [], n_steps=1, lr=0.1, num_data=10)


def test_on_each_device_zero_temperature_is_sgd_and_a_seed_fixes_the_chain(helpers, device):
    """On CUDA a dtype's tensors move together (foreach kernels, as torch.optim.SGD's default there)."""
    model = helpers.tiny_net(5, device=device)
    ref = copy.deepcopy(model)
    batches = helpers.x_batches(model, seed=5)
    sampler = SGMCMC(
        model, whole(model), lr=0.1, num_data=50, temperature=0.0, prior_precision=10.0
    )
    train(model, sampler, batches, helpers.x_loss)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.2)
    train(ref, sgd, batches, helpers.x_loss)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    subset = helpers.partial_subset(model)
    kw = dict(n_steps=4, lr=0.05, num_data=64, loss_fn=helpers.x_loss, burn_in=3)
    for method in METHODS:
        a, b = (run_chain(model, subset, batches, method=method, seed=1, **kw) for _ in range(2))
        for n in subset.names:
            assert torch.equal(a.samples[-1][n], b.samples[-1][n])
            assert not torch.equal(a.samples[-1][n], a.current()[n])  # the chain moved
