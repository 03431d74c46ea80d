"""Weight sharing over tokens: reduce / expand, padding, deep linear exactness."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import SeqNet, dense_ggn, kw, linear_block_jacobian, seq_batch

from partialbayes.curvature import kfac
from partialbayes.selection import modules

FIXTURE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


@FIXTURE
@given(
    d=st.integers(1, 4),
    h=st.integers(1, 4),
    c=st.integers(1, 3),
    b=st.integers(1, 5),
    t=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    module=st.sampled_from(["lin1", "lin2", "head"]),
)
def test_reduce_exact_on_deep_linear_mse(d, h, c, b, t, seed, module, device):
    torch.manual_seed(seed)
    model = SeqNet(d, h, c, act=False).double().eval()
    batch = seq_batch(b, t, d, c, seed, regression=True, pad=1)
    logits, J = linear_block_jacobian(model, kw(batch), module, True, kwargs=True)
    ref = dense_ggn(J, logits, "regression", 0.5)
    f = kfac(
        model.to(device),
        [_to(batch, device)],
        modules(model, [module]),
        likelihood="regression",
        sigma_noise=0.5,
        sharing="reduce",
    )[module]
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref, rtol=1e-8, atol=1e-10)


@FIXTURE
@given(
    b=st.integers(1, 4),
    pad=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    sharing=st.sampled_from(["reduce", "expand"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_padding_does_not_change_factors(b, pad, seed, sharing, fisher, device):
    torch.manual_seed(seed)
    model = SeqNet(3, 4, 3).double().eval().to(device)
    short = seq_batch(b, 3, 3, 3, seed)
    long = seq_batch(b, 3, 3, 3, seed, pad=pad)
    # same real tokens, extra padded positions with garbage values
    long["x"][:, :3] = short["x"]
    long["attention_mask"][:, :3] = short["attention_mask"]
    long["labels"] = short["labels"]
    s = modules(model, ["lin1", "lin2", "head"])
    a = kfac(model, [_to(short, device)], s, sharing=sharing, fisher=fisher)
    z = kfac(model, [_to(long, device)], s, sharing=sharing, fisher=fisher)
    for m in a:
        torch.testing.assert_close(a[m].G, z[m].G)
        torch.testing.assert_close(a[m].A, z[m].A)


@FIXTURE
@given(b=st.integers(1, 5), seed=st.integers(0, 2**16), fisher=st.sampled_from(["exact", "mc"]))
def test_reduce_equals_expand_on_length_one(b, seed, fisher, device):
    torch.manual_seed(seed)
    model = SeqNet(3, 4, 2).double().eval().to(device)
    batch = _to(seq_batch(b, 1, 3, 2, seed), device)
    s = modules(model, ["lin1", "lin2", "head"])
    r = kfac(
        model,
        [batch],
        s,
        sharing="reduce",
        fisher=fisher,
        generator=torch.Generator().manual_seed(1),
    )
    e = kfac(
        model,
        [batch],
        s,
        sharing="expand",
        fisher=fisher,
        generator=torch.Generator().manual_seed(1),
    )
    for m in r:
        torch.testing.assert_close(r[m].G, e[m].G)
        torch.testing.assert_close(r[m].A, e[m].A)


def test_expand_is_tokens_as_examples():
    """expand on sequences = reduce on the same tokens laid out as length-1 sequences, for the token maps."""
    torch.manual_seed(0)
    model = SeqNet(3, 4, 2, pool="sum").double().eval()
    batch = seq_batch(3, 4, 3, 2, 0)
    s = modules(model, ["lin1"])
    e = kfac(model, [batch], s, sharing="expand", fisher="empirical")["lin1"]
    # hand computation from hooked activations
    x, m = batch["x"], batch["attention_mask"].double()
    xs = x[m.bool()]
    xt = torch.cat([xs, torch.ones(len(xs), 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(e.A, xt.T @ xt / len(xs))
    assert e.n_examples == 3
