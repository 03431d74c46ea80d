import pytest
import torch
from torch import nn

from partialbayes.predictive.testing import check_posterior
from partialbayes.selection import KronBlock, Subset
from partialbayes.sgmcmc import SampledPosterior, parallel_chains, run_chain


def chain(helpers, model, **kw):
    subset = helpers.partial_subset(model)
    batches = helpers.x_batches(model, seed=0)
    options = dict(n_steps=12, lr=0.05, num_data=64, loss_fn=helpers.x_loss, burn_in=2, thin=2)
    return run_chain(model, subset, batches, **{**options, **kw}), batches


@pytest.mark.parametrize("method", ["sghmc", "sgld"])
def test_serial_chain_posterior_conforms(helpers, tmp_path, method):
    model = helpers.tiny_net(0)
    sampler, batches = chain(helpers, model, method=method)
    post = sampler.posterior()
    assert post.num_samples == 5
    assert post.num_floats == 5 * post.subset.num_entries()
    check_posterior(post, batches[0]["x"], tmp_path / "p.safetensors")


def test_parallel_chains_are_an_ensemble_of_last_states(helpers, tmp_path):
    model = helpers.tiny_net(1)
    subset = helpers.partial_subset(model)
    batches = helpers.x_batches(model, seed=1)
    kw = dict(n_steps=6, lr=0.05, num_data=64, loss_fn=helpers.x_loss)
    ens = parallel_chains(model, subset, batches, n_chains=3, seed=7, **kw)
    for c in range(3):  # member c is the last state of the chain with seed 7 + c
        last = run_chain(model, subset, batches, seed=7 + c, burn_in=5, **kw).samples[-1]
        for n in subset.names:
            assert torch.equal(ens.samples[n][c], last[n])
    # at T = 0 with one data order the members coincide: an ensemble differs by its data order only
    cold = parallel_chains(model, subset, batches, n_chains=2, temperature=0.0, **kw)
    shuffled = parallel_chains(
        model, subset, lambda c: batches[c:] + batches[:c], n_chains=2, temperature=0.0, **kw
    )
    name = subset.names[0]
    assert torch.equal(cold.samples[name][0], cold.samples[name][1])
    assert not torch.equal(shuffled.samples[name][0], shuffled.samples[name][1])
    check_posterior(ens, batches[0]["x"], tmp_path / "e.safetensors")
    joined = SampledPosterior.concat([ens, cold])
    assert joined.num_samples == 5
    assert torch.equal(joined.samples[name][3:], cold.samples[name])


def test_predict_without_n_samples_averages_every_stored_sample_once(helpers):
    model = helpers.tiny_net(2)
    post = chain(helpers, model)[0].posterior()
    x = torch.randn(5, 4, dtype=torch.float64)
    probs = []
    for s in range(post.num_samples):
        with torch.no_grad(), post.swapped({n: v[s] for n, v in post.samples.items()}) as m:
            probs.append(m(x).softmax(-1))
    torch.testing.assert_close(post.predict(x), torch.stack(probs).mean(0))
    assert post.predictive_samples(x).shape == (post.num_samples, 5, 3)


def test_regression_posterior_conforms(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    subset = Subset.from_model(model, {"weight": KronBlock(rows=torch.tensor([1]))})
    data = [(torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64))]
    mse = lambda m, b: ((m(b[0]) - b[1]) ** 2).sum(1).mean() / 2  # noqa: E731
    post = run_chain(model, subset, data, n_steps=5, lr=0.01, num_data=8, loss_fn=mse).posterior(
        likelihood="regression", sigma_noise=0.5
    )
    check_posterior(post, data[0], tmp_path / "r.safetensors", regression=True)


def test_bad_samples_and_files_are_refused(helpers, tmp_path):
    model = helpers.tiny_net(3)
    post = chain(helpers, model)[0].posterior()
    good = dict(post.samples)
    name = post.subset.names[0]
    with pytest.raises(ValueError, match="NaN"):
        SampledPosterior(model, post.subset, {**good, name: good[name] * float("nan")})
    with pytest.raises(ValueError, match="one number"):
        SampledPosterior(model, post.subset, {**good, name: good[name][:1]})
    with pytest.raises(ValueError, match="cover the subset"):
        SampledPosterior(model, post.subset, {name: good[name]})
    with pytest.raises(TypeError, match="mapping"):
        SampledPosterior(model, post.subset, good[name])
    with pytest.raises(ValueError, match="likelihood"):
        SampledPosterior(model, post.subset, good, likelihood="poisson")
    with pytest.raises(ValueError, match="concat"):
        SampledPosterior.concat([])
    path = tmp_path / "p.safetensors"
    post.save(path)
    with pytest.raises(ValueError, match="does not match"):
        SampledPosterior.load(path, helpers.tiny_net(0, hidden=6))
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="safetensors"):
        SampledPosterior.load(tmp_path / "junk.safetensors", model)


def test_chains_compute_gradients_of_the_subsets_tensors_only(helpers):
    """Backward stops below the subset (fc1.bias frozen, fc2.bias outside it); flags come back after."""
    model = helpers.tiny_net(2)
    subset = Subset.from_model(model, {"fc2.weight": KronBlock(rows=torch.tensor([0, 1]))})
    model.fc1.bias.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    seen = []

    def loss(m, batch):
        seen.append({n for n, p in m.named_parameters() if p.requires_grad})
        return helpers.x_loss(m, batch)

    batches = helpers.x_batches(model, seed=2)
    run_chain(model, subset, batches, n_steps=3, lr=0.05, num_data=64, loss_fn=loss)
    assert seen == [{"fc2.weight"}] * 3
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert all(p.grad is None for p in model.parameters())


def test_the_default_loss_refuses_labels_out_of_range(helpers):
    """A class label >= C (or a float label) is refused by name before cross-entropy sees it."""
    model = helpers.tiny_net(4)
    subset = helpers.partial_subset(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    for labels, error, words in [
        (torch.tensor([0, 1, 3, 2, -100, 1]), ValueError, "must lie in \\[0, 3\\)"),
        (torch.zeros(6), TypeError, "integer tensor"),
    ]:
        with pytest.raises(error, match=words):
            run_chain(model, subset, [{"x": x, "labels": labels}], n_steps=2, lr=0.01, num_data=6)
    ok = torch.tensor([0, 1, 2, 2, -100, 1])
    run_chain(model, subset, [{"x": x, "labels": ok}], n_steps=2, lr=0.01, num_data=6)
