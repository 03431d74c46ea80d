"""Modules called more than once per forward pass: calls are merged as extra token positions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import block_jacobian, dense_ef, dense_ggn, linear_block_jacobian, seq_batch

from partialbayes.curvature import (
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
    logit_jacobians,
)
from partialbayes.selection import KronBlock, MaskBlock, Subset, modules

FIXTURE = settings(
    max_examples=10,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class TwiceNet(nn.Module):
    """``x = (x1 | x2)``: the same ``shared`` and ``head`` applied to each half, logits concatenated."""

    def __init__(self, d: int, h: int, c: int, act: bool = True) -> None:
        super().__init__()
        self.d = d
        self.shared = nn.Linear(d, h)
        self.head = nn.Linear(h, c)
        self.act = nn.Tanh() if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x[:, : self.d], x[:, self.d :]
        return torch.cat(
            [self.head(self.act(self.shared(x1))), self.head(self.act(self.shared(x2)))], 1
        )


class TokenNet(TwiceNet):
    """The same function as `TwiceNet`, the two halves given to the layers as two tokens."""

    def forward(self, x: Tensor) -> Tensor:
        t = x.reshape(x.shape[0], 2, self.d)
        return self.head(self.act(self.shared(t))).reshape(x.shape[0], -1)


class SumNet(TwiceNet):
    """``head(act(shared(x1) + shared(x2)))``: the calls' outputs are summed before the rest."""

    def forward(self, x: Tensor) -> Tensor:
        s = self.shared(x[:, : self.d]) + self.shared(x[:, self.d :])
        return self.head(self.act(s))


class LoopNet(nn.Module):
    """``h ← tanh(shared(h))`` ``k`` times (a layer reused in a loop, each call fed by the last), then a head."""

    def __init__(self, d: int, c: int, k: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, c)
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for _ in range(self.k):
            h = torch.tanh(self.shared(h))
        return self.head(h)


class SeqTwice(nn.Module):
    """Token model whose ``lin2`` is applied twice per token, masked mean pooling, a head."""

    def __init__(self, d: int, h: int, c: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(d, h)
        self.lin2 = nn.Linear(h, h)
        self.head = nn.Linear(h, c)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        m = attention_mask.to(x.dtype)
        h = torch.tanh(self.lin2(torch.tanh(self.lin2(torch.tanh(self.lin1(x))))))
        return self.head((h * m[..., None]).sum(1) / m.sum(1, keepdim=True))


def _data(b: int, d: int, c: int, seed: int, regression: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    y = (
        torch.randn(b, c, generator=g, dtype=torch.float64)
        if regression
        else torch.randint(0, c, (b,), generator=g)
    )
    return x, y


def _ref(model, x, y, module, bias, likelihood, fisher, sigma):
    logits, J = linear_block_jacobian(model, x, module, bias)
    if fisher == "exact":
        return dense_ggn(J, logits, likelihood, sigma)
    return dense_ef(J, logits, y, likelihood, sigma)


@FIXTURE
@given(
    d=st.integers(1, 3),
    h=st.integers(1, 3),
    c=st.integers(1, 3),
    b=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    sharing=st.sampled_from(["reduce", "expand"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_calls_are_merged_as_tokens(d, h, c, b, seed, sharing, fisher, device):
    """Calling a layer on two halves gives the factors of the same layer seeing them as two tokens."""
    torch.manual_seed(seed)
    twice = TwiceNet(d, h, c).double().eval()
    tokens = TokenNet(d, h, c).double().eval()
    tokens.load_state_dict(twice.state_dict())
    x, y = _data(b, 2 * d, 2 * c, seed, regression=False)
    torch.testing.assert_close(tokens(x), twice(x))
    kwargs = {"sharing": sharing, "fisher": fisher}
    s = modules(twice, ["shared", "head"])
    f2 = kfac(twice.to(device), [(x.to(device), y.to(device))], s, **kwargs)
    ft = kfac(tokens.to(device), [(x.to(device), y.to(device))], s, **kwargs)
    for m in ("shared", "head"):
        torch.testing.assert_close(f2[m].G, ft[m].G, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f2[m].A, ft[m].A, rtol=1e-10, atol=1e-12)


@FIXTURE
@given(
    d=st.integers(1, 3),
    h=st.integers(1, 3),
    c=st.integers(1, 2),
    b=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    module=st.sampled_from(["shared", "head"]),
    bias=st.booleans(),
)
def test_expand_exact_for_per_call_outputs_deep_linear_mse(d, h, c, b, seed, module, bias, device):
    """Each call feeds its own outputs through the same linear path: expand is exact (any N)."""
    torch.manual_seed(seed)
    model = TwiceNet(d, h, c, act=False).double().eval()
    x, y = _data(b, 2 * d, 2 * c, seed, regression=True)
    ref = _ref(model, x, y, module, True, "regression", "exact", 0.6)
    if not bias:
        keep = torch.ones(ref.shape[0], dtype=torch.bool)
        n_in = d if module == "shared" else h
        keep.view(-1, n_in + 1)[:, -1] = False
        ref = ref[keep][:, keep]
    blocks = {f"{module}.weight": KronBlock()} | ({f"{module}.bias": KronBlock()} if bias else {})
    f = kfac(
        model.to(device),
        [(x.to(device), y.to(device))],
        Subset.from_model(model, blocks),
        likelihood="regression",
        sigma_noise=0.6,
        sharing="expand",
    )[module]
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref, rtol=1e-8, atol=1e-10)


@FIXTURE
@given(
    d=st.integers(1, 3),
    h=st.integers(1, 3),
    c=st.integers(2, 3),
    seed=st.integers(0, 2**16),
    likelihood=st.sampled_from(["classification", "regression"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_reduce_exact_one_datum_summed_calls(d, h, c, seed, likelihood, fisher, device):
    """Calls whose outputs are summed share δ: with one datum KFAC-reduce equals the dense GGN / EF."""
    torch.manual_seed(seed)
    model = SumNet(d, h, c).double().eval()
    x, y = _data(1, 2 * d, c, seed, regression=likelihood == "regression")
    ref = _ref(model, x, y, "shared", True, likelihood, fisher, 0.8)
    f = kfac(
        model.to(device),
        [(x.to(device), y.to(device))],
        modules(model, ["shared"]),
        likelihood=likelihood,
        fisher=fisher,
        sigma_noise=0.8,
        sharing="reduce",
    )["shared"]
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref, rtol=1e-8, atol=1e-10)


@FIXTURE
@given(b=st.integers(1, 3), pad=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_padding_ignored_for_repeated_token_calls(b, pad, seed, device):
    torch.manual_seed(seed)
    model = SeqTwice(2, 3, 2).double().eval().to(device)
    s = modules(model, ["lin1", "lin2"])
    short = seq_batch(b, 3, 2, 2, seed)
    long = seq_batch(b, 3, 2, 2, seed, pad=pad)
    long["x"][:, :3] = short["x"]
    long["attention_mask"][:, :3] = short["attention_mask"]
    for sharing in ("reduce", "expand"):
        fs = kfac(model, [{k: v.to(device) for k, v in short.items()}], s, sharing=sharing)
        fl = kfac(model, [{k: v.to(device) for k, v in long.items()}], s, sharing=sharing)
        for m in ("lin1", "lin2"):
            torch.testing.assert_close(fs[m].G, fl[m].G, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(fs[m].A, fl[m].A, rtol=1e-10, atol=1e-12)


def _loop_subset(model: LoopNet, seed: int) -> Subset:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(model.shared.weight.shape, generator=g) < 0.6
    mask.view(-1)[0] = True
    return Subset.from_model(
        model,
        {
            "shared.weight": MaskBlock(mask),
            "shared.bias": KronBlock(),
            "head.weight": KronBlock(cols=torch.tensor([0, 2])),
        },
    )


@FIXTURE
@given(
    b=st.integers(1, 3),
    k=st.integers(2, 3),
    seed=st.integers(0, 2**16),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_dense_diag_and_jacobians_of_a_looped_layer(b, k, seed, fisher, device):
    """Each call's input is paired with its own output gradient: exact per-example gradients."""
    torch.manual_seed(seed)
    model = LoopNet(3, 2, k).double().eval()
    x, y = _data(b, 3, 2, seed, regression=False)
    s = _loop_subset(model, seed)
    logits, J = block_jacobian(model, x, list(s.names))
    keep = torch.cat([s.mask(n).reshape(-1) for n in s.names])
    J = J[..., keep]
    ref = (
        dense_ggn(J, logits, "classification")
        if fisher == "exact"
        else dense_ef(J, logits, y, "classification")
    )
    model.to(device)
    data = [(x.to(device), y.to(device))]
    H = dense_curvature(model, data, s, fisher=fisher)
    torch.testing.assert_close(H.cpu(), ref, rtol=1e-9, atol=1e-11)
    h = diag_curvature(model, data, s, fisher=fisher)
    torch.testing.assert_close(
        torch.cat(list(h.values())).cpu(), ref.diagonal(), rtol=1e-9, atol=1e-11
    )
    ks = modules(model, ["shared", "head"])
    _, jac = logit_jacobians(model, x.to(device), ks)
    for m in ("shared", "head"):
        _, Jm = linear_block_jacobian(model.cpu(), x, m, True)
        torch.testing.assert_close(jac[m].cpu().reshape(b, 2, -1), Jm, rtol=1e-9, atol=1e-12)
        model.to(device)


def test_kron_laplace_predictive_with_a_looped_layer(device):
    torch.manual_seed(0)
    model = LoopNet(3, 2, 2).double().eval()
    x, y = _data(6, 3, 2, 1, regression=False)
    s = modules(model, ["shared", "head"])
    la = KronLaplace(model.to(device), s, prior_precision=0.5, sharing="expand")
    la.fit([(x.to(device), y.to(device))])
    factors = kfac(model, [(x.to(device), y.to(device))], s, sharing="expand")
    kron = [torch.kron(factors[m].G, factors[m].A).cpu() for m in la.modules]
    P = torch.block_diag(*[k + 0.5 * torch.eye(k.shape[0], dtype=k.dtype) for k in kron])
    xt, _ = _data(3, 3, 2, 2, regression=False)
    f, cov = la.logit_mean_cov(xt.to(device))
    model.cpu()
    J = torch.cat([linear_block_jacobian(model, xt, m, True)[1] for m in la.modules], dim=-1)
    torch.testing.assert_close(f.cpu(), model(xt).detach())
    torch.testing.assert_close(cov.cpu(), J @ torch.linalg.inv(P) @ J.mT, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(P))


class BadCalls(TwiceNet):
    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.shared(x[:, : self.d])) + self.head(self.shared(x[:1, self.d :]))


def test_calls_with_different_batch_sizes_are_refused():
    model = BadCalls(2, 3, 2).double().eval()
    x, y = _data(3, 4, 2, 0, regression=False)
    with pytest.raises(ValueError, match=r"module 'shared' is called 2 times.*same batch size"):
        kfac(model, [(x, y)], modules(model, ["shared"]))
    with pytest.raises(ValueError, match=r"module 'shared' is called 2 times"):
        logit_jacobians(model, x, modules(model, ["shared"]))


class TiedNet(nn.Module):
    """Two ``nn.Linear`` sharing one weight parameter (tying by attribute, not by calling one module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)
        self.c = nn.Linear(3, 3)
        self.c.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))


def test_weights_tied_across_modules_are_refused():
    model = TiedNet().double().eval()
    x, y = _data(3, 3, 2, 0, regression=False)
    s = modules(model, ["a", "b"])
    with pytest.raises(ValueError, match=r"weight of module 'a' is tied to module\(s\) \['c'\]"):
        kfac(model, [(x, y)], s)
    with pytest.raises(ValueError, match=r"weight of module 'a' is tied"):
        dense_curvature(model, [(x, y)], s)
    with pytest.raises(ValueError, match=r"weight of module 'a' is tied"):
        logit_jacobians(model, x, s)
    kfac(model, [(x, y)], modules(model, ["b"]))  # untied modules of the same model are fine


@FIXTURE
@given(
    d=st.integers(1, 3),
    h=st.integers(1, 3),
    c=st.integers(1, 2),
    b=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_reduce_exact_for_summed_calls_deep_linear_mse(d, h, c, b, seed, device):
    torch.manual_seed(seed)
    model = SumNet(d, h, c, act=False).double().eval()
    x, y = _data(b, 2 * d, c, seed, regression=True)
    ref = _ref(model, x, y, "shared", True, "regression", "exact", 0.6)
    f = kfac(
        model.to(device),
        [(x.to(device), y.to(device))],
        modules(model, ["shared"]),
        likelihood="regression",
        sigma_noise=0.6,
        sharing="reduce",
    )["shared"]
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref, rtol=1e-8, atol=1e-10)


class KwargCall(nn.Module):
    """Calls its linear map with a keyword argument, twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(input=torch.tanh(self.lin(input=x)))


def test_keyword_calls_are_recorded():
    torch.manual_seed(0)
    model = KwargCall().double().eval()
    x, y = _data(3, 2, 2, 0, regression=False)
    s = modules(model, ["lin"])
    logits, J = block_jacobian(model, x, list(s.names))
    H = dense_curvature(model, [(x, y)], s)
    torch.testing.assert_close(H, dense_ggn(J, logits, "classification"), rtol=1e-9, atol=1e-12)
