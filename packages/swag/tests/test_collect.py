"""SWAG.collect against numpy, masked SGD against a dense torch.optim.SGD reference, frozen entries."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.swag import SWAG, collect_swag

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def assert_close(actual, expected, rtol=1e-7, atol=1e-12):
    """numpy's assert_allclose on tensors (torch.testing imports torch.distributed: slow to import)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


@given(n=st.integers(1, 12), k_max=st.integers(2, 6), seed=st.integers(0, 2**16))
@pytest.mark.parametrize(
    "device", DEVICES
)  # hypothesis and the function-scoped `device` fixture do not mix
def test_collect_matches_numpy_moments_and_last_k_centred_columns(helpers, device, n, k_max, seed):
    model = helpers.tiny_net(seed, device=device)
    subset = helpers.partial_subset(model, seed)
    swag = SWAG(model, subset, max_rank=k_max)
    snaps = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(device))
        snaps.append(helpers.gathered(model, subset).cpu().numpy())
        swag.collect(model)
    snaps = np.stack(snaps)
    assert swag.num_entries == subset.num_entries() == snaps.shape[1]
    assert swag.n_snapshots == n
    np.testing.assert_allclose(swag.mean.cpu().numpy(), snaps.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(swag.variance.cpu().numpy(), snaps.var(0), rtol=1e-9, atol=1e-10)
    running = np.cumsum(snaps, 0) / np.arange(1, n + 1)[:, None]
    np.testing.assert_allclose(
        swag.deviations.cpu().numpy(), (snaps - running)[-k_max:].T, rtol=1e-10, atol=1e-12
    )


@given(lr=st.sampled_from([1e-2, 1e-1]), seed=st.integers(0, 2**16), wd=st.sampled_from([0, 0.1]))
@pytest.mark.parametrize("device", DEVICES)
def test_masked_sgd_matches_torch_sgd_with_masked_gradient(helpers, device, lr, seed, wd):
    model = helpers.tiny_net(seed, device=device)
    subset = helpers.partial_subset(model, seed)
    batches = helpers.x_batches(model, seed=seed)
    n_steps, every = 12, 3
    swag = collect_swag(
        model,
        subset,
        batches,
        lr=lr,
        n_steps=n_steps,
        snapshot_every=every,
        max_rank=3,
        weight_decay=wd,
        loss_fn=helpers.x_loss,
        progress=False,
    )
    # Dense reference: the torch.optim.SGD rule (buf <- 0.9 buf + g, p <- p - lr buf) on whole storage-shaped
    # tensors with the gradient masked to the subset (torch.optim itself imports torch._dynamo: seconds).
    ref = helpers.tiny_net(seed, device=device)
    names = list(subset.names)
    params = dict(ref.named_parameters())
    bufs = {n: torch.zeros_like(params[n]) for n in names}
    snaps = []
    for step in range(1, n_steps + 1):
        for p in ref.parameters():
            p.grad = None
        helpers.x_loss(ref, batches[(step - 1) % len(batches)]).backward()
        with torch.no_grad():
            for n in names:
                grad = (params[n].grad + wd * params[n]) * subset.mask(n).to(
                    device, params[n].dtype
                )
                bufs[n].mul_(0.9).add_(grad)
                params[n].sub_(lr * bufs[n])
        if step % every == 0:
            snaps.append(helpers.gathered(ref, subset))
    snaps = torch.stack(snaps)
    assert swag.n_snapshots == n_steps // every
    assert_close(swag.mean.cpu(), snaps.mean(0), rtol=1e-10, atol=1e-12)
    assert_close(swag.variance.cpu(), snaps.var(0, unbiased=False), rtol=1e-8, atol=1e-12)


def test_frozen_entries_never_change_and_map_is_restored(helpers, device):
    model = helpers.tiny_net(1, device=device)
    subset = helpers.partial_subset(model, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n: ~subset.mask(n).to(device) if n in subset.names else None for n in before}
    seen = []

    def checking_loss(m, batch):
        for n, p in m.named_parameters():
            keep = frozen[n]
            if keep is None:
                assert torch.equal(p, before[n]), f"{n} changed"
            else:
                assert torch.equal(p[keep], before[n][keep]), f"frozen entries of {n} changed"
        seen.append(helpers.gathered(m, subset).cpu())
        return helpers.x_loss(m, batch)

    model.eval()
    swag = collect_swag(
        model,
        subset,
        helpers.x_batches(model, seed=1),
        lr=0.1,
        n_steps=10,
        snapshot_every=2,
        max_rank=3,
        loss_fn=checking_loss,
        progress=False,
    )
    assert len(seen) == 10
    assert not torch.equal(seen[0], seen[-1])  # the stochastic entries did move
    assert bool((swag.variance > 0).all())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])  # back at the MAP
        assert p.requires_grad
    assert not model.training  # mode restored


def test_snapshots_reproducible_by_seed(helpers):
    def run():
        model = helpers.tiny_net(3)
        subset = helpers.partial_subset(model, 3)
        swag = collect_swag(
            model,
            subset,
            helpers.x_batches(model, seed=3),
            lr=0.05,
            n_steps=8,
            snapshot_every=2,
            max_rank=3,
            loss_fn=helpers.x_loss,
            progress=False,
        )
        return swag, swag.sample_flat(4, generator=torch.Generator().manual_seed(9))

    (a, sa), (b, sb) = run(), run()
    assert torch.equal(a.mean, b.mean)
    assert torch.equal(a.deviations, b.deviations)
    assert torch.equal(sa, sb)


def test_fewer_than_k_snapshots_use_the_number_collected(helpers):
    model = helpers.tiny_net(0)
    swag = SWAG(model, helpers.partial_subset(model), max_rank=20)
    for _ in range(3):
        with torch.no_grad():
            model.fc1.weight.add_(1.0)
            model.fc2.weight.mul_(1.5)
        swag.collect(model)
    assert swag.deviations.shape == (swag.num_entries, 3)
    assert swag.sample_flat(2).shape == (2, swag.num_entries)
    draws = swag.sample(2)
    assert list(draws) == list(swag.subset.names)
    assert sum(v.shape[1] for v in draws.values()) == swag.num_entries
    assert swag.num_floats == 22 * swag.num_entries


def test_diagonal_only_stores_no_deviations(helpers):
    model = helpers.tiny_net(0)
    swag = SWAG(model, helpers.partial_subset(model), diagonal_only=True, max_rank=0)
    swag.collect(model)
    assert swag.deviations is None
    assert swag.num_floats == 2 * swag.num_entries
    assert_close(swag.sample_flat(), swag.mean)  # one snapshot: zero variance


def test_gather_order_matches_subset_gather(helpers):
    model = helpers.tiny_net(4)
    subset = helpers.partial_subset(model, 4)
    swag = SWAG(model, subset)
    assert_close(swag.current(model), helpers.gathered(model, subset))
    parts = swag.unflatten(swag.current(model))
    for n in subset.names:
        assert torch.equal(parts[n], subset.gather(n, dict(model.named_parameters())[n].detach()))


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_loss_stops_naming_the_step_and_restores_map(helpers, bad):
    from partialbayes.swag import NonFiniteLossError

    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        loss = helpers.x_loss(m, batch)
        return loss * float(bad) if len(calls) == 4 else loss

    with pytest.raises(NonFiniteLossError, match="step 4") as err:
        collect_swag(
            model,
            subset,
            helpers.x_batches(model),
            lr=0.1,
            n_steps=10,
            snapshot_every=2,
            loss_fn=loss_fn,
            progress=False,
        )
    assert err.value.step == 4
    assert isinstance(err.value, ValueError)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_bfloat16_model_keeps_float32_moments_and_restores_map(helpers):
    model = helpers.tiny_net(2, dtype=torch.bfloat16)
    subset = helpers.partial_subset(model, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    swag = collect_swag(
        model,
        subset,
        helpers.x_batches(model, seed=2),
        lr=0.1,
        n_steps=6,
        snapshot_every=2,
        max_rank=3,
        loss_fn=helpers.x_loss,
        dtype=torch.float32,
        progress=False,
    )
    assert swag.mean.dtype == torch.float32
    assert bool(torch.isfinite(swag.sample_flat(2)).all())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_summary_and_a_negligible_spread_is_warned(helpers):
    # Issue 34: after a Trainer run, median σ 1.1e-5 against median |w| 4.5e-2: the predictive equalled
    # the MAP's, and SWAG had no summary() to show it.
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    options = dict(n_steps=12, snapshot_every=3, max_rank=3, loss_fn=helpers.x_loss, progress=False)
    batches = helpers.x_batches(model)
    with pytest.warns(
        RuntimeWarning, match=r"collect_swag: the SWAG spread is negligible \(median σ"
    ):
        tiny = collect_swag(model, subset, batches, lr=1e-9, **options)
    sigma, size = tiny.spread()
    assert sigma < 1e-3 * size
    assert f"{tiny.num_entries} stochastic entries" in tiny.summary()
    assert "4 snapshots" in tiny.summary()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wide = collect_swag(model, subset, batches, lr=0.5, **options)
    sigma, size = wide.spread()
    draws = wide.sample_flat(20_000, generator=torch.Generator().manual_seed(0))
    # the sample std of 20,000 draws is within 1 % of σ per entry (relative s.e. 1/sqrt(2n) = 0.5 %)
    assert sigma == pytest.approx(float(draws.std(0).median()), rel=0.02)
    assert f"median σ {sigma:.3g}" in wide.summary()
    empty = SWAG(model, subset, max_rank=3)
    assert "too few snapshots" in empty.summary()
