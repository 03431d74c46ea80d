"""End to end on a tiny DistilBERT, the sample context manager, save/load, bad input."""

import math

import numpy as np
import pytest
import torch

from partialbayes.selection import KronBlock, MaskBlock, Subset
from partialbayes.swag import (
    SWAG,
    collect_swag,
    predictive_nll,
    sweep_learning_rate,
)

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402


def assert_close(actual, expected, rtol=1e-7, atol=1e-12):
    """numpy's assert_allclose on tensors (torch.testing imports torch.distributed: slow to import)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


def tiny_distilbert(seed=0, device="cpu"):
    return tiny_model("distilbert", seed=seed, size="s", num_labels=3).to(device).eval()


def hf_batches(n_batches=3, batch=4, length=6, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, length // 2 :] = 0  # some padding
        out.append(
            {
                "input_ids": torch.randint(0, 50, (batch, length), generator=g).to(device),
                "attention_mask": mask.to(device),
                "labels": torch.randint(0, 3, (batch,), generator=g).to(device),
            }
        )
    return out


def hf_subset(model):
    q = "distilbert.transformer.layer.0.attention.q_lin"
    return Subset.from_model(
        model,
        {
            f"{q}.weight": KronBlock(rows=torch.tensor([1, 4, 7]), cols=torch.tensor([0, 3, 5, 9])),
            f"{q}.bias": KronBlock(rows=torch.tensor([1, 4, 7])),
            "classifier.weight": KronBlock(),
            "classifier.bias": MaskBlock(torch.tensor([True, False, True])),
        },
    )


def test_sweep_end_to_end_on_tiny_distilbert(device):
    model = tiny_distilbert(device=device)
    subset = hf_subset(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train, val = hf_batches(seed=0, device=device), hf_batches(2, seed=1, device=device)
    torch.manual_seed(0)
    result = sweep_learning_rate(
        model,
        subset,
        train,
        val,
        lrs=(1e-3, 5e-2),
        sweep_steps=4,
        final_steps=6,
        snapshot_every=2,
        max_rank=4,
        n_samples=3,
        generator=torch.Generator(device=device).manual_seed(0),
        progress=True,
    )
    assert result.lr in (1e-3, 5e-2)
    assert set(result.nll) == {1e-3, 5e-2}
    assert all(math.isfinite(v) for v in result.nll.values())
    assert result.nll[result.lr] == min(result.nll.values())
    swag = result.swag
    assert swag.n_snapshots == 3
    assert swag.deviations.shape == (subset.num_entries(), 3)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # back at the MAP, nothing else touched
    assert not model.training
    # The NLL of the MC predictive is the mean of -log of the sample-averaged probabilities.
    g1 = torch.Generator(device=device).manual_seed(3)
    nll = predictive_nll(swag, val, n_samples=2, generator=g1)
    g2 = torch.Generator(device=device).manual_seed(3)
    probs = 0
    with torch.no_grad():
        for _ in range(2):
            with swag.sampled(generator=g2):
                probs = probs + torch.cat(
                    [
                        torch.softmax(
                            model(
                                input_ids=b["input_ids"], attention_mask=b["attention_mask"]
                            ).logits.double(),
                            -1,
                        )
                        for b in val
                    ]
                )
    labels = torch.cat([b["labels"] for b in val])
    ref = -torch.log(probs[torch.arange(len(labels)), labels] / 2).mean()
    assert nll == pytest.approx(float(ref), rel=1e-6)


def test_sampled_swaps_and_restores_even_on_error(helpers, device):
    model = helpers.tiny_net(0, device=device)
    subset = helpers.partial_subset(model)
    swag = collect_swag(
        model,
        subset,
        helpers.x_batches(model),
        lr=0.1,
        n_steps=6,
        snapshot_every=2,
        loss_fn=helpers.x_loss,
        progress=False,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator(device=device).manual_seed(0)
    g_ref = torch.Generator(device=device).manual_seed(0)
    w = swag.sample_flat(generator=g_ref)
    with swag.sampled(generator=g) as m:
        assert m is model
        assert_close(helpers.gathered(model, subset), w.cpu())
        for n, p in model.named_parameters():
            keep = (
                ~subset.mask(n).to(device) if n in subset.names else torch.ones_like(p, dtype=bool)
            )
            assert torch.equal(p[keep], before[n][keep])
        assert not torch.equal(model.fc1.weight, before["fc1.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises(RuntimeError, match="boom"), swag.sampled(generator=g):
        raise RuntimeError("boom")
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_save_load_round_trip_and_refusals(helpers, tmp_path):
    model = tiny_distilbert()
    subset = hf_subset(model)
    swag = collect_swag(
        model,
        subset,
        hf_batches(),
        lr=0.05,
        n_steps=8,
        snapshot_every=2,
        max_rank=3,
        progress=False,
    )
    path = tmp_path / "swag.safetensors"
    swag.save(path)
    loaded = SWAG.load(path, model)
    assert loaded.n_snapshots == swag.n_snapshots == 4
    assert loaded.max_rank == 3
    assert torch.equal(loaded.mean, swag.mean)
    assert torch.equal(loaded.sq_mean, swag.sq_mean)
    assert torch.equal(loaded.deviations, swag.deviations)
    s1 = swag.sample(3, generator=torch.Generator().manual_seed(1))
    s2 = loaded.sample(3, generator=torch.Generator().manual_seed(1))
    for name in subset.names:
        assert torch.equal(s1[name], s2[name])
    # Collecting on after loading continues the ring buffer like the original.
    for s in (swag, loaded):
        with torch.no_grad():
            model.classifier.weight.add_(0.5)
        s.collect(model)
        with torch.no_grad():
            model.classifier.weight.sub_(0.5)
    assert torch.equal(loaded.deviations, swag.deviations)
    # Explicit matching subset is accepted; a different one is refused.
    assert SWAG.load(path, model, subset).num_entries == swag.num_entries
    other = Subset.from_model(model, {"classifier.weight": KronBlock()})
    with pytest.raises(ValueError, match="subset does not match"):
        SWAG.load(path, model, other)
    # A model of another shape is refused, naming the parameter.
    config = model.config
    config.dim, config.hidden_dim = 8, 16
    wrong = transformers.DistilBertForSequenceClassification(config)
    with pytest.raises(ValueError, match="does not match"):
        SWAG.load(path, wrong)
    bogus = tmp_path / "bogus.safetensors"
    from safetensors.torch import save_file

    save_file({"mean": torch.zeros(3)}, str(bogus))
    with pytest.raises(ValueError, match="not a saved partialbayes posterior"):
        SWAG.load(bogus, model)


def test_bad_input(helpers):
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)
    swag = SWAG(model, subset, max_rank=3)
    with pytest.raises(ValueError, match="0 snapshot"):
        swag.sample()
    with pytest.raises(ValueError, match="0 snapshot"):
        swag.mean
    swag.collect(model)
    with pytest.raises(ValueError, match="needs at least 2"):
        swag.sample()  # one snapshot is not enough for the low-rank part
    with pytest.raises(ValueError, match="max_rank must be >= 2"):
        SWAG(model, subset, max_rank=1)
    with pytest.raises(TypeError, match="Subset"):
        SWAG(model, {"fc1.weight": None})
    # A subset of a different model (other shapes) is refused, naming the parameter.
    other = helpers.tiny_net(0, n_in=6)
    with pytest.raises(ValueError, match=r"fc1\.weight"):
        SWAG(other, subset)
    with pytest.raises(ValueError, match=r"fc1\.weight"):
        swag.collect(other)
    with pytest.raises(ValueError, match="lr"):
        collect_swag(model, subset, helpers.x_batches(model), lr=0.0, loss_fn=helpers.x_loss)
    with pytest.raises(ValueError, match="gives 0 snapshot"):
        collect_swag(model, subset, helpers.x_batches(model), lr=0.1, n_steps=2, snapshot_every=5)
    with pytest.raises(ValueError, match="no labels"):
        collect_swag(
            model, subset, [torch.zeros(2)], lr=0.1, n_steps=2, snapshot_every=1, progress=False
        )
    with pytest.raises(TypeError, match="got int"):
        collect_swag(model, subset, [3], lr=0.1, n_steps=2, snapshot_every=1, progress=False)
    with pytest.raises(ValueError, match="re-iterable"):
        collect_swag(
            model,
            subset,
            iter(helpers.x_batches(model, n_batches=2)),
            lr=0.1,
            n_steps=4,
            snapshot_every=1,
            loss_fn=helpers.x_loss,
            progress=False,
        )
    with pytest.raises(ValueError, match="empty"):
        collect_swag(model, subset, [], lr=0.1, n_steps=2, snapshot_every=1, progress=False)
    with torch.no_grad():
        model.fc1.weight[0, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        swag.collect(model)


def test_sweep_skips_diverging_rates_and_fails_when_all_diverge(helpers):
    model = helpers.tiny_net(0)
    subset = helpers.partial_subset(model)

    def loss_fn(m, batch):  # diverges whenever the step is large
        loss = helpers.x_loss(m, batch)
        return loss if m.fc1.weight.abs().max() < 10 else loss * float("nan")

    kw = dict(
        sweep_steps=4, final_steps=4, snapshot_every=2, max_rank=2, n_samples=2, progress=False
    )
    data = helpers.x_batches(model)
    val = [{"x": b["x"], "labels": b["labels"]} for b in data]
    with pytest.warns(RuntimeWarning, match="lr=1000"):
        result = sweep_learning_rate(
            model,
            subset,
            data,
            val,
            lrs=(1e-2, 1e3),
            loss_fn=loss_fn,
            logits_fn=lambda m, b: m(b["x"]),
            **kw,
        )
    assert result.lr == 1e-2
    assert result.nll[1e3] == math.inf
    with pytest.raises(ValueError, match="every learning rate"), pytest.warns(RuntimeWarning):
        sweep_learning_rate(model, subset, data, val, lrs=(1e3,), loss_fn=loss_fn, **kw)
    with pytest.raises(ValueError, match=r"sweep_steps=2 with snapshot_every=2 gives 1 snapshot"):
        sweep_learning_rate(model, subset, data, val, lrs=(1e-2,), sweep_steps=2, snapshot_every=2)


def test_gpt2_conv1d_partial_tensor_only_selected_entries_move():
    model = tiny_model("gpt2", seed=0, vocab=50, hidden=16, pad_token_id=0).eval()
    # c_attn is a Conv1D: logical (48 x 16) map stored as (16 x 48); rows/cols are logical.
    subset = Subset.from_model(
        model,
        {
            "transformer.h.0.attn.c_attn.weight": KronBlock(
                rows=torch.tensor([0, 5, 40]), cols=torch.tensor([2, 3])
            )
        },
    )
    name = "transformer.h.0.attn.c_attn.weight"
    mask = subset.mask(name)
    assert mask.shape == (16, 48)
    assert mask[2, 40]
    assert not mask[0, 2]
    assert int(mask.sum()) == 6
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = []

    def loss_fn(m, batch):
        w = dict(m.named_parameters())[name].detach()
        assert torch.equal(w[~mask], before[name][~mask])
        moved.append(not torch.equal(w[mask], before[name][mask]))
        return transformers.GPT2ForSequenceClassification.forward(m, **batch).loss

    batches = [
        {
            "input_ids": torch.randint(1, 50, (4, 6), generator=torch.Generator().manual_seed(i)),
            "labels": torch.tensor([0, 1, 1, 0]),
        }
        for i in range(2)
    ]
    swag = collect_swag(
        model,
        subset,
        batches,
        lr=0.5,
        n_steps=6,
        snapshot_every=2,
        max_rank=3,
        loss_fn=loss_fn,
        progress=False,
    )
    assert any(moved[1:])
    assert swag.num_entries == 6
    w = swag.sample(1, generator=torch.Generator().manual_seed(0))[name][0]
    with swag.sampled(generator=torch.Generator().manual_seed(0)):
        assert torch.equal(subset.gather(name, dict(model.named_parameters())[name].detach()), w)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
