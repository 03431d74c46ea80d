import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partialbayes.selection import KronBlock, countable_parameters, linear_modules, sparse_kfac
from partialbayes.selection._skfac import skfac_rows_cols
from partialbayes.selection.internal import (
    skfac_count,
    skfac_fraction,
    skfac_percent_for_fraction,
    skfac_percent_for_target,
    skfac_percent_of_params,
)

percents = st.floats(0.01, 100.0, allow_nan=False)


def reference_top(norms, k):
    """Dense reference of the DESIGN rule: largest first, ties by lower index, returned sorted."""
    order = sorted(range(len(norms)), key=lambda i: (-norms[i], i))
    return sorted(order[:k])


def reference_rows_cols(w, p, sequential=False):
    n_out, n_in = len(w), len(w[0])
    r, c = math.ceil(p * n_out / 100 - 1e-9), math.ceil(p * n_in / 100 - 1e-9)
    col_norms = [max(abs(w[i][j]) for i in range(n_out)) for j in range(n_in)]
    cols = reference_top(col_norms, max(c, 1))
    use = cols if sequential else range(n_in)
    row_norms = [max(abs(w[i][j]) for j in use) for i in range(n_out)]
    return reference_top(row_norms, max(r, 1)), cols


@st.composite
def weights(draw):
    n_out, n_in = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    # small integer values make ties frequent
    vals = draw(st.lists(st.integers(-3, 3), min_size=n_out * n_in, max_size=n_out * n_in))
    return torch.tensor(vals, dtype=torch.float64).reshape(n_out, n_in)


@given(w=weights(), p=percents, sequential=st.booleans())
def test_rows_cols_match_reference(w, p, sequential):
    rows, cols = skfac_rows_cols(w, p, sequential)
    ref_rows, ref_cols = reference_rows_cols(w.tolist(), p, sequential)
    assert rows.tolist() == ref_rows
    assert cols.tolist() == ref_cols
    assert rows.dtype == torch.int64


@given(w=weights(), p1=percents, p2=percents)
def test_nested_in_percent(w, p1, p2):
    lo, hi = sorted((p1, p2))
    r1, c1 = skfac_rows_cols(w, lo)
    r2, c2 = skfac_rows_cols(w, hi)
    assert set(r1.tolist()) <= set(r2.tolist())
    assert set(c1.tolist()) <= set(c2.tolist())


def mlp(seed, sizes=(7, 5, 6, 3)):
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b, bias=i != 1) for i, (a, b) in enumerate(itertools.pairwise(sizes))]
    return nn.Sequential(*layers)


@given(seed=st.integers(0, 1000), p1=percents, p2=percents)
def test_sparse_kfac_counts_and_nesting(seed, p1, p2):
    model = mlp(seed)
    lo, hi = sorted((p1, p2))
    s_lo, s_hi = sparse_kfac(model, lo), sparse_kfac(model, hi)
    assert s_lo <= s_hi
    assert s_lo.is_kronecker
    for name, mod in linear_modules(model).items():
        n_out, n_in = mod.weight.shape
        r, c = math.ceil(lo * n_out / 100 - 1e-9), math.ceil(lo * n_in / 100 - 1e-9)
        km = s_lo.kron_modules()[name]
        assert (km.n_rows, km.n_cols) == (r, c)
        expected = r * c + (r if mod.bias is not None else 0)
        got = s_lo.num_entries(f"{name}.weight") + (
            s_lo.num_entries(f"{name}.bias") if mod.bias is not None else 0
        )
        assert got == expected
        assert int(s_lo.mask(f"{name}.weight").sum()) == r * c
    assert s_lo.num_entries() == skfac_count(model, lo)
    assert s_lo.percent_of(model) == pytest.approx(skfac_percent_of_params(model, lo))


def test_full_and_bias_rows():
    model = mlp(0)
    full = sparse_kfac(model, 100)
    assert full.num_entries() == sum(p.numel() for p in model.parameters())
    s = sparse_kfac(model, 40)
    for name in ("0", "2"):
        assert s.block(f"{name}.bias") == KronBlock(s.block(f"{name}.weight").rows)
    assert "1.bias" not in s.names
    assert all(n.endswith("weight") for n in sparse_kfac(model, 40, include_bias=False).names)


def test_sequential_differs_from_independent():
    w = torch.tensor([[9.0, 0.0], [0.0, 8.0], [1.0, 0.0]])
    # p = 50: one column (col 0, l-inf 9 > 8), two rows
    rows, cols = skfac_rows_cols(w, 50)
    assert cols.tolist() == [0]
    assert rows.tolist() == [0, 1]
    rows_seq, cols_seq = skfac_rows_cols(w, 50, sequential=True)
    assert cols_seq.tolist() == [0]
    assert rows_seq.tolist() == [0, 2]
    model = nn.Sequential(nn.Linear(2, 3))
    with torch.no_grad():
        model[0].weight.copy_(w)
    s = sparse_kfac(model, 50, sequential=True)
    assert s.block("0.weight") == KronBlock([0, 2], [0])
    assert s.block("0.bias") == KronBlock([0, 2])


def test_ties_broken_by_index():
    rows, cols = skfac_rows_cols(torch.ones(4, 6), 50)
    assert rows.tolist() == [0, 1]
    assert cols.tolist() == [0, 1, 2]


def test_gpt2_logical_orientation(gpt2):
    s = sparse_kfac(gpt2, 25)
    name = "transformer.h.0.mlp.c_fc"
    km = s.kron_modules()[name]
    w = dict(gpt2.named_modules())[name].weight.detach()  # storage (n_in=16, n_out=64)
    rows, cols = skfac_rows_cols(w.t(), 25)
    assert km.transposed
    assert (km.n_out, km.n_in) == (64, 16)
    assert km.rows.tolist() == rows.tolist()
    assert len(rows) == 16
    assert len(cols) == 4
    assert s.mask(f"{name}.weight").shape == (16, 64)


def test_modules_restriction(distilbert):
    names = ["distilbert.transformer.layer.1.ffn.lin2", "classifier"]
    s = sparse_kfac(distilbert, 50, modules=names)
    assert list(s.kron_modules()) == ["distilbert.transformer.layer.1.ffn.lin2", "classifier"]
    with pytest.raises(
        ValueError, match=r"unknown linear module 'clasifier'.*close matches.*'classifier'"
    ):
        sparse_kfac(distilbert, 50, modules=["clasifier"])
    with pytest.raises(ValueError, match="modules is empty"):
        sparse_kfac(distilbert, 50, modules=[])


@pytest.mark.parametrize("bad", [0, -1, 100.5, float("nan"), float("inf")])
def test_percent_errors(bad):
    with pytest.raises(ValueError, match=f"percent must be in \\(0, 100\\], got {bad}"):
        sparse_kfac(mlp(0), bad)


def test_percent_type_and_weight_errors():
    with pytest.raises(TypeError, match="percent"):
        sparse_kfac(mlp(0), True)
    with pytest.raises(TypeError, match="percent"):
        sparse_kfac(mlp(0), "50")
    model = mlp(0)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"module '2'.*non-finite"):
        sparse_kfac(model, 50)
    with pytest.raises(ValueError, match="no linear maps"):
        sparse_kfac(nn.Sequential(nn.ReLU()), 50)


@given(p=percents)
def test_fraction_helpers_invert(p):
    assert skfac_percent_for_fraction(skfac_fraction(p)) == pytest.approx(p, rel=1e-12)
    assert skfac_fraction(p) == pytest.approx((p / 100) ** 2)


@given(target=st.floats(0.5, 90.0))
def test_target_helper_inverts_exact_count(target, distilbert):
    p = skfac_percent_for_target(distilbert, target, tol=1e-6)
    assert skfac_percent_of_params(distilbert, p) >= target
    if p > 2e-6:
        assert skfac_percent_of_params(distilbert, p - 2e-6) < target
    assert sparse_kfac(distilbert, p).percent_of(distilbert) >= target


def test_target_errors(distilbert):
    linear_total = sum(
        p.numel() for m in linear_modules(distilbert).values() for p in m.parameters()
    )
    best = 100 * linear_total / countable_parameters(distilbert)
    with pytest.raises(ValueError, match=f"at most {best:.4f}%"):
        skfac_percent_for_target(distilbert, min(best + 1, 100))
    with pytest.raises(ValueError, match="fraction must be in"):
        skfac_percent_for_fraction(1.5)
    with pytest.raises(ValueError, match="target must be in"):
        skfac_percent_for_target(distilbert, 0)
