"""`Subset.swapped`: the one way every posterior family writes a weight sample into a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partialbayes.selection import KronBlock, MaskBlock, Subset


def _mlp(seed: int, d_in: int, d_hid: int, d_out: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, d_hid), nn.Tanh(), nn.Linear(d_hid, d_out)).double()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@given(
    seed=st.integers(0, 1000),
    d_in=st.integers(2, 6),
    d_hid=st.integers(2, 6),
    d_out=st.integers(1, 4),
    kind=st.sampled_from(["kron", "rows", "cols", "mask", "all"]),
)
def test_swapped_writes_exactly_the_gathered_entries(seed, d_in, d_hid, d_out, kind):
    """Inside: gather returns the values and every other entry is untouched; outside: all restored."""
    model = _mlp(seed, d_in, d_hid, d_out)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(d_hid, generator=g)[: max(1, d_hid // 2)]
    cols = torch.randperm(d_in, generator=g)[: max(1, d_in // 2)]
    block = {
        "kron": KronBlock(rows=rows, cols=cols),
        "rows": KronBlock(rows=rows),
        "cols": KronBlock(cols=cols),
        "all": KronBlock(),
        "mask": MaskBlock(torch.rand(d_hid, d_in, generator=g) < 0.5),
    }[kind]
    if kind == "mask" and not bool(block.mask.any()):
        block = MaskBlock(torch.ones(d_hid, d_in, dtype=torch.bool))
    blocks = {"0.weight": block}
    if kind in ("kron", "rows"):
        blocks["0.bias"] = KronBlock(rows=rows)
    subset = Subset.from_model(model, blocks)
    before = _state(model)
    values = {n: torch.randn(subset.num_entries(n), generator=g).double() for n in subset.names}
    with subset.swapped(model, values) as m:
        assert m is model
        params = dict(model.named_parameters())
        for n in subset.names:
            torch.testing.assert_close(subset.gather(n, params[n].detach()), values[n])
            outside = ~subset.mask(n)
            torch.testing.assert_close(params[n].detach()[outside], before[n][outside])
        torch.testing.assert_close(params["2.weight"].detach(), before["2.weight"])
    for k, v in _state(model).items():
        assert torch.equal(v, before[k]), k


def test_nested_swaps_restore_the_outer_sample_and_user_edits():
    model = _mlp(0, 3, 4, 2)
    subset = Subset.from_model(model, {"0.weight": KronBlock(rows=torch.tensor([1, 3]))})
    k = subset.num_entries()
    outer, inner = {"0.weight": torch.full((k,), 1.0)}, {"0.weight": torch.full((k,), 2.0)}
    with subset.swapped(model, outer):
        with subset.swapped(model, inner):
            assert float(model[0].weight.detach()[1, 0]) == 2.0
        # the outer sample, not the values before it
        assert float(model[0].weight.detach()[1, 0]) == 1.0
    with torch.no_grad():
        model[0].weight.add_(5.0)  # the user moves the weights after building the subset
    edited = _state(model)
    with subset.swapped(model, inner):
        pass
    assert torch.equal(_state(model)["0.weight"], edited["0.weight"])


def test_swapped_restores_on_error():
    model = _mlp(1, 3, 4, 2)
    subset = Subset.from_model(model, {"2.weight": KronBlock()})
    before = _state(model)
    zeros = {"2.weight": torch.zeros(subset.num_entries())}
    with pytest.raises(RuntimeError, match="boom"), subset.swapped(model, zeros):
        raise RuntimeError("boom")
    assert torch.equal(_state(model)["2.weight"], before["2.weight"])


def test_swapped_casts_to_the_parameter_dtype():
    model = _mlp(2, 3, 4, 2).float()
    subset = Subset.from_model(model, {"0.bias": KronBlock()})
    with subset.swapped(model, {"0.bias": torch.ones(1, 4, dtype=torch.float64)}):
        assert model[0].bias.dtype == torch.float32
        assert torch.equal(model[0].bias.detach(), torch.ones(4))


def test_swapped_on_a_transposed_conv1d(gpt2):
    name = next(n for n, p in gpt2.named_parameters() if n.endswith("c_attn.weight"))
    subset = Subset.from_model(
        gpt2, {name: KronBlock(rows=torch.tensor([0, 5]), cols=torch.tensor([1, 2, 7]))}
    )
    before = dict(gpt2.named_parameters())[name].detach().clone()
    values = {name: torch.arange(6, dtype=before.dtype)}
    with subset.swapped(gpt2, values):
        now = dict(gpt2.named_parameters())[name].detach()
        assert torch.equal(subset.gather(name, now), values[name])
        # storage is n_in x n_out: logical row 5, logical col 7 is storage [7, 5]
        assert float(now[7, 5]) == float(subset.gather(name, now)[5])
    assert torch.equal(dict(gpt2.named_parameters())[name].detach(), before)


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ([1.0], TypeError, "must be a mapping"),
        ({}, ValueError, r"missing \['0.weight'\]"),
        ({"0.weight": torch.zeros(12), "2.bias": torch.zeros(2)}, ValueError, "unknown"),
        ({"0.weight": torch.zeros(5)}, ValueError, r"expected \[k\] = \[12\]"),
        ({"0.weight": [0.0] * 12}, TypeError, "must be a tensor"),
        ({"0.weight": torch.full((12,), float("nan"))}, ValueError, "NaN or inf"),
    ],
)
def test_swapped_refuses_bad_values_and_leaves_the_model(values, error, match):
    model = _mlp(3, 3, 4, 2)
    subset = Subset.from_model(model, {"0.weight": KronBlock()})
    before = _state(model)
    with pytest.raises(error, match=match), subset.swapped(model, values):
        pass
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items())


def test_swapped_refuses_another_model_and_the_meta_device():
    model = _mlp(4, 3, 4, 2)
    subset = Subset.from_model(model, {"0.weight": KronBlock()})
    other = _mlp(4, 5, 4, 2)
    with (
        pytest.raises(ValueError, match=r"'0.weight' is shape \(4, 5\)"),
        subset.swapped(other, {"0.weight": torch.zeros(12)}),
    ):
        pass
    with torch.device("meta"):
        meta = _mlp(4, 3, 4, 2)
    with pytest.raises(ValueError, match="meta device"):
        subset.parameters_of(meta)


def test_the_body_keeps_autograd():
    """Gradients flow inside the swap (a sampled forward/backward, as SWAG and IVON training need)."""
    model = _mlp(5, 3, 4, 2)
    subset = Subset.from_model(model, {"0.weight": KronBlock()})
    with subset.swapped(model, {"0.weight": torch.ones(12)}):
        assert torch.is_grad_enabled()
        model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    assert model[0].weight.grad is not None
    assert model[0].weight.requires_grad
