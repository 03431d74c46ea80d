"""Helpers the sample-based families share: sampled_predict, eval_mode, move_batch."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from partialbayes.predictive import average_softmax, sampled_logits, sampled_predict
from partialbayes.predictive.internal import check_generator, eval_mode, move_batch, rows

from ._refs import BiasSubset


class NoisyBias:
    """Gaussian samples of the last bias of an MLP with dropout (the part of a Posterior used here)."""

    links = ("mc",)

    def __init__(self, device, dtype=torch.float64):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.5), nn.Linear(5, 4)).to(
            device, dtype
        )
        self.model.train()
        self.subset = BiasSubset(4, "2.bias")
        self.map = self.model[2].bias.detach().clone()

    def sample(self, n=1, *, generator=None):
        z = torch.randn(n, 4, generator=generator, dtype=self.map.dtype, device=self.map.device)
        return {"2.bias": self.map + z}

    def sampled(self, *, generator=None):
        return self.swapped(rows(self.sample(1, generator=generator), 0))

    @contextmanager
    def swapped(self, sample):
        one = self.subset.check_values(sample)
        with torch.no_grad():
            self.model[2].bias.copy_(one["2.bias"])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.model[2].bias.copy_(self.map)


def test_sampled_predict_is_the_average_softmax_of_sampled_logits_in_eval_mode(device):
    post = NoisyBias(device)
    x = torch.randn(6, 3, dtype=torch.float64, device=device)
    batch = (x, torch.zeros(6))
    probs = sampled_predict(post, batch, 7, generator=torch.Generator(device).manual_seed(1))
    logits = sampled_logits(post, batch, 7, generator=torch.Generator(device).manual_seed(1))
    torch.testing.assert_close(probs, average_softmax(logits), rtol=1e-12, atol=1e-12)
    # dropout was off: each sample's logits are the deterministic network with that bias
    g = torch.Generator(device).manual_seed(1)
    draws = [post.sample(1, generator=g)["2.bias"][0] for _ in range(7)]  # one at a time
    inner = post.model
    with torch.no_grad():
        net = inner[2](inner[0](x))  # eval-mode dropout is the identity
    for i in range(7):
        torch.testing.assert_close(logits[i], net - post.map + draws[i])
    assert post.model.training  # modes restored
    assert torch.equal(inner[2].bias.detach(), post.map)


def test_sampled_predict_regression_is_the_mean_and_variance_plus_noise(device):
    post = NoisyBias(device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    draws = post.sample(9, generator=torch.Generator(device).manual_seed(2))

    def ctx(s):
        return post.swapped(rows(draws, s))

    mean, var = sampled_predict(post, x, 9, sample_ctx=ctx, regression=True, noise_var=0.25)
    logits = sampled_logits(post, x, 9, sample_ctx=ctx)
    with eval_mode(post.model), torch.no_grad():
        net = post.model(x)
    torch.testing.assert_close(logits[3], net - post.map + draws["2.bias"][3])
    torch.testing.assert_close(mean, logits.mean(0))
    torch.testing.assert_close(var, logits.var(0, unbiased=False) + 0.25)
    with pytest.raises(TypeError, match="sample_ctx must be callable"):
        sampled_predict(post, x, 3, sample_ctx=3)


def test_check_generator_names_the_parameter():
    g = torch.Generator()
    assert check_generator(g) is g
    assert check_generator(None) is None
    for bad in (5, "seed", torch.zeros(1)):
        with pytest.raises(TypeError, match=r"rng must be a torch\.Generator or None"):
            check_generator(bad, "rng")


def test_eval_mode_restores_modes_even_on_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    model.train()
    model[0].eval()
    seen = []

    def fail():
        with eval_mode(model):
            seen.extend(m.training for m in model.modules())
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fail()
    assert not any(seen)
    assert model.training
    assert model[1].training
    assert not model[0].training


def test_move_batch_keeps_the_kind(device):
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    assert move_batch(x, device).device.type == device.type
    pair = move_batch((x, y), device)
    assert isinstance(pair, tuple)
    assert pair[1].device.type == device.type
    moved = move_batch({"input_ids": x, "note": "keep", "labels": y}, device)
    assert moved["note"] == "keep"
    assert moved["labels"].device.type == device.type
    nested = move_batch(({"a": x}, y), device)
    assert nested[0]["a"].device.type == device.type
    with pytest.raises(TypeError):  # not a batch split_batch accepts (its callers split first)
        move_batch(3, device)
