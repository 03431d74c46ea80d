"""Several subsets in one pass: factors, posteriors and the linearised predictive equal separate runs, bit for bit.

`kfac_many`, `KronLaplace.fit_many`, `logit_mean_cov_many` and `grid_val_nll_many` share
the network's forward and backward passes; each subset's result must be `torch.equal` to what it gets alone
(so a ramp's records do not depend on whether its cells ran together). The single-subset paths they are
compared with are themselves checked against dense float64 references in the other test modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.curvature import (
    DiagLaplace,
    KronLaplace,
    grid_val_nll_many,
    kfac,
    kfac_many,
    logit_mean_cov_many,
    memory_estimate,
)
from partialbayes.selection import KronBlock, Subset, linear_modules, modules, sparse_kfac
from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _token_refs import bert_tagger, llama_lm, lm_batch, tagged_batch

FIXTURE = settings(
    max_examples=8,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
# with 60 % and 16 sequences, principal sub-blocks of the full factors differ from a fresh S-KFAC fit in the
# last bits in about half the maps (BLAS sums a small product in another order): the tests below would fail
# for factors cut out of full ones
PERCENTS = st.lists(st.sampled_from([1.0, 6.8, 20.0, 33.0]), max_size=2, unique=True).map(
    lambda ps: [60.0, *ps]
)


def wide_bert(seed: int) -> torch.nn.Module:
    """A float32 BERT wide enough (48 / 96) that BLAS sums a sub-block's product in another order."""
    return tiny_model(
        "bert", size="s", seed=seed, hidden=48, intermediate=96, heads=2, num_labels=3
    ).eval()


def batches(seed: int, n: int = 2, b: int = 5, t: int = 9) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = (torch.arange(t)[None] < torch.randint(2, t + 1, (b, 1), generator=g)).long()
        out.append(
            {
                "input_ids": torch.randint(1, 50, (b, t), generator=g) * mask,
                "attention_mask": mask,
                "labels": torch.randint(0, 3, (b,), generator=g),
            }
        )
    return out


def ramp(model: torch.nn.Module, percents: list[float]) -> list[Subset]:
    """S-KFAC levels, a module subset and every linear map: what a ramp's cells ask for."""
    maps = list(linear_modules(model))
    return [
        *(sparse_kfac(model, p) for p in percents),
        modules(model, maps[1:4]),
        modules(model, maps),
    ]


def on(device: torch.device, data: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in data]


def assert_same_factors(together, alone, what) -> None:
    assert list(together) == list(alone), what
    for m, f in together.items():
        g = alone[m]
        assert torch.equal(f.G, g.G), (what, m, "G")
        assert torch.equal(f.A, g.A), (what, m, "A")
        assert (f.A_bias is None) == (g.A_bias is None), (what, m)
        if f.A_bias is not None:
            assert torch.equal(f.A_bias, g.A_bias), (what, m, "A_bias")
        assert (f.n_examples, f.sharing, f.bias) == (g.n_examples, g.sharing, g.bias), (what, m)


@given(
    seed=st.integers(0, 2**16),
    percents=PERCENTS,
    fisher=st.sampled_from(["exact", "mc", "empirical"]),
    sharing=st.sampled_from(["reduce", "expand"]),
    bias=st.sampled_from(["fold", "separate"]),
)
@FIXTURE
def test_kfac_of_several_subsets_equals_separate_fits(
    seed, percents, fisher, sharing, bias, device
):
    model = wide_bert(seed).to(device)
    data = on(device, batches(seed, b=16))
    subsets = ramp(model, percents)
    opts = {"fisher": fisher, "sharing": sharing, "bias": bias, "mc_samples": 2}
    seen = []
    together = kfac_many(
        model,
        data,
        subsets,
        generator=torch.Generator().manual_seed(seed),
        on_batch=lambda i, f, y: seen.append(i),
        **opts,
    )
    assert seen == [0, 1]  # one forward pass per batch for all subsets
    assert len(together) == len(subsets)
    for i, (s, f) in enumerate(zip(subsets, together, strict=True)):
        alone = kfac(model, data, s, generator=torch.Generator().manual_seed(seed), **opts)
        assert_same_factors(f, alone, (i, percents))


@given(seed=st.integers(0, 2**16), percents=PERCENTS)
@FIXTURE
def test_kfac_of_several_subsets_with_token_outputs(seed, percents, device):
    """Token-level logits (KFAC-expand, -100 positions, the gradient-carrying positions): the same rule."""
    model = bert_tagger(seed).to(device)
    data = on(device, [tagged_batch(3, 6, seed + i) for i in range(2)])
    subsets = ramp(model, percents)
    together = kfac_many(
        model, data, subsets, fisher="mc", generator=torch.Generator().manual_seed(seed)
    )
    for s, f in zip(subsets, together, strict=True):
        alone = kfac(model, data, s, fisher="mc", generator=torch.Generator().manual_seed(seed))
        assert_same_factors(f, alone, percents)


@given(seed=st.integers(0, 2**16), fisher=st.sampled_from(["exact", "mc", "empirical"]))
@FIXTURE
def test_fit_many_equals_separate_fits(seed, fisher, device):
    model = wide_bert(seed).to(device)
    data = on(device, batches(seed, b=16))
    subsets = ramp(model, [6.8, 60.0])
    posts = KronLaplace.fit_many(
        model, subsets, data, fisher=fisher, generator=torch.Generator().manual_seed(seed)
    )
    for s, la in zip(subsets, posts, strict=True):
        alone = KronLaplace(model, s, fisher=fisher).fit(
            data, generator=torch.Generator().manual_seed(seed)
        )
        assert la.subset is s
        assert (la.map_loss, la.n_data, la.n_outputs, la.sharing) == (
            alone.map_loss,
            alone.n_data,
            alone.n_outputs,
            alone.sharing,
        )
        state, ref = la._state(), alone._state()
        assert list(state) == list(ref)
        for k, v in state.items():
            assert torch.equal(v, ref[k]), k


@given(
    seed=st.integers(0, 2**16), rtol=st.sampled_from([0.0, 0.05]), chunk=st.sampled_from([None, 2])
)
@FIXTURE
def test_predictive_of_several_posteriors_equals_each_alone(seed, rtol, chunk, device):
    model = wide_bert(seed).to(device)
    data = on(device, batches(seed, n=3))
    subsets = ramp(model, [1.0, 33.0])
    posts = KronLaplace.fit_many(model, subsets, data[:2], fisher="empirical")
    posts.append(KronLaplace(model, subsets[1], predictive_rtol=rtol).fit(data[:2]))
    posts[0].prior_precision = 3.0
    grid = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64)
    many = logit_mean_cov_many(posts, data[2], chunk_size=chunk)
    nll = grid_val_nll_many(posts, data, grid)
    assert nll.shape == (len(posts), 3)
    for la, (f, cov), row in zip(posts, many, nll, strict=True):
        f1, cov1 = la.logit_mean_cov(data[2], chunk_size=chunk)
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)
        assert torch.equal(row, la.grid_val_nll(data, grid))


def test_predictive_of_several_posteriors_with_token_outputs(device):
    model = bert_tagger(3).to(device)
    data = on(device, [tagged_batch(3, 6, 10 + i) for i in range(2)])
    posts = KronLaplace.fit_many(model, ramp(model, [20.0]), data)
    grid = torch.tensor([0.5, 5.0], dtype=torch.float64)
    nll = grid_val_nll_many(posts, data, grid)
    for la, (f, cov), row in zip(posts, logit_mean_cov_many(posts, data[0]), nll, strict=True):
        f1, cov1 = la.logit_mean_cov(data[0])
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)
        assert torch.equal(row, la.grid_val_nll(data, grid))


@given(seed=st.integers(0, 2**16), fisher=st.sampled_from(["mc", "empirical"]))
@FIXTURE
def test_low_rank_factors_and_answer_only_predictives_equal_each_alone(seed, fisher, device):
    """Issue #23's features on the shared paths: ``max_rank`` in `fit_many`, ``target_ids`` shared."""
    model = llama_lm(seed % 7, layers=2).to(device)
    data = on(device, [lm_batch(3, 6, seed + i) for i in range(2)])
    maps = list(linear_modules(model))
    subsets = [modules(model, maps[-3:]), sparse_kfac(model, 40.0), modules(model, maps)]
    options = {"fisher": fisher, "max_rank": 3}
    posts = KronLaplace.fit_many(
        model, subsets, data, generator=torch.Generator(device).manual_seed(seed), **options
    )
    ids = [7, 2, 5]
    many = logit_mean_cov_many(posts, data[0], chunk_size=2, target_ids=ids)
    for s, la, (f, cov) in zip(subsets, posts, many, strict=True):
        alone = KronLaplace(model, s, **options).fit(
            data, generator=torch.Generator(device).manual_seed(seed)
        )
        state, ref = la._state(), alone._state()
        assert list(state) == list(ref)
        assert any(":rest_" in k for k in state)  # some side is low-rank
        for k, v in state.items():
            assert torch.equal(v, ref[k]), k
        f1, cov1 = alone.logit_mean_cov(data[0], chunk_size=2, target_ids=ids)
        assert f.shape[-1] == cov.shape[-1] == len(ids)
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)


def test_shared_blocks_are_accumulated_decomposed_and_projected_once(device, monkeypatch):
    """Overlapping module subsets: each distinct block is accumulated, decomposed and projected once."""
    import partialbayes.curvature._kfac as kfac_module
    import partialbayes.curvature._laplace_projected as projected

    model = wide_bert(2).to(device)
    data = on(device, batches(2))
    maps = list(linear_modules(model))
    subsets = [modules(model, maps[:3]), modules(model, maps[1:4]), modules(model, maps)]
    adds, terms = [], []
    add, project = kfac_module.FactorAccumulator.add, projected.shared_covariances
    monkeypatch.setattr(kfac_module.FactorAccumulator, "add", lambda *a: adds.append(1) or add(*a))
    monkeypatch.setattr(
        projected, "shared_covariances", lambda *a, **k: terms.append(id(a[2])) or project(*a, **k)
    )
    posts = KronLaplace.fit_many(model, subsets, data)
    assert len(adds) == len(maps) * len(data)
    assert posts[0]._eig[maps[1]] is posts[1]._eig[maps[1]] is posts[2]._eig[maps[1]]
    bases = {id(la._eig[m][0].U) for la in posts for m in la.modules}
    assert len(bases) == len(maps)
    grid = torch.tensor([0.5, 5.0], dtype=torch.float64)
    nll = grid_val_nll_many(posts, data, grid)
    seq = set(terms)  # the blocks read per token (the pooler and classifier: once per sequence)
    assert seq <= bases
    assert len(seq) == len(maps) - 2
    assert len(terms) == len(seq) * len(data)
    posts[1].prior_precision = 3.0  # another prior: the blocks' tokens and M are still formed once
    terms.clear()
    many = logit_mean_cov_many(posts, data[0])
    assert len(terms) == len(seq)
    assert set(terms) == seq
    for s, la, (f, cov), row in zip(subsets, posts, many, nll, strict=True):
        alone = KronLaplace(model, s).fit(data)
        alone.prior_precision = la.prior_precision
        f1, cov1 = alone.logit_mean_cov(data[0])
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)
        assert torch.equal(row, alone.grid_val_nll(data, grid))


def test_fit_many_checks_the_memory_of_all_its_subsets_first():
    """Each subset fits alone in ``max_memory``; all their factors at once do not: refused before allocating."""
    model = wide_bert(0)
    data = batches(0)
    subsets = ramp(model, [33.0])
    limit = max(memory_estimate(model, s, data[0]).total for s in subsets)
    for s in subsets:
        KronLaplace(model, s, max_memory=limit).fit(data)
    with pytest.raises(ValueError, match="allowed \\(max_memory\\)"):
        KronLaplace.fit_many(model, subsets, data, max_memory=limit)


def test_posteriors_go_in_groups_when_memory_is_short(device, monkeypatch):
    """When the union's gradients would not fit, each posterior gets its own pass; results do not change."""
    import partialbayes.curvature._laplace_projected as projected

    model = wide_bert(5).to(device)
    data = on(device, batches(5))
    posts = KronLaplace.fit_many(model, ramp(model, [6.8, 33.0]), data)
    plenty = logit_mean_cov_many(posts, data[0])
    forward_passes = []
    model.register_forward_hook(lambda *a: forward_passes.append(1))
    monkeypatch.setattr(projected, "available_memory", lambda device: (1, "test"))
    short = logit_mean_cov_many(posts, data[0])
    assert len(forward_passes) == 1 + len(posts)  # the sizing pass, then one per group
    for (f, cov), (f1, cov1) in zip(plenty, short, strict=True):
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)


def test_several_structures_each_run_their_own_passes(device):
    model = wide_bert(2).to(device)
    data = on(device, batches(2))
    kron = KronLaplace(model, sparse_kfac(model, 20.0)).fit(data)
    diag = DiagLaplace(model, sparse_kfac(model, 20.0)).fit(data)
    for la, (f, cov) in zip([kron, diag], logit_mean_cov_many([kron, diag], data[0]), strict=True):
        f1, cov1 = la.logit_mean_cov(data[0])
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)


def test_a_list_given_to_kfac_is_deprecated_and_forwards_to_kfac_many():
    """The 0.4.0 API `kfac(model, loader, [subsets])` warns and returns `kfac_many`'s list, bit for bit."""
    model = wide_bert(0)
    data = batches(0)
    subsets = ramp(model, [60.0, 6.8])
    many = kfac_many(model, data, subsets, fisher="mc", generator=torch.Generator().manual_seed(1))
    with pytest.warns(FutureWarning, match=r"call kfac_many\(model, loader, subsets, \.\.\.\)"):
        old = kfac(model, data, subsets, fisher="mc", generator=torch.Generator().manual_seed(1))
    assert len(old) == len(subsets)
    for s, a, b in zip(subsets, old, many, strict=True):
        assert_same_factors(a, b, s)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="subset is an empty list"):
        kfac(model, data, [])  # the 0.4.0 message


def test_bad_lists_are_refused_by_name():
    model = wide_bert(0)
    data = batches(0)
    s = sparse_kfac(model, 10.0)
    with pytest.raises(ValueError, match="subsets is an empty list"):
        kfac_many(model, data, [])
    with pytest.raises(TypeError, match="subsets must be a list of Subset, got dict"):
        kfac_many(model, data, {"a": s})
    with pytest.raises(TypeError, match=r"subsets\[1\] must be a Subset, got str"):
        kfac_many(model, data, [s, "not a subset"])
    with pytest.raises(TypeError, match="subsets must be a list of Subset, got Subset"):
        kfac_many(model, data, s)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_rank'"):
        kfac_many(model, data, [s], max_rank=2)  # KronLaplace's, not kfac's
    with pytest.raises(TypeError, match=r"must be a partialbayes\.selection\.Subset, got dict"):
        kfac(model, data, {"a": s})
    with pytest.raises(TypeError, match="subsets must be a list"):
        KronLaplace.fit_many(model, s, data)
    with pytest.raises(ValueError, match="subsets is an empty list"):
        KronLaplace.fit_many(model, [], data)
    # Issue 34: an empty subset in the list did not say which.
    with pytest.raises(TypeError, match=r"fit_many takes no previous=: fit\(loader, previous"):
        KronLaplace.fit_many(model, [s], data, previous=None)
    with pytest.raises(ValueError, match=r"subsets\[1\] is empty: select at least one"):
        KronLaplace.fit_many(model, [s, Subset.from_model(model, {})], data)
    la = KronLaplace(model, s).fit(data)
    other = KronLaplace(wide_bert(1), sparse_kfac(wide_bert(1), 10.0))
    with pytest.raises(ValueError, match="posteriors is an empty list"):
        logit_mean_cov_many([], data[0])
    with pytest.raises(TypeError, match=r"posteriors\[1\] must be a LaplaceBase, got str"):
        logit_mean_cov_many([la, "la"], data[0])
    with pytest.raises(TypeError, match="posteriors must be a list"):
        grid_val_nll_many(la, data, torch.ones(1))
    with pytest.raises(RuntimeError, match="not fitted"):
        logit_mean_cov_many([la, other], data[0])
    other.fit(data)
    with pytest.raises(
        ValueError, match=r"posteriors\[1\] differs from posteriors\[0\] in its model"
    ):
        grid_val_nll_many([la, other], data, torch.ones(1))
    regression = KronLaplace(model, s, likelihood="regression")
    regression.fit_curvature(kfac(model, data, s), map_loss=1.0, n_data=10, n_outputs=3)
    with pytest.raises(ValueError, match=r"posteriors\[1\] differs from posteriors\[0\]"):
        logit_mean_cov_many([la, regression], data[0])


def test_one_map_with_and_without_its_bias_are_two_blocks(device):
    """A map's weight alone and weight + bias are different blocks: `fit_many` must not share them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = model.double().eval().to(device)
    x = torch.randn(16, 4, dtype=torch.float64, device=device)
    y = torch.randint(0, 3, (16,), device=device)
    data = [(x[:8], y[:8]), (x[8:], y[8:])]
    both = {"2.weight": KronBlock(), "2.bias": KronBlock()}
    subsets = [  # the weight alone between two: it was given the others' factors unchecked
        Subset.from_model(model, both),
        Subset.from_model(model, {"2.weight": KronBlock()}),
        Subset.from_model(model, both),
    ]
    posts = KronLaplace.fit_many(model, subsets, data)
    for la, (f, cov) in zip(posts, logit_mean_cov_many(posts, x[:3]), strict=True):
        f1, cov1 = KronLaplace(model, la.subset).fit(data).logit_mean_cov(x[:3])
        assert torch.equal(f, f1)
        assert torch.equal(cov, cov1)
    for s, f in zip(subsets, kfac_many(model, data, subsets), strict=True):
        assert_same_factors(f, kfac(model, data, s), s)
