"""Tiny Hugging Face models built in code: GPT-2 Conv1D maps and a DistilBERT classifier end to end."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from partialbayes.curvature import diag_curvature, kfac, logit_jacobians
from partialbayes.predictive.internal import model_logits, split_batch
from partialbayes.selection import KronBlock, MaskBlock, Subset, modules, sparse_kfac
from tiny_models import tiny_model


def forward_logits(model, batch):
    return model_logits(model, split_batch(batch, device=next(model.parameters()).device).inputs)


def gpt2():
    return tiny_model("gpt2", seed=0, vocab=40, num_labels=3, pad_token_id=0).double().eval()


def distilbert():
    return tiny_model("distilbert", seed=0, size="s").double().eval()


def _batch(b, t, vocab, c, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, t + pad), generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t + pad)[None] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, c, (b,), generator=g),
    }


def _grads_by_class(model, batch, names):
    """Reference: per-example, per-class gradients of the logits (plain autograd, one example at a time)."""
    params = dict(model.named_parameters())
    out = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items() if k != "labels"}
        logits = model(**one).logits[0]
        rows = []
        for c in range(logits.shape[0]):
            gs = torch.autograd.grad(logits[c], [params[n] for n in names], retain_graph=True)
            rows.append(gs)
        out.append(rows)
    return out


def test_gpt2_conv1d_one_datum_and_jacobians():
    model = gpt2()
    name = "transformer.h.0.mlp.c_fc"
    batch = _batch(1, 1, 40, 3, 0)
    f = kfac(model, [batch], modules(model, [name]), fisher="empirical")[name]
    # dense EF block in the logical (n_out x n_in) orientation from the storage-shaped (n_in x n_out) grad
    logits = forward_logits(model, batch)
    loss = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
    gw, gb = torch.autograd.grad(
        loss, [model.get_parameter(f"{name}.weight"), model.get_parameter(f"{name}.bias")]
    )
    g = torch.cat([gw.T, gb[:, None]], 1).reshape(-1)
    assert f.G.shape == (32, 32)
    assert f.A.shape == (9, 9)
    torch.testing.assert_close(torch.kron(f.G, f.A), torch.outer(g, g), rtol=1e-9, atol=1e-12)

    # S-KFAC block Jacobians on 3-token sequences with padding
    rows, cols = torch.tensor([1, 5, 30]), torch.tensor([0, 7])
    s = Subset.from_model(
        model, {f"{name}.weight": KronBlock(rows, cols), f"{name}.bias": KronBlock(rows)}
    )
    batch = _batch(2, 3, 40, 3, 1, pad=1)
    _, jac = logit_jacobians(model, batch, s)
    ref = _grads_by_class(model, batch, [f"{name}.weight", f"{name}.bias"])
    for i, per_class in enumerate(ref):
        for c, (gw, gb) in enumerate(per_class):
            want = torch.cat([gw.T[rows][:, cols], gb[rows, None]], 1)
            torch.testing.assert_close(jac[name][i, c], want, rtol=1e-9, atol=1e-12)


def test_distilbert_end_to_end():
    model = distilbert()
    s = sparse_kfac(model, 25)
    batch = _batch(3, 5, 50, 2, 0)
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        f = kfac(model, [batch], s, fisher="empirical", num_classes=2)
    assert model.training
    model.eval()
    assert set(f) == set(s.kron_modules())
    for m, k in s.kron_modules().items():
        assert f[m].G.shape == (k.n_rows, k.n_rows)
        assert f[m].A.shape[0] == k.n_cols + (k.bias_name is not None)
        assert bool(torch.isfinite(f[m].G).all())
        assert bool(torch.isfinite(f[m].A).all())

    # padding and batch size do not change the factors
    padded = _batch(3, 5, 50, 2, 0)
    padded = {
        "input_ids": torch.cat([padded["input_ids"], torch.zeros(3, 4, dtype=torch.long)], 1),
        "attention_mask": torch.cat(
            [padded["attention_mask"], torch.zeros(3, 4, dtype=torch.long)], 1
        ),
        "labels": padded["labels"],
    }
    split = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(3)]
    for other in (
        kfac(model, [padded], s, fisher="empirical"),
        kfac(model, split, s, fisher="empirical"),
    ):
        for m in f:
            torch.testing.assert_close(other[m].G, f[m].G, rtol=1e-7, atol=1e-10)
            torch.testing.assert_close(other[m].A, f[m].A, rtol=1e-7, atol=1e-10)

    # one datum: the classifier block equals the dense EF block
    one = {k: v[:1] for k, v in batch.items()}
    fc = kfac(model, [one], modules(model, ["classifier"]), fisher="empirical")["classifier"]
    loss = torch.nn.functional.cross_entropy(
        forward_logits(model, one), one["labels"], reduction="sum"
    )
    gw, gb = torch.autograd.grad(loss, [model.classifier.weight, model.classifier.bias])
    g = torch.cat([gw, gb[:, None]], 1).reshape(-1)
    torch.testing.assert_close(torch.kron(fc.G, fc.A), torch.outer(g, g), rtol=1e-9, atol=1e-12)

    # diagonal GGN of a masked attention weight against per-example autograd
    name = "distilbert.transformer.layer.0.attention.q_lin.weight"
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) < 0.3
    sd = Subset.from_model(model, {name: MaskBlock(mask)})
    h = diag_curvature(model, [batch], sd, fisher="exact")[name]
    ref = torch.zeros(16, 16, dtype=torch.float64)
    for i, per_class in enumerate(_grads_by_class(model, batch, [name])):
        p = torch.softmax(forward_logits(model, {k: v[i : i + 1] for k, v in batch.items()}), -1)[0]
        gs = torch.stack([gc[0] for gc in per_class])  # [C, 16, 16]
        L = torch.diag(p) - torch.outer(p, p)
        ref += torch.einsum("cij,cd,dij->ij", gs, L, gs)
    torch.testing.assert_close(h, ref[mask], rtol=1e-8, atol=1e-12)


def test_distilbert_num_classes_mismatch():
    model = distilbert()
    with pytest.raises(ValueError, match="num_classes=3"):
        kfac(model, [_batch(2, 3, 50, 2, 0)], modules(model, ["classifier"]), num_classes=3)
