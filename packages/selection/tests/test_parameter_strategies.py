import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats
from torch import nn

from partialbayes.selection import (
    largest_magnitude,
    largest_marginal_variance,
    random_parameters,
    summary,
)
from partialbayes.selection._parameter_strategies import top_k_stable
from partialbayes.selection._subset import countable_named_parameters
from partialbayes.selection._summary import summary_rows


class Small(nn.Module):
    def __init__(self, seed=0, ties=False):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(5, 3)
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)
        if ties:
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randint(-2, 3, p.shape).double())


def flat_selected(model, subset):
    """Flat indices over the countable parameters (model order) that the subset selects."""
    out, offset = [], 0
    for n, p in countable_named_parameters(model).items():
        m = subset.mask(n) if n in subset else torch.zeros(p.shape, dtype=torch.bool)
        out += (m.flatten().nonzero().flatten() + offset).tolist()
        offset += p.numel()
    return out


@given(
    seed=st.integers(0, 1000), p1=st.floats(0.1, 100), p2=st.floats(0.1, 100), ties=st.booleans()
)
def test_largest_magnitude_reference_and_nested(seed, p1, p2, ties):
    model = Small(seed, ties)
    lo, hi = sorted((p1, p2))
    flat = torch.cat(
        [p.detach().abs().flatten() for p in countable_named_parameters(model).values()]
    )
    n = flat.numel()
    assert n == 4 * 3 + 4 + 2 * 4 + 2
    k = math.ceil(lo * n / 100 - 1e-9)
    ref = sorted(sorted(range(n), key=lambda i: (-float(flat[i]), i))[:k])
    s_lo, s_hi = largest_magnitude(model, lo), largest_magnitude(model, hi)
    assert flat_selected(model, s_lo) == ref
    assert s_lo.num_entries() == k
    assert s_lo <= s_hi
    assert "emb.weight" not in s_hi.names


@given(
    vals=st.lists(st.integers(-3, 3), min_size=1, max_size=40),
    k_frac=st.floats(0.0, 1.0),
)
def test_top_k_stable_matches_stable_sort(vals, k_frac):
    flat = torch.tensor(vals, dtype=torch.float32)
    k = max(1, round(k_frac * len(vals)))
    ref = torch.sort(torch.sort(flat, descending=True, stable=True).indices[:k]).values
    assert torch.equal(top_k_stable(flat, k), ref)


def test_random_parameters_seeded_nested():
    model = Small()
    a = random_parameters(model, 30, seed=1)
    assert a == random_parameters(model, 30, seed=1)
    assert a <= random_parameters(model, 60, seed=1)
    assert a.num_entries() == math.ceil(0.3 * 26)
    assert random_parameters(model, 100, seed=0).num_entries() == 26
    g = torch.Generator().manual_seed(4)
    assert random_parameters(model, 30, seed=g) == random_parameters(model, 30, seed=4)


def test_random_parameters_uniform_chi_square():
    model = Small()
    n, n_seeds, k_pct = 26, 780, 10  # k = ceil(2.6) = 3 entries per draw
    counts = torch.zeros(n)
    for seed in range(n_seeds):
        for i in flat_selected(model, random_parameters(model, k_pct, seed=seed)):
            counts[i] += 1
    k = 3
    assert counts.sum() == n_seeds * k
    expected = n_seeds * k / n
    stat = float(((counts - expected) ** 2 / expected).sum())
    # inclusion counts are Binomial(n_seeds, k/n): the Pearson statistic is at most chi2(n-1) in law
    assert stats.chi2.sf(stat, df=n - 1) > 1e-3


def test_largest_marginal_variance():
    model = Small()
    v = {"fc.weight": torch.arange(12.0).reshape(4, 3), "out.bias": torch.tensor([100.0, 0.5])}
    s = largest_marginal_variance(model, v, 20)  # ceil(0.2 * 26) = 6 entries
    assert s.num_entries() == 6
    assert s.mask("out.bias").tolist() == [True, False]
    assert s.mask("fc.weight").flatten().tolist() == [False] * 7 + [True] * 5
    assert s <= largest_marginal_variance(model, v, 40)


def test_bad_variances():
    model = Small()
    with pytest.raises(ValueError, match=r"variances\['fc.weight'\] has shape \(3, 4\)"):
        largest_marginal_variance(model, {"fc.weight": torch.ones(3, 4)}, 10)
    with pytest.raises(ValueError, match=r"unknown parameter 'fc.wieght'.*close matches"):
        largest_marginal_variance(model, {"fc.wieght": torch.ones(4, 3)}, 10)
    with pytest.raises(ValueError, match=r"variances\['out.bias'\] has negative or non-finite"):
        largest_marginal_variance(model, {"out.bias": torch.tensor([1.0, float("nan")])}, 5)
    with pytest.raises(ValueError, match="only 2 are given"):
        largest_marginal_variance(model, {"out.bias": torch.ones(2)}, 50)
    with pytest.raises(ValueError, match="non-empty"):
        largest_marginal_variance(model, {}, 50)
    with pytest.raises(ValueError, match=r"percent must be in \(0, 100\], got 0"):
        largest_magnitude(model, 0)
    with pytest.raises(ValueError, match=r"got 101"):
        random_parameters(model, 101)


def test_summary(gpt2):
    from partialbayes.selection import sparse_kfac

    s = sparse_kfac(gpt2, 50)
    rows = summary_rows(s)
    assert [r["parameter"] for r in rows] == list(s.names)
    assert sum(r["stochastic"] for r in rows) == s.num_entries()
    c_attn = next(r for r in rows if r["parameter"] == "transformer.h.0.attn.c_attn.weight")
    assert c_attn["group"] == "attention"
    assert c_attn["shape"] == "16x48 (T)"
    assert c_attn["percent"] == pytest.approx(25.0)
    text = summary(s)
    assert "transformer.h.1.mlp.c_proj.weight" in text
    assert text.splitlines()[-1].split() == ["total", str(s.num_entries())]
