"""Issue #27 for SampledLaplace: empty batches, unlabelled batches, half precision, meta models, files.

Each test failed before the fix it names.
"""

import warnings

import pytest
import torch
from torch import nn

from partialbayes.linear_sampling import (
    SampledLaplace,
    linearised_logit_moments,
    loader_features,
    network_logits,
)
from partialbayes.selection import KronBlock, Subset

F64 = torch.float64
transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402


def mlp(dtype=F64, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(device, dtype).eval()


def last_layer(model):
    return Subset.from_model(model, {"2.weight": KronBlock(), "2.bias": KronBlock()})


def pairs(n_batches=2, batch=6, dtype=F64, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, 3, generator=g).to(device, dtype),
            torch.randint(0, 3, (batch,), generator=g).to(device),
        )
        for _ in range(n_batches)
    ]


def token_model():
    return tiny_model("bert", "token", seed=0, intermediate=16, num_labels=3).double().eval()


def token_batch(seed, labelled=True):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (3, 6), generator=g)
    if not labelled:
        labels[:] = -100
    return {"input_ids": torch.randint(1, 30, (3, 6), generator=g),
            "attention_mask": torch.ones(3, 6, dtype=torch.long), "labels": labels}  # fmt: skip


def test_an_empty_batch_is_refused_naming_it():
    # before: a raw IndexError from _network._index
    model = mlp()
    x, y = pairs()[0]
    post = SampledLaplace(model, last_layer(model))
    with pytest.raises(ValueError, match=r"batch 1: .*empty"):
        post.fit([(x, y), (x[:0], y[:0])], n_samples=2)
    with pytest.raises(ValueError, match=r"batch 0: .*empty"):
        loader_features(model, [x[:0]], ["2.bias"])


def test_a_batch_without_labelled_outputs_is_skipped_with_one_warning(device):
    # before: the whole loader was refused ("the batch has no kept token positions"), no batch named
    model = token_model().to(device)
    subset = Subset.from_model(
        model, {"classifier.weight": KronBlock(), "classifier.bias": KronBlock()}
    )
    labelled = [token_batch(0), token_batch(1)]
    data = [labelled[0], token_batch(5, labelled=False), labelled[1], token_batch(6, False)]
    g = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="skipped 2 of 4 batches with no labelled outputs") as rec:
        post = SampledLaplace(model, subset).fit(data, n_samples=3, generator=g)
    assert len([w for w in rec if "skipped" in str(w.message)]) == 1
    ref = SampledLaplace(model, subset).fit(
        labelled, n_samples=3, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(post.samples, ref.samples)
    with pytest.raises(ValueError, match=r"every batch \(4 of 4\) has no labelled outputs"):
        SampledLaplace(model, subset).fit([token_batch(i, False) for i in range(4)])


def test_label_minus_100_skips_sequence_level_outputs(device):
    # before: sequence-level outputs ignored -100 and were fitted as if labelled
    model = mlp(device=device)
    subset = last_layer(model)
    data = pairs(device=device)
    x, y = data[0]
    unlabelled = y.clone()
    unlabelled[[1, 4]] = -100
    keep = unlabelled != -100
    g = torch.Generator().manual_seed(0)
    post = SampledLaplace(model, subset).fit([(x, unlabelled), data[1]], n_samples=3, generator=g)
    ref = SampledLaplace(model, subset).fit(
        [(x[keep], y[keep]), data[1]], n_samples=3, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(post.samples, ref.samples)
    torch.testing.assert_close(
        network_logits(model, (x, unlabelled)), network_logits(model, x[keep])
    )
    with pytest.warns(UserWarning, match="skipped 1 of 2 batches"):
        SampledLaplace(model, subset).fit([(x, torch.full_like(y, -100)), data[1]], n_samples=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_fit_and_predict(dtype):
    # before: "cholesky_cpu" not implemented for 'BFloat16' (the softmax Hessian's Cholesky factors)
    model = tiny_model("bert", "sequence", seed=0, intermediate=16, num_labels=3).eval()
    subset = Subset.from_model(
        model, {"classifier.weight": KronBlock(), "classifier.bias": KronBlock()}
    )
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1, 30, (6, 5), generator=g),
             "attention_mask": torch.ones(6, 5, dtype=torch.long),
             "labels": torch.randint(0, 3, (6,), generator=g)}  # fmt: skip
    ref = SampledLaplace(model, subset).fit([batch], n_samples=4, generator=torch.Generator())
    model.to(dtype)
    post = SampledLaplace(model, subset).fit([batch], n_samples=4, generator=torch.Generator())
    assert post.samples.dtype == torch.float32  # the solve runs in float32, not in half precision
    # the same problem up to the half-precision Jacobians and logits
    err = (post.samples - ref.samples).norm() / ref.samples.norm()
    assert float(err) < 0.05
    probs = post.predict(batch)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(6), atol=1e-5, rtol=0)
    with post.sampled(generator=torch.Generator().manual_seed(0)):
        pass


def test_a_meta_model_is_refused_by_name():
    # before: "Tensor.item() cannot be called on meta tensors"
    model = mlp().to("meta")
    subset = last_layer(mlp())
    with pytest.raises(ValueError, match=r"'2.weight' .*meta device"):
        SampledLaplace(model, subset)


def test_save_creates_the_folder_and_refuses_a_folder(tmp_path):
    # before: SafetensorError naming a random temporary file
    model = mlp()
    post = SampledLaplace(model, last_layer(model)).fit(pairs(), n_samples=2)
    path = tmp_path / "new" / "deeper" / "ls.safetensors"
    post.save(path)
    assert torch.equal(SampledLaplace.load(path, model).samples, post.samples)
    with pytest.raises(ValueError, match=r"it is a folder"):
        post.save(tmp_path)


def test_nested_swaps_restore_what_they_found():
    model = mlp()
    subset = last_layer(model)
    post = SampledLaplace(model, subset).fit(pairs(), n_samples=4)
    first, second = (
        {n: v[i] for n, v in post.sample(2, generator=torch.Generator()).items()} for i in (0, 1)
    )
    before = model[2].weight.detach().clone()
    with post.swapped(first):
        outer = model[2].weight.detach().clone()
        with post.swapped(second):
            pass
        assert torch.equal(model[2].weight, outer)
    assert torch.equal(model[2].weight, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model[2].bias += 1.0  # a user edit after fit survives a swap
        edited = model[2].bias.detach().clone()
        with post.sampled():
            pass
        assert torch.equal(model[2].bias, edited)


def test_covariances_that_do_not_fit_are_refused_before_allocating():
    # issue #23: a [.., C, C] covariance at a large C is refused with its bytes and the alternative
    torch.manual_seed(0)
    model = nn.Linear(3, 200_000).eval()
    subset = Subset.from_model(model, {"bias": KronBlock(rows=torch.tensor([0, 5, 7]))})
    x, y = torch.randn(4, 3), torch.randint(0, 200_000, (4,))
    post = SampledLaplace(model, subset).fit([(x, y)], n_samples=3)
    with pytest.raises(
        ValueError, match=r"logit_mean_cov of outputs \(1, 200000\) needs 149\.0 GiB"
    ):
        post.logit_mean_cov(x[:1])
    probs = post.predict(x)  # the predictive forms no C x C block
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    with pytest.raises(
        ValueError, match=r"linearised_logit_moments needs .* linearised_logit_samples"
    ):
        linearised_logit_moments(model, x, {"bias": subset.mask("bias")}, samples=post.samples)


def test_a_causal_lm_keeps_the_position_before_each_label():
    # Hugging Face shifts a causal LM's labels: the logits at t predict the label at t + 1
    model = tiny_model("gpt2", "causal-lm", seed=0).double().eval()
    ids = torch.randint(1, 30, (3, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, 4] = ids[:, 4]  # one answer token per sequence
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, 3]
    torch.testing.assert_close(network_logits(model, batch), expected)
    subset = Subset.from_model(model, {"transformer.ln_f.bias": KronBlock()})
    assert loader_features(model, [batch], subset).n == 3


def test_answer_only_predictives_are_the_restriction_to_the_answer_tokens():
    """``target_ids``: the ``[P, K]`` answer logits at the positions before the labels (a causal LM), of the
    same stored samples: exactly the full predictive's rows and columns; ``mc`` renormalised over ``K``."""
    model = tiny_model("gpt2", "causal-lm", seed=0).double().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 30, (3, 6), generator=g)
    labels = torch.full_like(ids, -100)
    labels[torch.arange(3), torch.tensor([4, 5, 3])] = 1  # the answer slot (its value is not read)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    subset = Subset.from_model(model, {"transformer.ln_f.bias": KronBlock()})
    post = SampledLaplace(model, subset).fit([batch], n_samples=6, generator=g)
    answers = [7, 2, 11]
    rows = (torch.arange(3)[:, None], torch.tensor([3, 4, 2])[:, None], torch.tensor(answers)[None])
    f, cov = post.logit_mean_cov(batch, target_ids=answers)
    f_all, cov_all = post.logit_mean_cov(batch)
    torch.testing.assert_close(f, f_all[rows])
    sub = torch.tensor(answers)
    at = cov_all[torch.arange(3), torch.tensor([3, 4, 2])]  # [3, C, C]
    torch.testing.assert_close(cov, at[:, sub][:, :, sub])
    draws = post.predictive_samples(
        batch, 4, target_ids=answers, generator=torch.Generator().manual_seed(2)
    )
    full = post.predictive_samples(batch, 4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(draws, full[:, rows[0], rows[1], rows[2]])
    probs = post.predict(batch, target_ids=answers, n_samples=6)
    torch.testing.assert_close(
        probs, torch.softmax(post.predictive_samples(batch, 6, target_ids=answers), -1).mean(0)
    )
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=probs.dtype))
    with pytest.raises(ValueError, match="target_ids: 2 is repeated"):
        post.predict(batch, target_ids=[2, 2])
