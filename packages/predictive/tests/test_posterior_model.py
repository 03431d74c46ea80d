"""PosteriorModel: any posterior's predictive as an nn.Module (issue #25); Trainer runs live in tests/."""

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.predictive import PosteriorModel


class Fixed:
    """A stand-in posterior: ``predict`` returns fixed probabilities (or mean and variance), recording calls."""

    def __init__(self, out, model=None):
        self.out, self.calls = out, []
        self.model = model if model is not None else nn.Linear(3, 2)

    def predict(self, batch, *, link=None, n_samples=100, generator=None):
        self.calls.append((batch, {"link": link, "n_samples": n_samples, "generator": generator}))
        return self.out


class GPT2LMHeadModel(nn.Module):  # named like Hugging Face's causal LMs
    def forward(self, input_ids, attention_mask=None):
        raise AssertionError("not called")


def random_probs(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(shape, generator=g, dtype=dtype), -1)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 5),
    t=st.sampled_from([None, 1, 4]),
    c=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_logits_are_log_probs_and_loss_is_the_nll_of_the_labelled_outputs(b, t, c, seed):
    shape = (b, c) if t is None else (b, t, c)
    probs = random_probs(shape, seed)
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, c, shape[:-1], generator=g)
    labels[(torch.rand(shape[:-1], generator=g) < 0.3)] = -100
    labels.view(-1)[0] = 0  # at least one labelled output
    post = Fixed(probs)
    out = PosteriorModel(post, n_samples=7)(input_ids=torch.zeros(b, 3), labels=labels)
    assert list(out) == ["loss", "logits"]
    torch.testing.assert_close(out["logits"].softmax(-1), probs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["logits"], probs.log())
    keep = labels != -100
    dense = -sum(
        math.log(float(probs[(*i, int(labels[tuple(i)]))])) for i in keep.nonzero().tolist()
    )
    assert float(out["loss"]) == pytest.approx(dense / int(keep.sum()), rel=1e-12)
    batch, kwargs = post.calls[0]
    assert set(batch) == {"input_ids"}
    assert kwargs["n_samples"] == 7
    assert list(PosteriorModel(post)(input_ids=torch.zeros(b, 3))) == ["logits"]


def test_zero_probabilities_give_finite_logits():
    probs = torch.tensor([[1.0, 0.0]], dtype=torch.float32)
    out = PosteriorModel(Fixed(probs))(x=torch.zeros(1, 3), labels=torch.tensor([1]))
    assert bool(torch.isfinite(out["logits"]).all())
    assert math.isfinite(float(out["loss"]))


def test_causal_lm_outputs_are_scored_against_the_next_label():
    probs = random_probs((2, 4, 5), 0)
    labels = torch.tensor([[1, 2, 3, -100], [0, 4, -100, -100]])
    post = Fixed(probs, GPT2LMHeadModel())
    model = PosteriorModel(post)
    assert model.shift_labels
    loss = float(model(input_ids=torch.zeros(2, 4), labels=labels)["loss"])
    pairs = [(0, 0, 2), (0, 1, 3), (1, 0, 4)]  # (b, t, labels[b, t + 1]) with a label
    assert loss == pytest.approx(-sum(math.log(probs[b, t, y]) for b, t, y in pairs) / 3)
    unshifted = PosteriorModel(post, shift_labels=False)(input_ids=torch.zeros(2, 4), labels=labels)
    assert float(unshifted["loss"]) != pytest.approx(loss)


def test_regression_returns_mean_and_variance_and_the_gaussian_nll():
    mean = torch.tensor([[0.5], [1.0]], dtype=torch.float64)
    var = torch.tensor([[0.25], [4.0]], dtype=torch.float64)
    model = PosteriorModel(Fixed((mean, var)))
    out = model(x=torch.zeros(2, 3), labels=torch.tensor([1.0, -1.0]))
    assert list(out) == ["loss", "mean", "variance"]
    ref = [0.5 * math.log(2 * math.pi * v) + (y - m) ** 2 / (2 * v) for m, v, y in
           ((0.5, 0.25, 1.0), (1.0, 4.0, -1.0))]  # fmt: skip
    assert float(out["loss"]) == pytest.approx(sum(ref) / 2, rel=1e-12)
    assert list(model(x=torch.zeros(2, 3))) == ["mean", "variance"]


def test_forward_names_the_wrapped_models_inputs_for_trainer():
    model = PosteriorModel(Fixed(random_probs((1, 2), 0), GPT2LMHeadModel()))
    params = inspect.signature(model.forward).parameters
    assert list(params) == ["input_ids", "attention_mask", "labels", "inputs"]
    assert model.accepts_loss_kwargs is False
    assert PosteriorModel(Fixed(random_probs((1, 2), 0))).device == torch.device("cpu")


def test_bad_input_is_named():
    probs = random_probs((2, 3), 0)
    with pytest.raises(TypeError, match="predict method"):
        PosteriorModel(object())
    with pytest.raises(TypeError, match=r"Fixed\.predict does not take"):
        PosteriorModel(Fixed(probs), n_sample=3)
    model = PosteriorModel(Fixed(probs))
    with pytest.raises(ValueError, match="no model inputs"):
        model(labels=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="every label of the batch is -100"):
        model(x=torch.zeros(2, 3), labels=torch.tensor([-100, -100]))
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not fit"):
        model(x=torch.zeros(2, 3), labels=torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        model(x=torch.zeros(2, 3), labels=torch.tensor([0, 3]))


def test_labels_under_label_are_scored_not_dropped():
    # Issue 34: PosteriorModel(**batch, label=y) returned no loss (split_batch accepts "label").
    probs = random_probs((3, 2), 0)
    y = torch.tensor([0, 1, 1])
    post = Fixed(probs)
    out = PosteriorModel(post)(input_ids=torch.zeros(3, 3), label=y)
    ref = PosteriorModel(post)(input_ids=torch.zeros(3, 3), labels=y)
    assert float(out["loss"]) == float(ref["loss"])
    assert set(post.calls[0][0]) == {"input_ids"}
    with pytest.raises(ValueError, match="both labels= and label="):
        PosteriorModel(post)(input_ids=torch.zeros(3, 3), label=y, labels=y)
