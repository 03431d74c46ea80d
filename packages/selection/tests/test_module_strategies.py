import functools
import itertools

import pytest
import torch
from scipy import stats
from torch import nn

from partialbayes.selection import (
    PAPER_COUNTS,
    KronBlock,
    Subset,
    last_layer,
    linear_modules,
    max_operator_norm,
    modules,
    ramp,
    random_modules,
)


def chain(n=8):
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)])


def picked_modules(subset):
    return {n.rsplit(".", 1)[0] for n in subset.names}


def test_random_modules_seeded_nested_no_repeats():
    model = chain(8)
    assert random_modules(model, 4, seed=3) == random_modules(model, 4, seed=3)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert random_modules(model, 5, seed=g1) == random_modules(model, 5, seed=g2)
    prev = random_modules(model, 0, seed=1)
    assert len(prev) == 0
    for k in range(1, 9):
        s = random_modules(model, k, seed=1)
        assert len(picked_modules(s)) == k  # no repeats
        assert s.num_entries() == k * 12
        assert prev <= s
        prev = s
    assert random_modules(model, 3, seed=1) != random_modules(model, 3, seed=2) or (
        random_modules(model, 3, seed=1) != random_modules(model, 3, seed=4)
    )


@pytest.mark.parametrize("k", [1, 3])
def test_random_modules_uniform_chi_square(k):
    n_mod, n_seeds = 8, 800
    model = chain(n_mod)
    counts = torch.zeros(n_mod)
    for seed in range(n_seeds):
        for name in picked_modules(random_modules(model, k, seed=seed)):
            counts[int(name)] += 1
    expected = n_seeds * k / n_mod
    # Each module's inclusion count is Binomial(n_seeds, k / n_mod); Pearson's statistic is chi2(7) up to a
    # factor (1 - k/n) for k > 1, so the test is conservative there. Fixed seeds: deterministic.
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(stat, df=n_mod - 1) > 1e-3
    assert counts.sum() == n_seeds * k


def test_random_modules_group(distilbert):
    s = random_modules(distilbert, 6, seed=0, group="mlp")
    assert len(picked_modules(s)) == 6
    assert all("attention" not in n for n in s.names)
    with pytest.raises(ValueError, match=r"\(14\)"):
        random_modules(distilbert, 15, seed=0)
    with pytest.raises(TypeError, match="seed"):
        random_modules(distilbert, 1, seed="x")


def test_last_layer(distilbert, gpt2, bert):
    assert last_layer(distilbert).names == ("classifier.weight", "classifier.bias")
    assert last_layer(bert).names == ("classifier.weight", "classifier.bias")
    assert last_layer(gpt2).names == ("score.weight",)
    assert last_layer(gpt2).block("score.weight") == KronBlock()


def test_modules(distilbert):
    s = modules(distilbert, ["pre_classifier", "distilbert.transformer.layer.1.output_layer_norm"])
    assert s.names == (
        "distilbert.transformer.layer.1.output_layer_norm.weight",
        "distilbert.transformer.layer.1.output_layer_norm.bias",
        "pre_classifier.weight",
        "pre_classifier.bias",
    )
    with pytest.raises(
        ValueError, match=r"unknown module 'pre_clasifier'; close matches: \['pre_classifier'"
    ):
        modules(distilbert, ["pre_clasifier"])
    with pytest.raises(TypeError, match="single string"):
        modules(distilbert, "classifier")
    with pytest.raises(ValueError, match="twice"):
        modules(distilbert, ["classifier", "classifier"])
    with pytest.raises(ValueError, match="no parameters"):
        modules(distilbert, ["distilbert.transformer.layer.0.ffn.activation"])


def test_ramp_nested_max_operator_norm(distilbert):
    counts = (0, 1, 2, 3, 5, 8, 14)
    subsets = list(ramp(lambda k: max_operator_norm(distilbert, k, group="all"), counts))
    assert [len(picked_modules(s)) for s in subsets] == list(counts)
    for a, b in itertools.pairwise(subsets):
        assert a <= b
    subsets = list(ramp(functools.partial(random_modules, distilbert, seed=3), counts))
    assert [len(picked_modules(s)) for s in subsets] == list(counts)
    assert PAPER_COUNTS == (0, 1, 2, 3, 4, 5, 8, 11, 17, 38)


def test_ramp_errors():
    model = chain(3)
    with pytest.raises(ValueError, match="non-decreasing"):
        list(ramp(lambda k: random_modules(model, k), (2, 1)))
    names = list(linear_modules(model))

    def not_nested(k):
        return Subset.from_model(model, {f"{names[k]}.weight": KronBlock()})

    with pytest.raises(ValueError, match="not nested"):
        list(ramp(not_nested, (0, 1)))
    with pytest.raises(TypeError, match=r"strategy\(0\) must be a Subset"):
        list(ramp(lambda k: None, (0,)))
