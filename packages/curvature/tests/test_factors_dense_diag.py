"""Diagonal / dense GGN and EF and logit Jacobians against torch.func references."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import (
    SeqNet,
    block_jacobian,
    dense_ef,
    dense_ggn,
    kw,
    linear_block_jacobian,
    seq_batch,
)

from partialbayes.curvature import dense_curvature, diag_curvature, logit_jacobians
from partialbayes.selection import KronBlock, MaskBlock, Subset

FIXTURE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _subset(model, seed, with_mask=True):
    g = torch.Generator().manual_seed(seed)
    blocks = {}
    if with_mask:
        w = model.lin1.weight
        m = torch.rand(w.shape, generator=g) < 0.5
        m.view(-1)[0] = True
        blocks["lin1.weight"] = MaskBlock(m)
        mb = torch.rand(model.lin2.bias.shape, generator=g) < 0.7
        mb[0] = True  # an empty mask block is refused by Subset
        blocks["lin2.bias"] = MaskBlock(mb)
    n_out, n_in = model.head.weight.shape
    rows = torch.randperm(n_out, generator=g)[: max(1, n_out // 2)].sort().values
    cols = torch.randperm(n_in, generator=g)[: max(1, n_in - 1)].sort().values
    blocks["head.weight"] = KronBlock(rows, cols)
    blocks["head.bias"] = KronBlock(rows)
    return Subset.from_model(model, blocks)


def _ref_J(model, batch, subset):
    logits, J = block_jacobian(model, kw(batch), list(subset.names), kwargs=True)
    keep = torch.cat([subset.mask(n).reshape(-1) for n in subset.names])
    return logits, J[..., keep]


@FIXTURE
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 4),
    likelihood=st.sampled_from(["classification", "regression"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_dense_and_diag_equal_torch_func(seed, b, likelihood, fisher, device):
    torch.manual_seed(seed)
    model = SeqNet(3, 4, 3).double().eval()
    batch = seq_batch(b, 3, 3, 3, seed, regression=likelihood == "regression", pad=1)
    s = _subset(model, seed)
    logits, J = _ref_J(model, batch, s)
    ref = (
        dense_ggn(J, logits, likelihood, 0.8)
        if fisher == "exact"
        else dense_ef(J, logits, batch["labels"], likelihood, 0.8)
    )
    model.to(device)
    dbatch = {k: v.to(device) for k, v in batch.items()}
    kw_ = dict(likelihood=likelihood, fisher=fisher, sigma_noise=0.8)
    H = dense_curvature(model, [dbatch], s, **kw_)
    assert H.shape == (s.num_entries(), s.num_entries())
    torch.testing.assert_close(H.cpu(), ref, rtol=1e-9, atol=1e-11)
    h = diag_curvature(model, [dbatch], s, **kw_)
    assert list(h) == list(s.names)
    torch.testing.assert_close(
        torch.cat(list(h.values())).cpu(), ref.diagonal(), rtol=1e-9, atol=1e-11
    )


@FIXTURE
@given(
    seed=st.integers(0, 2**16), b=st.integers(1, 5), fisher=st.sampled_from(["exact", "empirical"])
)
def test_diag_fast_path_2d(seed, b, fisher, device):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (b,), generator=g)
    s = Subset.from_model(
        model, {"0.weight": MaskBlock(torch.rand(4, 3, generator=g) < 0.6), "2.weight": KronBlock()}
    )
    logits, J = block_jacobian(model, x, list(s.names))
    keep = torch.cat([s.mask(n).reshape(-1) for n in s.names])
    J = J[..., keep]
    ref = (
        dense_ggn(J, logits, "classification")
        if fisher == "exact"
        else dense_ef(J, logits, y, "classification")
    )
    h = diag_curvature(model.to(device), [(x.to(device), y.to(device))], s, fisher=fisher)
    torch.testing.assert_close(
        torch.cat(list(h.values())).cpu(), ref.diagonal(), rtol=1e-9, atol=1e-11
    )


@FIXTURE
@given(seed=st.integers(0, 2**16), b=st.integers(1, 4), bias=st.booleans())
def test_logit_jacobians_equal_jacrev(seed, b, bias, device):
    torch.manual_seed(seed)
    model = SeqNet(3, 4, 3).double().eval()
    batch = seq_batch(b, 3, 3, 3, seed, pad=1)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(4, generator=g)[:2].sort().values
    cols = torch.randperm(4, generator=g)[:3].sort().values
    blocks = {"lin2.weight": KronBlock(rows, cols), "lin1.weight": KronBlock()}
    if bias:
        blocks["lin2.bias"] = KronBlock(rows)
    s = Subset.from_model(model, blocks)
    ref_logits, ref = linear_block_jacobian(model, kw(batch), "lin2", bias, kwargs=True)
    ref = ref.reshape(b, 3, 4, -1)[:, :, rows][
        ..., torch.cat([cols, torch.tensor([4])]) if bias else cols
    ]
    _, ref1 = linear_block_jacobian(model, kw(batch), "lin1", False, kwargs=True)
    logits, jac = logit_jacobians(model.to(device), {k: v.to(device) for k, v in batch.items()}, s)
    torch.testing.assert_close(logits.cpu(), ref_logits)
    assert list(jac) == ["lin1", "lin2"]
    torch.testing.assert_close(jac["lin2"].cpu(), ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(jac["lin1"].cpu().reshape(b, 3, -1), ref1, rtol=1e-9, atol=1e-12)


def test_parameter_outside_linear_maps_is_rejected():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    s = Subset.from_model(model, {"1.weight": MaskBlock(torch.ones(4, dtype=torch.bool))})
    x, y = torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"'1.weight' is not the weight or bias of a linear map"):
        diag_curvature(model.eval(), [(x, y)], s)
    with pytest.raises(ValueError, match="linear map"):
        dense_curvature(model.eval(), [(x, y)], s)


def test_dense_non_finite_names_parameter():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    s = Subset.from_model(model, {"0.weight": KronBlock()})
    x = torch.randn(2, 3, dtype=torch.float64)
    x[1, 1] = float("inf")
    with torch.no_grad():
        model[2].weight.zero_()
    with pytest.raises(ValueError, match=r"'0.weight' at batch 0"):
        dense_curvature(model, [(x, torch.tensor([0, 1]))], s)
    with pytest.raises(ValueError, match=r"'0.weight' at batch 0"):
        diag_curvature(model, [(x, torch.tensor([0, 1]))], s)


def test_logit_jacobians_run_a_training_mode_model_in_eval_mode_and_restore_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.5), nn.Linear(5, 2)).double()
    s = Subset.from_model(model, {"2.weight": KronBlock()})
    x = torch.randn(4, 3, dtype=torch.float64)
    ref_logits, ref = logit_jacobians(model.eval(), x, s)
    logits, jac = logit_jacobians(model.train(), x, s)  # dropout off: the same Jacobians
    assert model.training  # every mode restored
    assert model[1].training
    assert torch.equal(logits, ref_logits)
    assert torch.equal(jac["2"], ref["2"])
