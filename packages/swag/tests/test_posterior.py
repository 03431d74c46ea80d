"""SWAG as a partialbayes Posterior: conformance, Hugging Face batches, token outputs, removed forms."""

import pytest
import torch
from torch import nn

from partialbayes.predictive import Posterior, average_softmax
from partialbayes.predictive.internal import flatten_outputs
from partialbayes.predictive.testing import check_posterior
from partialbayes.selection import KronBlock, Subset
from partialbayes.swag import SWAG, collect_swag, predictive_nll
from partialbayes.swag._train import classification_loss

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402


def pair_batches(model, n_batches=3, batch=6, seed=0, n_in=4, n_out=3, regression=False):
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch, n_in, generator=g).to(p.device, p.dtype)
        if regression:
            y = torch.randn(batch, generator=g).to(p.device, p.dtype)
        else:
            y = torch.randint(0, n_out, (batch,), generator=g).to(p.device)
        out.append((x, y))
    return out


def tiny_token_bert(seed=0, device="cpu", num_labels=3):
    model = tiny_model("bert", "token", seed=seed, intermediate=16, num_labels=num_labels)
    return model.to(device).eval()


def token_batches(n_batches=3, batch=4, length=7, seed=0, device="cpu", num_labels=3):
    """BatchEncodings as a token-classification collator yields: padding masked, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, 4:] = 0
        mask[2, 5:] = 0
        labels = torch.randint(0, num_labels, (batch, length), generator=g)
        labels[mask == 0] = -100
        labels[:, 0] = -100  # the [CLS] position, as tokenizers label it
        enc = {
            "input_ids": torch.randint(1, 30, (batch, length), generator=g),
            "attention_mask": mask,
            "labels": labels,
        }
        out.append(transformers.BatchEncoding({k: v.to(device) for k, v in enc.items()}))
    return out


def token_subset(model):
    q = "bert.encoder.layer.0.attention.self.query"
    return Subset.from_model(
        model,
        {
            f"{q}.weight": KronBlock(rows=torch.tensor([0, 3, 5]), cols=torch.tensor([1, 2])),
            f"{q}.bias": KronBlock(rows=torch.tensor([0, 3, 5])),
            "classifier.weight": KronBlock(),
            "classifier.bias": KronBlock(),
        },
    )


@pytest.mark.parametrize("diagonal_only", [False, True], ids=["low-rank", "diagonal"])
@pytest.mark.parametrize("kind", ["classification", "regression", "tokens"])
def test_swag_conforms_to_the_posterior_protocol(helpers, device, tmp_path, diagonal_only, kind):
    if kind == "tokens":
        model = tiny_token_bert(device=device)
        subset = token_subset(model)
        data = token_batches(device=device)
    else:
        n_out = 1 if kind == "regression" else 3
        model = helpers.tiny_net(0, device=device, n_out=n_out)
        subset = (
            helpers.partial_subset(model)
            if n_out == 3
            else Subset.from_model(
                model, {"fc1.weight": KronBlock(rows=torch.tensor([1, 2])), "fc2.bias": KronBlock()}
            )
        )
        data = pair_batches(model, n_out=n_out, regression=kind == "regression")
    swag = collect_swag(
        model,
        subset,
        data,
        lr=0.05,
        n_steps=8,
        snapshot_every=2,
        max_rank=3,
        diagonal_only=diagonal_only,
        likelihood="regression" if kind == "regression" else "classification",
        sigma_noise=0.3,
        progress=False,
    )
    assert isinstance(swag, Posterior)
    assert swag.model is model
    check_posterior(swag, data[0], tmp_path / "swag.safetensors", regression=kind == "regression")
    loaded = SWAG.load(tmp_path / "swag.safetensors", model)
    assert loaded.likelihood == swag.likelihood
    assert loaded.sigma_noise == 0.3


def test_predict_is_the_average_softmax_of_predictive_samples(helpers, device):
    model = helpers.tiny_net(0, device=device)
    data = pair_batches(model)
    swag = collect_swag(
        model, helpers.partial_subset(model), data, lr=0.1, n_steps=8, snapshot_every=2,
        max_rank=3, progress=False,
    )  # fmt: skip
    x = data[0][0]
    for scale in (1.0, 0.25):
        g1, g2 = (torch.Generator(device=device).manual_seed(5) for _ in range(2))
        probs = swag.predict(data[0], n_samples=6, generator=g1, scale=scale)
        logits = swag.predictive_samples(x, 6, generator=g2, scale=scale)
        torch.testing.assert_close(probs, average_softmax(logits), rtol=1e-12, atol=1e-12)
    # the samples are the documented ones: sample_flat(generator=g) one at a time, scale applied
    g = torch.Generator(device=device).manual_seed(5)
    ws = [swag.sample_flat(scale=0.25, generator=g) for _ in range(6)]
    for i, w in enumerate(ws):
        with swag.swapped(swag.unflatten(w)), torch.no_grad():
            torch.testing.assert_close(logits[i], model(x))
    # scale 0: every sample is the SWA mean
    with swag.swapped(swag.unflatten(swag.mean)), torch.no_grad():
        at_mean = model(x)
    torch.testing.assert_close(
        swag.predictive_samples(x, 2, scale=0.0), at_mean.expand(2, *at_mean.shape)
    )
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            swag.sample_flat(scale=bad)
    with pytest.raises(ValueError, match="n_samples"):
        swag.sample_flat(0)


def test_sample_layout_is_the_flat_sample_split_by_parameter(helpers):
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    swag = collect_swag(
        model, subset, pair_batches(model), lr=0.1, n_steps=8, snapshot_every=2, max_rank=3,
        progress=False,
    )  # fmt: skip
    draws = swag.sample(4, generator=torch.Generator().manual_seed(1))
    flat = swag.sample_flat(4, generator=torch.Generator().manual_seed(1))
    assert list(draws) == list(subset.names)
    torch.testing.assert_close(torch.cat(list(draws.values()), dim=1), flat, rtol=0, atol=0)
    for name, values in draws.items():
        assert values.shape == (4, subset.num_entries(name))
    one = {n: v[2] for n, v in draws.items()}
    torch.testing.assert_close(swag.flatten(one), flat[2], rtol=0, atol=0)


def test_token_level_loss_and_nll_skip_padding_and_ignored_labels():
    model = tiny_token_bert()
    batch = token_batches(1)[0]
    loss = classification_loss(model, batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = (batch["attention_mask"] != 0) & (batch["labels"] != -100)
    ref = nn.functional.cross_entropy(logits[keep], batch["labels"][keep])
    torch.testing.assert_close(loss.detach(), ref)
    flat, labels = flatten_outputs(logits, batch["labels"], attention_mask=batch["attention_mask"])
    assert flat.shape[0] == int(keep.sum())
    # the same batch with labels under "label" and as an (inputs, labels) pair
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(
        classification_loss(model, {**inputs, "label": batch["labels"]}), loss
    )
    torch.testing.assert_close(classification_loss(model, (inputs, batch["labels"])), loss)
    # predictive NLL over the kept positions only
    subset = token_subset(model)
    data = token_batches(2)
    swag = collect_swag(model, subset, data, lr=0.05, n_steps=4, snapshot_every=2, max_rank=2,
                        progress=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    nll = predictive_nll(swag, data, n_samples=3, generator=g)
    probs = [swag.predict(b, n_samples=3, generator=torch.Generator().manual_seed(0)) for b in data]
    assert probs[0].shape == (4, 7, 3)
    g = torch.Generator().manual_seed(0)
    total = 0
    for _ in range(3):
        with swag.sampled(generator=g), torch.no_grad():
            total = total + torch.cat(
                [
                    flatten_outputs(
                        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                        .logits.double()
                        .softmax(-1),
                        b["labels"],
                        attention_mask=b["attention_mask"],
                    )[0]
                    for b in data
                ]
            )
    labels = torch.cat(
        [flatten_outputs(b["labels"].unsqueeze(-1), b["labels"],
                         attention_mask=b["attention_mask"])[0][:, 0] for b in data]
    )  # fmt: skip
    ref = -torch.log(total[torch.arange(len(labels)), labels] / 3).mean()
    assert nll == pytest.approx(float(ref), rel=1e-9)


def test_regression_predict_is_mean_and_variance_plus_noise(helpers):
    model = helpers.tiny_net(1, n_out=1)
    subset = Subset.from_model(model, {"fc2.weight": KronBlock(), "fc2.bias": KronBlock()})
    data = pair_batches(model, n_out=1, regression=True)
    swag = collect_swag(model, subset, data, lr=0.05, n_steps=10, snapshot_every=2, max_rank=3,
                        likelihood="regression", sigma_noise=0.5, progress=False)  # fmt: skip
    x = data[0][0]
    mean, var = swag.predict(x, n_samples=5, generator=torch.Generator().manual_seed(2))
    outs = swag.predictive_samples(x, 5, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(mean, outs.mean(0))
    torch.testing.assert_close(var, outs.var(0, unbiased=False) + 0.25)


def test_forms_deprecated_in_0_2_are_gone(helpers):
    model = helpers.tiny_net(0)
    data = pair_batches(model)
    swag = collect_swag(model, helpers.partial_subset(model), data, lr=0.1, n_steps=8,
                        snapshot_every=2, max_rank=3, progress=False)  # fmt: skip
    with pytest.raises(TypeError, match="n_samples"):
        swag.sample(n_samples=3)
    with pytest.raises(TypeError):
        swag.swapped(model, swag.sample_flat())
    with pytest.raises(TypeError):
        swag.sampled(model)
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        predictive_nll(model, swag, data)
    with pytest.raises(TypeError, match="swag must be a SWAG"):
        predictive_nll(model, data)
    import partialbayes.swag

    assert not hasattr(partialbayes.swag, "hf_logits")


def test_bad_samples_and_links_are_named(helpers):
    model = helpers.tiny_net(0)
    swag = collect_swag(model, helpers.partial_subset(model), pair_batches(model), lr=0.1,
                        n_steps=4, snapshot_every=2, max_rank=2, progress=False)  # fmt: skip
    with pytest.raises(TypeError, match=r"swag\.swapped\(swag\.unflatten\(w\)\)"):
        swag.swapped(swag.mean)
    with pytest.raises(ValueError, match="missing"), swag.swapped({"fc1.weight": torch.zeros(4)}):
        pass
    with (
        pytest.raises(ValueError, match=r"sample\['fc1.weight'\] has shape"),
        swag.swapped({n: torch.zeros(3) for n in swag.subset.names}),
    ):
        pass
    with pytest.raises(ValueError, match=r"SWAG offers \('mc',\)"):
        swag.predict(torch.zeros(2, 4, dtype=torch.float64), link="probit")
    with pytest.raises(ValueError, match="n must be a positive int"):
        swag.sample(0)
    with pytest.raises(ValueError, match="likelihood"):
        SWAG(model, swag.subset, likelihood="poisson")
    with pytest.raises(ValueError, match="sigma_noise"):
        SWAG(model, swag.subset, sigma_noise=0.0)
