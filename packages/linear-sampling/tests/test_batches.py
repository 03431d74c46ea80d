"""network_features / network_logits / loader_features on every batch kind and on token-level outputs."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from partialbayes.linear_sampling import (
    loader_features,
    network_features,
    network_logits,
    network_parameters,
)

F64 = torch.float64
transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402


def tiny_token_bert(device):
    model = tiny_model("bert", "token", seed=0, intermediate=16, num_labels=3)
    return model.to(device, F64).eval()


def token_params(model):
    q = "bert.encoder.layer.0.attention.self.query.weight"
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[1, 2] = mask[5, 0] = mask[6, 7] = True
    return {q: mask.to(next(model.parameters()).device), "classifier.bias": None}


def dense_token_jacobian(model, inputs, params):
    """[B, T, C, d] Jacobian by autograd (params: {name: mask or None})."""
    named = dict(model.named_parameters())
    theta = network_parameters(model, params)
    names = [n for n in named if n in params]

    def f(flat):
        p, start = {}, 0
        for nm in names:
            mask = params[nm]
            size = int(mask.sum()) if mask is not None else named[nm].numel()
            chunk = flat[start : start + size]
            start += size
            p[nm] = (
                chunk.reshape(named[nm].shape)
                if mask is None
                else named[nm].detach().masked_scatter(mask, chunk)
            )
        return torch.func.functional_call(model, p, (), inputs).logits

    return torch.autograd.functional.jacobian(f, theta)


def token_batch(seed, length, device, label_key="labels"):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, length - 2 :] = 0
    labels = torch.randint(0, 3, (3, length), generator=g)
    labels[mask == 0] = -100
    labels[2, 1] = -100  # an ignored real token
    batch = {"input_ids": torch.randint(1, 30, (3, length), generator=g), "attention_mask": mask,
             label_key: labels}  # fmt: skip
    return transformers.BatchEncoding({k: v.to(device) for k, v in batch.items()})


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=4)
@given(seed=st.integers(0, 2**16), l1=st.integers(4, 7), l2=st.integers(4, 7))
def test_token_level_loader_features_match_the_dense_jacobian_at_kept_positions(
    device, seed, l1, l2
):
    model = tiny_token_bert(device)
    params = token_params(model)
    batches = [token_batch(seed, l1, device), token_batch(seed + 1, l2, device, "label")]
    feats = loader_features(model, batches, params)
    rows, logits = [], []
    for b in batches:
        labels = b.get("labels", b.get("label"))
        inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
        keep = (b["attention_mask"] != 0) & (labels != -100)
        rows.append(dense_token_jacobian(model, inputs, params)[keep])
        with torch.no_grad():
            logits.append(model(**inputs).logits[keep])
        torch.testing.assert_close(network_logits(model, b), logits[-1])
    jac = torch.cat(rows)  # [N, C, d]
    assert (feats.n, feats.m, feats.d) == tuple(jac.shape)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(feats.d, 2, generator=g, dtype=F64).to(device)
    idx = torch.randperm(feats.n, generator=g)[: max(1, feats.n // 2)].to(device)
    idx = torch.cat([idx, idx[:1]])  # a repeated observation
    v = torch.randn(idx.shape[0], 3, 2, generator=g, dtype=F64).to(device)
    torch.testing.assert_close(feats.apply(idx, z), torch.einsum("nmd,dk->nmk", jac[idx], z))
    torch.testing.assert_close(feats.apply_t(idx, v), torch.einsum("nmd,nmk->dk", jac[idx], v))


def test_every_batch_kind_gives_the_same_features(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(device, F64).eval()
    x = torch.randn(5, 3, dtype=F64, device=device)
    y = torch.tensor([0, 1, 1, 0, 1], device=device)

    class Keyword(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    kw = Keyword(model).eval()
    params = ["0.weight", "2.bias"]
    z = torch.randn(14, 3, dtype=F64, device=device)
    idx = torch.arange(5, device=device)
    ref = network_features(model, x, params).apply(idx, z)
    torch.testing.assert_close(network_features(model, (x, y), params).apply(idx, z), ref)
    for batch in ({"x": x, "labels": y}, {"x": x, "label": y}, ({"x": x}, y)):
        got = network_features(kw, batch, ["inner.0.weight", "inner.2.bias"])
        torch.testing.assert_close(got.apply(idx, z), ref)
        torch.testing.assert_close(network_logits(kw, batch), network_logits(model, x))
    # a loader of pairs: observations are the examples in order
    feats = loader_features(model, [(x[:2], y[:2]), (x[2:], y[2:])], params)
    torch.testing.assert_close(feats.apply(idx.flip(0), z), ref.flip(0))
    with pytest.raises(TypeError, match="got str"):
        network_features(model, "not a batch", params)
    with pytest.raises(ValueError, match="batches is empty"):
        loader_features(model, [], params)


def test_token_outputs_without_mask_or_labels_are_refused():
    model = tiny_token_bert("cpu")
    ids = torch.randint(1, 30, (2, 5))
    with pytest.raises(ValueError, match="need an attention_mask or labels"):
        network_features(model, {"input_ids": ids}, ["classifier.bias"])
