import math

import pytest
import torch
from ivon_reference import reference_ivon

from partialbayes.ivon import (
    IVON,
    GaussianPosterior,
    MultiIVON,
    ivon_posterior,
    predict_mean,
)


class _MaskSubset:
    """Duck-typed subset (names + mask), so these tests do not need the optional selection package."""

    def __init__(self, masks):
        self._masks = masks
        self.names = tuple(masks)

    def mask(self, name):
        return self._masks[name]


def _model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(
        device=device, dtype=torch.float64
    )


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def test_subset_only_masked_entries_are_variational(device):
    model = _model(device)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 1:3] = True
    subset = _MaskSubset({"2.weight": mask, "2.bias": torch.ones(2, dtype=torch.bool)})
    opt = IVON.from_subset(model, subset, lr=0.1, ess=20, beta2=0.9,
                           generator=torch.Generator(device).manual_seed(0))  # fmt: skip
    x = torch.randn(6, 3, dtype=torch.float64, device=device)
    y = torch.randn(6, 2, dtype=torch.float64, device=device)
    means = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.sampled_params(train=True):
        for n, p in model.named_parameters():
            moved = p.detach() != means[n]
            expected = mask.to(device) if n == "2.weight" else torch.full_like(moved, n == "2.bias")
            assert torch.equal(moved, expected), n
        _loss(model, x, y).backward()
    opt.step()
    for n, p in model.named_parameters():
        h = opt.state[p]["hess"]
        fixed = (
            ~mask.to(device)
            if n == "2.weight"
            else torch.full_like(h, n != "2.bias", dtype=torch.bool)
        )
        assert torch.equal(h[fixed], torch.ones_like(h[fixed])), n  # h = hess_init exactly outside
        assert (h[~fixed] != 1).all(), n
    post = ivon_posterior(opt, model)
    assert torch.equal(post.std["2.weight"] != 0, mask.to(device))
    assert torch.equal(post.std["0.weight"], torch.zeros_like(post.std["0.weight"]))


def test_subset_matches_masked_reference(device):
    model = _model(device, seed=3)
    masks = [torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) < 0.5
             for i, p in enumerate(model.parameters())]  # fmt: skip
    names = [n for n, _ in model.named_parameters()]
    subset = _MaskSubset(dict(zip(names, masks, strict=True)))
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    y = torch.randn(5, 2, dtype=torch.float64, device=device)
    hyper = dict(lr=0.1, ess=5.0, beta2=0.9, hess_init=0.5)
    params0 = [p.detach().clone() for p in model.parameters()]

    def loss_fn(ws):
        w1, b1, w2, b2 = ws
        return (((torch.tanh(x @ w1.T + b1) @ w2.T + b2) - y) ** 2).mean()

    ref_m, ref_h = reference_ivon(
        params0, loss_fn, 3, generator=torch.Generator(device).manual_seed(2),
        masks=[m.to(device) for m in masks], **hyper,
    )  # fmt: skip
    opt = IVON.from_subset(model, subset, generator=torch.Generator(device).manual_seed(2), **hyper)
    for _ in range(3):
        with opt.sampled_params(train=True):
            _loss(model, x, y).backward()
        opt.step()
    for p, m, h in zip(model.parameters(), ref_m, ref_h, strict=True):
        torch.testing.assert_close(p.detach(), m, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["hess"], h, rtol=1e-10, atol=1e-12)


def test_real_selection_subset():
    selection = pytest.importorskip("partialbayes.selection")
    model = _model("cpu")
    subset = selection.Subset.from_model(
        model, {"2.weight": selection.KronBlock(rows=torch.tensor([0]))}
    )
    opt = IVON.from_subset(model, subset, lr=0.1, ess=10)
    mean = model[2].weight.detach().clone()
    with opt.sampled_params():
        moved = model[2].weight.detach() != mean
    assert moved[0].all()
    assert not moved[1:].any()
    post = ivon_posterior(opt, model)
    assert (post.std["2.weight"][0] > 0).all()
    assert (post.std["2.weight"][1] == 0).all()


def test_subset_bad_input():
    model = _model("cpu")
    with pytest.raises(ValueError, match="nope"):
        IVON.from_subset(
            model, _MaskSubset({"nope": torch.ones(2, dtype=torch.bool)}), lr=0.1, ess=1
        )
    with pytest.raises(ValueError, match="storage shape"):
        IVON.from_subset(
            model, _MaskSubset({"2.bias": torch.ones(3, dtype=torch.bool)}), lr=0.1, ess=1
        )
    with pytest.raises(ValueError, match="no stochastic entries"):
        IVON.from_subset(
            model, _MaskSubset({"2.bias": torch.zeros(2, dtype=torch.bool)}), lr=0.1, ess=1
        )


def test_posterior_std_and_sample_statistics(device):
    model = _model(device)
    opt = IVON(model.parameters(), lr=0.1, ess=50, hess_init=0.2, weight_decay=0.01)
    post = ivon_posterior(opt, model)
    for name, p in model.named_parameters():
        expected = 1 / torch.sqrt(50 * (opt.state[p]["hess"] + 0.01))
        torch.testing.assert_close(post.std[name], expected)
        assert torch.equal(post.mean[name], p.detach())
    gen = torch.Generator(device).manual_seed(0)
    n = 2000
    draws = post.sample(n, generator=gen)["0.weight"]  # [n, 12], row-major (Subset.gather order)
    mean, std = post.mean["0.weight"].reshape(-1), post.std["0.weight"].reshape(-1)
    z = (draws.mean(0) - mean) / (std / math.sqrt(n))
    assert z.abs().max() < 4.5  # 12 entries, standard normal each
    ratio = draws.std(0) / std
    assert (ratio - 1).abs().max() < 5 / math.sqrt(2 * n)  # sd of the sample sd ≈ σ/√(2n)


def test_predictions_mean_mc_and_multi_ivon(device):
    x = torch.randn(4, 3, dtype=torch.float64, device=device)
    posts, models = [], []
    for seed in range(3):
        model = _model(device, seed)
        opt = IVON(model.parameters(), lr=0.1, ess=1e6)
        posts.append(ivon_posterior(opt, model))
        models.append(model)
    other = _model(device, seed=7)
    before = [p.detach().clone() for p in other.parameters()]
    out_mean = predict_mean(other, posts[0], lambda m: m(x))
    torch.testing.assert_close(out_mean, _model(device, 0)(x).detach())
    mc = posts[0].predictive_samples(x, 5, generator=torch.Generator(device).manual_seed(0))
    assert mc.shape == (5, 4, 2)
    torch.testing.assert_close(mc.mean(0), out_mean, atol=0.05, rtol=0)  # σ ≈ 1e-3: tiny spread
    mix = MultiIVON(posts)
    assert mix.model is models[0]
    assert mix.subset.num_entries() == sum(p.numel() for p in models[0].parameters())
    outs = mix.predictive_samples(x, 6, generator=torch.Generator(device).manual_seed(0))
    offset = int(
        torch.randint(3, (1,), generator=torch.Generator(device).manual_seed(0), device=device)
    )
    for i in range(
        6
    ):  # stratified: sample i from run (offset + i) mod 3, close to that run's output
        run = _model(device, (offset + i) % 3)(x).detach()
        torch.testing.assert_close(outs[i], run, atol=0.05, rtol=0)
    for name in posts[0].mean:
        torch.testing.assert_close(mix.mean[name], sum(p.mean[name] for p in posts) / 3)
    for p, b in zip(other.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)  # predict_mean restored the model
    for model, seed in zip(models, range(3), strict=True):
        for p, b in zip(model.parameters(), _model(device, seed).parameters(), strict=True):
            assert torch.equal(p.detach(), b.detach())  # sampling restored the means


def test_removed_shims_are_gone(device):
    """predict_mc, swapped_params and the full-shape sample(generator) forms were removed in 0.4."""
    import partialbayes.ivon as ivon

    assert not hasattr(ivon, "predict_mc")
    assert not hasattr(ivon, "swapped_params")
    m = _model(device)
    post = ivon_posterior(IVON(m.parameters(), lr=0.1, ess=1e6), m)
    with pytest.raises(TypeError, match="n must be an int"):
        post.sample(torch.Generator(device).manual_seed(1))
    with pytest.raises(TypeError):
        MultiIVON([post]).sample(torch.Generator(device).manual_seed(1), component=0)
    full = post.sample_full(torch.Generator(device).manual_seed(1))  # what the old form returned
    assert full["0.weight"].shape == (4, 3)


def test_nested_swaps_restore_what_they_found(device):
    """Cross-family rule (issue #27): leaving a swap restores the values found on entry, not the means."""
    model = _model(device)
    post = ivon_posterior(IVON(model.parameters(), lr=0.1, ess=10), model)
    means = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator(device).manual_seed(0)
    with post.sampled(generator=gen):
        outer = [p.detach().clone() for p in model.parameters()]
        with post.sampled(generator=gen):
            assert not torch.equal(model[0].weight.detach(), outer[0])
        for p, o in zip(model.parameters(), outer, strict=True):
            assert torch.equal(p.detach(), o)
        with pytest.raises(KeyError), post.sampled(generator=gen):
            raise KeyError("boom")
        for p, o in zip(model.parameters(), outer, strict=True):
            assert torch.equal(p.detach(), o)
    for p, m in zip(model.parameters(), means, strict=True):
        assert torch.equal(p.detach(), m)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a user edit after building the posterior stays
    edited = model[0].weight.detach().clone()
    with post.sampled(generator=gen):
        pass
    assert torch.equal(model[0].weight.detach(), edited)


def test_posterior_bad_input():
    with pytest.raises(ValueError, match="same parameters"):
        GaussianPosterior({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        GaussianPosterior({"a": torch.zeros(1)}, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="at least one"):
        MultiIVON([])
    a = GaussianPosterior({"a": torch.zeros(1)}, {"a": torch.ones(1)})
    b = GaussianPosterior({"b": torch.zeros(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="component 1"):
        MultiIVON([a, b])
    with pytest.raises(ValueError, match=r"component must lie in \[0, 1\)"):
        MultiIVON([a]).sample_full(component=3)
    model = _model("cpu")
    other = IVON([torch.nn.Parameter(torch.zeros(2))], lr=0.1, ess=1)
    with pytest.raises(ValueError, match="none of the model"):
        ivon_posterior(other, model)
    opt = IVON(model.parameters(), lr=0.1, ess=1)
    with pytest.raises(RuntimeError, match="inside sampled_params"), opt.sampled_params():
        ivon_posterior(opt, model)


def test_a_model_on_the_meta_device_is_refused_by_name():
    """Issue #27: a meta model failed deep inside (`Tensor.item() cannot be called on meta tensors`)."""
    real = _model("cpu")
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    post = ivon_posterior(IVON(real.parameters(), lr=0.1, ess=10), real)
    with pytest.raises(ValueError, match=r"parameter '0\.weight' .*meta device"):
        GaussianPosterior(post.mean, post.std, meta)
    with pytest.raises(ValueError, match=r"parameter '0\.weight' .*meta device"):
        IVON(meta.named_parameters(), lr=0.1, ess=10)


def test_multi_ivon_draws_reproducible_on_the_generator_device(device):
    posts = [
        GaussianPosterior(
            {"w": torch.full((3,), float(k), device=device)}, {"w": torch.ones(3, device=device)}
        )
        for k in range(4)
    ]
    mix = MultiIVON(posts)

    def draws(global_seed):
        torch.manual_seed(global_seed)  # the global RNGs must play no part
        if device != "cpu":
            torch.cuda.manual_seed_all(global_seed)
        gen = torch.Generator(device).manual_seed(3)
        return torch.stack([mix.sample_full(gen)["w"] for _ in range(20)])

    first, second = draws(0), draws(1)
    assert torch.equal(first, second)
    assert first.device.type == torch.device(device).type
    components = first.mean(1).round()  # means 0..3 with unit noise: the drawn component, roughly
    assert len(set(components.tolist())) > 1


def test_predict_mean_refuses_a_mixture_of_several_runs():
    model = _model("cpu")
    a = ivon_posterior(IVON(model.parameters(), lr=0.1, ess=10), model)
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(
        predict_mean(model, MultiIVON([a]), lambda m: m(x)), predict_mean(model, a, lambda m: m(x))
    )
    with pytest.raises(ValueError, match="no meaningful mean"):
        predict_mean(model, MultiIVON([a, a]), lambda m: m(x))
