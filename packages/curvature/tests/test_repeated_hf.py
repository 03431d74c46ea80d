"""ALBERT shares one transformer layer across depth: its linear maps are called once per layer per pass."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from partialbayes.curvature import (
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
)
from partialbayes.selection import KronBlock, Subset
from tiny_models import tiny_model

LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"


def _albert(seed: int = 0):
    model = tiny_model("albert", seed=seed, vocab=50, layers=2, num_hidden_groups=1, num_labels=3)
    return model.double().eval()


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (3, 5), generator=g)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}


def _subset(model) -> Subset:
    return Subset.from_model(
        model,
        {
            f"{LAYER}.ffn.weight": KronBlock(
                rows=torch.tensor([0, 3, 5]), cols=torch.tensor([1, 6])
            ),
            f"{LAYER}.ffn.bias": KronBlock(rows=torch.tensor([0, 3, 5])),
            f"{LAYER}.attention.query.weight": KronBlock(
                rows=torch.tensor([2, 7]), cols=torch.tensor([0, 4, 5])
            ),
            "classifier.weight": KronBlock(cols=torch.tensor([1, 2])),
            "classifier.bias": KronBlock(),
        },
    )


def _reference_jacobian(model, batch, subset) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [B, C], J [B, C, P])`` by one plain backward pass per example and class (no hooks)."""
    params = dict(model.named_parameters())
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    b, c = logits.shape
    rows = []
    for n in range(b):
        for k in range(c):
            grads = torch.autograd.grad(
                logits[n, k], [params[p] for p in subset.names], retain_graph=True
            )
            rows.append(
                torch.cat([subset.gather(p, g) for p, g in zip(subset.names, grads, strict=True)])
            )
    return logits.detach(), torch.stack(rows).reshape(b, c, -1)


def test_shared_layer_dense_diag_and_kron_predictive(device):
    model = _albert()
    batch = _batch()
    subset = _subset(model)
    logits, J = _reference_jacobian(model, batch, subset)
    p = torch.softmax(logits, -1)
    L = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ref = torch.einsum("bcp,bcd,bdq->pq", J, L, J)
    model.to(device)
    data = [{k: v.to(device) for k, v in batch.items()}]
    H = dense_curvature(model, data, subset)
    torch.testing.assert_close(H.cpu(), ref, rtol=1e-8, atol=1e-11)
    h = diag_curvature(model, data, subset)
    torch.testing.assert_close(
        torch.cat(list(h.values())).cpu(), ref.diagonal(), rtol=1e-8, atol=1e-11
    )
    # DiagLaplace's predictive Jacobians (hooks, calls merged) equal the plain-autograd ones
    dl = DiagLaplace(model, subset, prior_precision=2.0).fit(data)
    sigma = 1.0 / (torch.cat([h[n] for n in subset.names]).cpu() + 2.0)
    torch.testing.assert_close(
        dl.logit_mean_cov(data[0])[1].cpu(), (J * sigma) @ J.mT, rtol=1e-7, atol=1e-10
    )
    # KronLaplace: functional covariance from the merged calls equals J Σ Jᵀ built from its factors
    for bias in ("fold", "separate"):
        la = KronLaplace(model, subset, prior_precision=0.5, sharing="expand", bias=bias).fit(data)
        factors = kfac(model, data, subset, sharing="expand", bias=bias)
        kron = [torch.kron(factors[m].G, factors[m].input_factor()).cpu() for m in la.modules]
        P = torch.block_diag(*[k + 0.5 * torch.eye(k.shape[0], dtype=k.dtype) for k in kron])
        split = dict(
            zip(
                subset.names,
                J.split([subset.num_entries(n) for n in subset.names], -1),
                strict=True,
            )
        )
        Jb = torch.cat([la.params_to_block(m, split).reshape(3, 3, -1) for m in la.modules], -1)
        torch.testing.assert_close(
            la.logit_mean_cov(data[0])[1].cpu(), Jb @ torch.linalg.inv(P) @ Jb.mT
        )
