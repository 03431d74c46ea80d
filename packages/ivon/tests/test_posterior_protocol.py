"""GaussianPosterior and MultiIVON as partialbayes Posteriors: conformance, layout, mixtures, bad input."""

import pytest
import torch

from partialbayes.ivon import IVON, GaussianPosterior, MultiIVON, ivon_posterior
from partialbayes.predictive import Posterior, average_softmax
from partialbayes.predictive.testing import check_posterior
from partialbayes.selection import KronBlock, MaskBlock, Subset

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402


def _mlp(device, seed=0, n_out=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, n_out)
    ).to(device=device, dtype=torch.float64)


def _pairs(device, n_out=3, regression=False, n_batches=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        y = (
            torch.randn(8, generator=g, dtype=torch.float64)
            if regression
            else torch.randint(0, n_out, (8,), generator=g)
        )
        out.append((x.to(device), y.to(device)))
    return out


def _train(model, data, loss_fn, opt, steps=4):
    for step in range(steps):
        batch = data[step % len(data)]
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss_fn(model, batch).backward()
        opt.step()


def _ce(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _mse(model, batch):
    return ((model(batch[0]).squeeze(-1) - batch[1]) ** 2).mean()


def _hf_loss(model, batch):
    return model(**batch).loss


def _tiny_token_bert(device, seed=0):
    model = tiny_model("bert", "token", seed=seed, intermediate=16, num_labels=3)
    return model.to(device).eval()


def _token_batches(device, n_batches=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        mask = torch.ones(4, 6, dtype=torch.long)
        mask[1, 3:] = 0
        labels = torch.randint(0, 3, (4, 6), generator=g)
        labels[mask == 0] = -100
        enc = {"input_ids": torch.randint(1, 30, (4, 6), generator=g), "attention_mask": mask,
               "labels": labels}  # fmt: skip
        out.append(transformers.BatchEncoding({k: v.to(device) for k, v in enc.items()}))
    return out


def _gaussian(device, kind, seed=0):
    """A trained GaussianPosterior and one of its batches, for each kind of model."""
    g = torch.Generator(device).manual_seed(seed)
    if kind == "tokens":
        model = _tiny_token_bert(device, seed)
        data = _token_batches(device, seed=seed)
        opt = IVON(model.parameters(), lr=0.05, ess=100, hess_init=1.0, generator=g)
        _train(model, data, _hf_loss, opt)
        return ivon_posterior(opt, model), data[0]
    regression = kind == "regression"
    model = _mlp(device, seed, n_out=1 if regression else 3)
    data = _pairs(device, n_out=1 if regression else 3, regression=regression, seed=seed)
    if kind == "subset":
        subset = Subset.from_model(
            model, {"2.weight": KronBlock(rows=torch.tensor([0, 2])), "0.bias": MaskBlock(
                torch.tensor([True, False, True, True, False, False]))}
        )  # fmt: skip
        opt = IVON.from_subset(model, subset, lr=0.05, ess=50, hess_init=1.0, generator=g)
    else:
        opt = IVON(model.parameters(), lr=0.05, ess=50, hess_init=1.0, generator=g)
    _train(model, data, _mse if regression else _ce, opt)
    post = ivon_posterior(
        opt, model, likelihood="regression" if regression else "classification", sigma_noise=0.2
    )
    return post, data[0]


@pytest.mark.parametrize("kind", ["classification", "subset", "regression", "tokens"])
def test_gaussian_posterior_conforms(device, tmp_path, kind):
    post, batch = _gaussian(device, kind)
    assert isinstance(post, Posterior)
    check_posterior(post, batch, tmp_path / "ivon.safetensors", regression=kind == "regression")
    loaded = GaussianPosterior.load(tmp_path / "ivon.safetensors", post.model)
    assert loaded.likelihood == post.likelihood
    assert loaded.sigma_noise == 0.2 or kind == "tokens"


@pytest.mark.parametrize("kind", ["classification", "tokens"])
def test_multi_ivon_conforms(device, tmp_path, kind):
    if kind == "tokens":
        # runs from one initialisation that differ only in their noise: every trained entry differs
        posts = []
        for seed in range(2):
            model = _tiny_token_bert(device, 0)
            data = _token_batches(device)
            opt = IVON(model.parameters(), lr=0.05, ess=100, hess_init=1.0,
                       generator=torch.Generator(device).manual_seed(seed))  # fmt: skip
            _train(model, data, _hf_loss, opt, steps=2)
            posts.append(ivon_posterior(opt, model))
        batch = data[0]
    else:
        posts = [_gaussian(device, "classification", seed)[0] for seed in range(3)]
        batch = _pairs(device)[0]
    mix = MultiIVON(posts)
    assert isinstance(mix, Posterior)
    check_posterior(mix, batch, tmp_path / "mix.safetensors")
    assert len(MultiIVON.load(tmp_path / "mix.safetensors", mix.model).components) == len(posts)


def test_predict_is_the_average_softmax_of_predictive_samples(device):
    post, batch = _gaussian(device, "subset")
    mix = MultiIVON([post, _gaussian(device, "subset", seed=1)[0]])
    for p in (post, mix):
        probs = p.predict(batch, n_samples=5, generator=torch.Generator(device).manual_seed(3))
        logits = p.predictive_samples(batch, 5, generator=torch.Generator(device).manual_seed(3))
        torch.testing.assert_close(probs, average_softmax(logits), rtol=1e-12, atol=1e-12)


def test_sample_layout_and_statistics_on_a_subset(device):
    post, _ = _gaussian(device, "subset")
    subset = post.subset
    assert list(subset.names) == ["0.bias", "2.weight"]
    assert subset.num_entries("0.bias") == 3
    assert subset.num_entries("2.weight") == 12
    n = 4000
    draws = post.sample(n, generator=torch.Generator(device).manual_seed(0))
    for name in subset.names:
        mean = subset.gather(name, post.mean[name])
        std = subset.gather(name, post.std[name])
        assert draws[name].shape == (n, subset.num_entries(name))
        assert (std > 0).all()
        z = (draws[name].mean(0) - mean) / (std / n**0.5)
        assert z.abs().max() < 4.5
        assert ((draws[name].std(0) / std) - 1).abs().max() < 5 / (2 * n) ** 0.5
    # swapping one sample writes exactly those entries
    one = {k: v[7] for k, v in draws.items()}
    with post.swapped(one) as model:
        params = dict(model.named_parameters())
        for name in subset.names:
            torch.testing.assert_close(subset.gather(name, params[name].detach()), one[name])


def test_mixture_subset_is_where_the_runs_differ_and_samples_are_stratified(device):
    model = _mlp(device)
    names = [n for n, _ in model.named_parameters()]
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero = {n: torch.zeros_like(p) for n, p in base.items()}
    runs = []
    for k in range(3):
        mean = {n: t.clone() for n, t in base.items()}
        mean["2.bias"][1] += k + 1.0  # the runs differ in one entry, without noise
        std = dict(zero)
        std["0.weight"] = torch.full_like(base["0.weight"], 1e-3) * (k == 0)  # noise in run 0 only
        runs.append(GaussianPosterior(mean, std, model if k == 0 else None))
    mix = MultiIVON(runs)
    assert mix.model is model
    assert list(mix.subset.names) == ["0.weight", "2.bias"]
    assert mix.subset.num_entries("2.bias") == 1
    assert mix.subset.num_entries() == 24 + 1
    draws = mix.sample(7, generator=torch.Generator(device).manual_seed(1))
    offset = int(torch.randint(3, (1,), generator=torch.Generator(device).manual_seed(1),
                               device=device))  # fmt: skip
    for i in range(7):
        run = (offset + i) % 3
        assert draws["2.bias"][i, 0] == base["2.bias"][1] + run + 1.0
        spread = (draws["0.weight"][i] - base["0.weight"].reshape(-1)).abs().max()
        assert (spread > 0) == (run == 0)
    assert names == [n for n, _ in model.named_parameters()]


def test_bad_input_is_named(device, tmp_path):
    model = _mlp(device)
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    std = {n: torch.full_like(p, 0.1) for n, p in mean.items()}
    free = GaussianPosterior(mean, std)
    with pytest.raises(ValueError, match="has no model"):
        free.sample(2)
    with pytest.raises(ValueError, match="negative or not finite"):
        GaussianPosterior(mean, {n: -s for n, s in std.items()})
    with pytest.raises(ValueError, match=r"'0\.weight' has shape"):
        GaussianPosterior(mean, std, torch.nn.Sequential(torch.nn.Linear(5, 6)))
    with pytest.raises(ValueError, match="no entry has σ > 0"):
        _ = GaussianPosterior(mean, {n: torch.zeros_like(s) for n, s in std.items()}, model).subset
    post = GaussianPosterior(mean, std, model)
    with pytest.raises(ValueError, match=r"GaussianPosterior offers \('mc',\)"):
        post.predict(torch.zeros(2, 4, dtype=torch.float64, device=device), link="probit")
    with pytest.raises(ValueError, match="missing"), post.swapped({"0.weight": torch.zeros(24)}):
        pass
    with pytest.raises(ValueError, match="likelihood"):
        GaussianPosterior(mean, std, model, likelihood="ordinal")
    MultiIVON([post, post]).save(tmp_path / "mix.safetensors")
    with pytest.raises(ValueError, match=r"MultiIVON\.load"):
        GaussianPosterior.load(tmp_path / "mix.safetensors", model)


def test_an_empty_batch_is_refused_by_name(device):
    """Issue #27: an empty batch failed inside the model (HF: `cannot reshape tensor of 0 elements`)."""
    model = _mlp(device)
    post = GaussianPosterior(
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: torch.full_like(p, 0.1) for n, p in model.named_parameters()},
        model,
    )
    empty = torch.zeros(0, 4, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="empty batch"):
        post.predict(empty, n_samples=2)
    with pytest.raises(ValueError, match="empty batch"):
        post.predictive_samples(empty, 2)
