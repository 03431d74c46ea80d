from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from partialbayes.predictive import Posterior, kept_positions, sampled_logits
from partialbayes.predictive.internal import (
    flatten_outputs,
    model_logits,
    resolve_link,
    split_batch,
)


class FrozenMapping(Mapping):
    """A read-only mapping that is not a dict (as transformers' BatchEncoding is not)."""

    def __init__(self, **items):
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_tensor_pair_and_mapping_batches():
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    b = split_batch(x)
    assert b.inputs is x
    assert b.labels is None
    assert b.attention_mask is None
    assert b.size == 3
    b = split_batch((x, y))
    assert b.inputs is x
    assert torch.equal(b.labels, y)
    b = split_batch([x, [0, 1, 1]])
    assert torch.equal(b.labels, y)
    ids, mask = torch.ones(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)
    for key in ("labels", "label"):
        b = split_batch(FrozenMapping(input_ids=ids, attention_mask=mask, **{key: y}))
        assert set(b.inputs) == {"input_ids", "attention_mask"}
        assert torch.equal(b.labels, y)
        assert b.attention_mask is mask
    b = split_batch(({"input_ids": ids}, y))
    assert b.inputs == {"input_ids": ids}
    assert torch.equal(b.labels, y)


def test_batch_encoding_from_a_collator_is_accepted():
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding(
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.tensor([0, 1])}
    )
    b = split_batch(enc, device="cpu")
    assert set(b.inputs) == {"input_ids"}
    assert b.labels.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ("text", "got str"),
        ((torch.ones(2), torch.ones(2), torch.ones(2)), "got tuple of length 3"),
        (("a", torch.ones(2)), "inputs of a pair batch must be a tensor or a mapping"),
        ({"labels": torch.ones(2)}, "holds no model inputs"),
        ({"x": torch.ones(2), "labels": torch.ones(2), "label": torch.ones(2)}, "both"),
        (({"x": torch.ones(2), "labels": torch.ones(2)}, torch.ones(2)), "give them once"),
    ],
)
def test_bad_batches_name_the_culprit(batch, match):
    with pytest.raises((TypeError, ValueError), match=match):
        split_batch(batch)


def test_model_logits_reads_hf_style_outputs():
    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Kw(nn.Module):
        def forward(self, input_ids):
            return Out(input_ids.float())

    x = torch.ones(2, 3)
    assert torch.equal(model_logits(Kw(), {"input_ids": x}), x)
    assert torch.equal(model_logits(nn.Identity(), x), x)

    class Text(nn.Module):
        def forward(self, x):
            return "no logits"

    with pytest.raises(TypeError, match="the model output must be a logits tensor"):
        model_logits(Text(), x)


def test_token_positions_follow_mask_and_ignore_index():
    logits = torch.arange(2 * 3 * 2, dtype=torch.float).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    labels = torch.tensor([[0, -100, 1], [1, 0, -100]])
    keep = kept_positions(logits, attention_mask=mask, labels=labels)
    assert keep.tolist() == [[True, False, False], [True, True, False]]
    flat, y = flatten_outputs(logits, labels, attention_mask=mask)
    assert torch.equal(flat, logits.reshape(6, 2)[[0, 3, 4]])
    assert y.tolist() == [0, 1, 0]
    assert kept_positions(torch.ones(2, 3)) is None
    with pytest.raises(ValueError, match="need an attention_mask or labels"):
        kept_positions(logits)
    with pytest.raises(
        ValueError,
        match=r"attention_mask of token-level logits must have shape \[B, T\] = \(2, 3\), got \(2, 4\)",
    ):
        kept_positions(logits, attention_mask=torch.ones(2, 4))


def test_resolve_link_lists_the_offered_links():
    assert resolve_link(None, ("probit", "mc"), "KronLaplace") == "probit"
    assert resolve_link("mc", ("probit", "mc"), "KronLaplace") == "mc"
    with pytest.raises(ValueError, match=r"SWAG offers \('mc',\)"):
        resolve_link("probit", ("mc",), "SWAG")


class ShiftPosterior:
    """A toy posterior over a bias: successive samples are the MAP plus 0, 1, 2, ..."""

    links = ("mc",)
    subset = None

    def __init__(self):
        self.model = nn.Linear(2, 2)
        self.map = self.model.bias.detach().clone()
        self.calls = 0

    @property
    def num_floats(self):
        return 0

    def sample(self, n=1, *, generator=None):
        return {"bias": self.map + torch.arange(n, dtype=torch.float).unsqueeze(1)}

    @contextmanager
    def swapped(self, sample) -> Iterator[nn.Module]:
        with torch.no_grad():
            self.model.bias.copy_(sample["bias"])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.model.bias.copy_(self.map)

    def sampled(self, *, generator=None):
        self.calls += 1
        return self.swapped({"bias": self.map + (self.calls - 1)})

    def predict(self, batch, *, link=None, n_samples=100, generator=None):
        raise NotImplementedError

    def predictive_samples(self, batch, n, *, generator=None):
        return sampled_logits(self, batch, n, generator=generator)

    def save(self, path):
        raise NotImplementedError

    @classmethod
    def load(cls, path, model):
        raise NotImplementedError


def test_sampled_logits_swaps_each_sample_and_restores_the_map():
    post = ShiftPosterior()
    assert isinstance(post, Posterior)
    x = torch.randn(4, 2)
    out = post.predictive_samples((x, torch.zeros(4)), 3)
    base = post.model(x).detach()
    assert out.shape == (3, 4, 2)
    for i in range(3):
        torch.testing.assert_close(out[i], base + i)
    assert torch.equal(post.model.bias.detach(), post.map)


def test_a_single_batch_or_uncollated_features_name_the_fix():
    # Issue 34: fit(batch_encoding) said "got str"; un-collated features "attention_mask ... got list".
    with pytest.raises(
        TypeError, match=r"got str 'input_ids': iterating one batch .* list of batches"
    ):
        split_batch("input_ids")
    with pytest.raises(TypeError, match=r"'input_ids' is a list, not a tensor: .* a collator"):
        split_batch({"input_ids": [[1, 2]], "attention_mask": [[1, 1]], "labels": [0]})
