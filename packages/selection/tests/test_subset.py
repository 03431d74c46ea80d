import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from partialbayes.selection import KronBlock, MaskBlock, Subset, countable_parameters


class Tiny(nn.Module):
    def __init__(self, n_in=5, n_hidden=4, n_out=3):
        super().__init__()
        self.emb = nn.Embedding(7, n_in)
        self.fc1 = nn.Linear(n_in, n_hidden)
        self.norm = nn.LayerNorm(n_hidden)
        self.fc2 = nn.Linear(n_hidden, n_out)


def index_sets(n):
    return st.one_of(st.none(), st.sets(st.integers(0, n - 1), min_size=1).map(sorted))


@st.composite
def tiny_and_blocks(draw):
    n_in, n_hidden, n_out = (draw(st.integers(1, 6)) for _ in range(3))
    model = Tiny(n_in, n_hidden, n_out)
    blocks = {}
    if draw(st.booleans()):
        rows = draw(index_sets(n_hidden))
        blocks["fc1.weight"] = KronBlock(rows, draw(index_sets(n_in)))
        if draw(st.booleans()):
            blocks["fc1.bias"] = KronBlock(rows)
    if draw(st.booleans()):
        m = torch.tensor(
            draw(st.lists(st.booleans(), min_size=n_out * n_hidden, max_size=n_out * n_hidden))
        )
        if m.any():
            blocks["fc2.weight"] = MaskBlock(m.reshape(n_out, n_hidden))
    if draw(st.booleans()):
        blocks["norm.weight"] = KronBlock(draw(index_sets(n_hidden)))
    return model, blocks


def dense_mask(model, name, block):
    p = dict(model.named_parameters())[name]
    if isinstance(block, MaskBlock):
        return block.mask
    m = torch.zeros(p.shape, dtype=torch.bool)
    rows = range(p.shape[0]) if block.rows is None else block.rows.tolist()
    for r in rows:
        if p.ndim == 1:
            m[r] = True
        else:
            cols = range(p.shape[1]) if block.cols is None else block.cols.tolist()
            for c in cols:
                m[r, c] = True
    return m


@given(tiny_and_blocks(), st.integers(0, 2**31 - 1))
def test_masks_counts_gather_scatter(case, seed):
    model, blocks = case
    s = Subset.from_model(model, blocks)
    params = dict(model.named_parameters())
    order = [n for n in params if n in blocks]
    assert s.names == tuple(order)
    g = torch.Generator().manual_seed(seed)
    total = 0
    for n in s.names:
        mask = s.mask(n)
        assert mask.dtype == torch.bool
        assert mask.shape == params[n].shape == s.shape(n)
        assert torch.equal(mask, dense_mask(model, n, blocks[n]))
        assert s.num_entries(n) == int(mask.sum())
        total += int(mask.sum())
        t = torch.randn(params[n].shape, generator=g, dtype=torch.float64)
        got = s.gather(n, t)
        assert torch.equal(got, t[mask])  # row-major order of the storage mask
        v = torch.randn(got.shape, generator=g, dtype=torch.float64)
        out = s.scatter(n, v, t)
        assert torch.equal(s.gather(n, out), v)
        assert torch.equal(out[~mask], t[~mask])
        assert torch.equal(s.scatter(n, got, t), t)
    assert s.num_entries() == total
    s2 = Subset.from_json(s.to_json(), model)
    assert s2 == s
    assert [s2.block(n) == s.block(n) for n in s.names] == [True] * len(s)


@given(tiny_and_blocks(), tiny_and_blocks())
def test_union_intersection_match_masks(a, b):
    model, blocks_a = a
    # re-draw b's blocks on a's model shapes: only keep those that fit
    sa = Subset.from_model(model, blocks_a)
    fit = {}
    params = dict(model.named_parameters())
    for n, blk in b[1].items():
        try:
            Subset.from_model(model, {n: blk})
        except ValueError:
            continue
        fit[n] = blk
    sb = Subset.from_model(model, fit)
    union, inter = sa | sb, sa & sb
    for n in params:
        ma = sa.mask(n) if n in sa else torch.zeros(params[n].shape, dtype=torch.bool)
        mb = sb.mask(n) if n in sb else torch.zeros(params[n].shape, dtype=torch.bool)
        mu = union.mask(n) if n in union else torch.zeros(params[n].shape, dtype=torch.bool)
        mi = inter.mask(n) if n in inter else torch.zeros(params[n].shape, dtype=torch.bool)
        assert torch.equal(mu, ma | mb)
        assert torch.equal(mi, ma & mb)
    assert inter <= sa
    assert inter <= sb
    assert sa <= union
    assert sb <= union
    if sa.is_kronecker and sb.is_kronecker:
        assert inter.is_kronecker


def test_kron_intersection_is_kron():
    model = Tiny()
    a = Subset.from_model(model, {"fc1.weight": KronBlock([0, 1, 2], [1, 3])})
    b = Subset.from_model(model, {"fc1.weight": KronBlock([1, 2, 3], None)})
    assert (a & b).block("fc1.weight") == KronBlock([1, 2], [1, 3])
    assert isinstance((a | b).block("fc1.weight"), MaskBlock)
    full = Subset.from_model(model, {"fc1.weight": KronBlock()})
    assert (a | full).block("fc1.weight") == KronBlock()
    c = Subset.from_model(model, {"fc1.weight": KronBlock([3], [0])})
    assert len(a & c) == 0


def test_kronblock_normalises_indices():
    b = KronBlock(torch.tensor([3, 1, 3]), [2, 0])
    assert b.rows.dtype == torch.int64
    assert b.rows.tolist() == [1, 3]
    assert b.cols.tolist() == [0, 2]
    assert b == KronBlock([1, 3], [0, 2])
    assert hash(b) == hash(KronBlock([1, 3], [0, 2]))
    with pytest.raises(TypeError, match="integer"):
        KronBlock(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="non-negative"):
        KronBlock([-1])
    with pytest.raises(TypeError, match=r"torch.bool"):
        MaskBlock(torch.ones(2))


def test_validation_errors_name_the_culprit():
    model = Tiny()
    with pytest.raises(
        ValueError, match=r"unknown parameter 'fc1.wieght'.*close matches.*'fc1.weight'"
    ):
        Subset.from_model(model, {"fc1.wieght": KronBlock()})
    with pytest.raises(ValueError, match=r"rows for 'fc1.weight' contains index 4.*size 4"):
        Subset.from_model(model, {"fc1.weight": KronBlock([4])})
    with pytest.raises(ValueError, match=r"cols for 'fc1.weight' contains index 9.*size 5"):
        Subset.from_model(model, {"fc1.weight": KronBlock(None, [9])})
    with pytest.raises(ValueError, match=r"'fc1.bias'.*cols=None"):
        Subset.from_model(model, {"fc1.bias": KronBlock([0], [0])})
    with pytest.raises(ValueError, match=r"MaskBlock for 'fc2.weight' has shape \(2, 2\)"):
        Subset.from_model(model, {"fc2.weight": MaskBlock(torch.ones(2, 2, dtype=torch.bool))})
    with pytest.raises(ValueError, match="selects no entries"):
        Subset.from_model(model, {"fc2.weight": MaskBlock(torch.zeros(3, 4, dtype=torch.bool))})
    with pytest.raises(ValueError, match="has empty rows"):
        Subset.from_model(model, {"fc2.weight": KronBlock([], None)})
    with pytest.raises(TypeError, match="KronBlock or MaskBlock"):
        Subset.from_model(model, {"fc2.weight": [0, 1]})
    s = Subset.from_model(model, {"fc1.weight": KronBlock()})
    with pytest.raises(ValueError, match=r"tensor for 'fc1.weight' has shape \(5, 4\)"):
        s.gather("fc1.weight", torch.zeros(5, 4))
    with pytest.raises(TypeError, match=r"tensor for 'fc1\.weight' must be a Tensor, got list"):
        s.gather("fc1.weight", [[0.0] * 5] * 4)
    with pytest.raises(KeyError, match=r"'fc2\.weight' is not in the subset"):
        s.gather("fc2.weight", torch.zeros(3, 4))
    with pytest.raises(KeyError, match=r"'fc9\.weight' is not in the model"):
        s.gather("fc9.weight", torch.zeros(4, 5))
    with pytest.raises(TypeError, match="parameter name must be a string, got list"):
        s.gather(["fc1.weight"], torch.zeros(4, 5))
    with pytest.raises(ValueError, match="20 entries"):
        s.scatter("fc1.weight", torch.zeros(3), torch.zeros(4, 5))
    with pytest.raises(KeyError, match="not in the subset"):
        s.mask("fc2.weight")
    with pytest.raises(
        ValueError, match="cannot union: the other subset does not have the parameter structure"
    ):
        _ = s | Subset.from_model(Tiny(n_in=2), {"fc1.weight": KronBlock()})


def test_json_errors():
    model = Tiny()
    with pytest.raises(ValueError, match="not valid JSON"):
        Subset.from_json("{", model)
    with pytest.raises(ValueError, match="format"):
        Subset.from_json(json.dumps({"blocks": {}}), model)
    text = Subset.from_model(model, {"fc1.weight": KronBlock([3])}).to_json()
    with pytest.raises(ValueError, match="out of range"):
        Subset.from_json(text, Tiny(n_hidden=2))


def test_kron_modules_and_errors():
    model = Tiny()
    s = Subset.from_model(
        model,
        {
            "fc1.weight": KronBlock([1, 2], [0]),
            "fc1.bias": KronBlock([1, 2]),
            "fc2.weight": KronBlock(),
        },
    )
    km = s.kron_modules()
    assert list(km) == ["fc1", "fc2"]
    assert km["fc1"].bias_name == "fc1.bias"
    assert km["fc1"].rows.tolist() == [1, 2]
    assert (km["fc1"].n_out, km["fc1"].n_in, km["fc1"].n_rows, km["fc1"].n_cols) == (4, 5, 2, 1)
    assert km["fc2"].bias_name is None
    assert km["fc2"].rows is None
    assert not km["fc2"].transposed
    with pytest.raises(TypeError, match=r"'fc2.weight'.*MaskBlock"):
        Subset.from_model(
            model, {"fc2.weight": MaskBlock(torch.ones(3, 4, dtype=torch.bool))}
        ).kron_modules()
    with pytest.raises(
        ValueError, match=r"'norm.weight' is not the weight or bias of a linear map"
    ):
        Subset.from_model(model, {"norm.weight": KronBlock()}).kron_modules()
    with pytest.raises(ValueError, match=r"'fc1.bias' is selected without its weight"):
        Subset.from_model(model, {"fc1.bias": KronBlock()}).kron_modules()
    for w, b in (([0], [1]), ([0], [0, 1]), (None, [0]), ([0], None)):  # all rows: None
        with pytest.raises(ValueError, match="bias rows to equal"):
            Subset.from_model(
                model, {"fc1.weight": KronBlock(w), "fc1.bias": KronBlock(b)}
            ).kron_modules()
    for rows in (None, [0, 3]):
        blocks = {"fc1.weight": KronBlock(rows), "fc1.bias": KronBlock(rows)}
        km = Subset.from_model(model, blocks).kron_modules()["fc1"]
        assert (km.bias_name, km.n_rows, km.n_cols) == ("fc1.bias", 2 if rows else 4, 5)


def test_percent_of_excludes_embeddings():
    model = Tiny()
    n_countable = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("emb"))
    assert countable_parameters(model) == n_countable
    assert countable_parameters(model, None) == n_countable + 35
    assert countable_parameters(model, [r"^emb", r"norm"]) == n_countable - 8
    s = Subset.from_model(model, {"fc1.weight": KronBlock()})
    assert s.percent_of(model) == pytest.approx(100 * 20 / n_countable)
    with pytest.raises(ValueError, match="exclude='tokens'"):
        countable_parameters(model, "tokens")
    with pytest.raises(ValueError, match="parameter structure"):
        s.percent_of(Tiny(n_in=2))


def test_conv1d_transposed(gpt2):
    name = "transformer.h.0.attn.c_attn.weight"
    w = dict(gpt2.named_parameters())[name]  # storage (n_in=16, n_out=48)
    rows, cols = [0, 5, 47], [2, 3]
    s = Subset.from_model(
        gpt2, {name: KronBlock(rows, cols), "transformer.h.0.attn.c_attn.bias": KronBlock(rows)}
    )
    assert s.transposed(name)
    assert not s.transposed("transformer.h.0.attn.c_attn.bias")
    mask = s.mask(name)
    assert mask.shape == (16, 48)
    expected = torch.zeros(16, 48, dtype=torch.bool)
    for r in rows:
        for c in cols:
            expected[c, r] = True  # logical W[r, c] lives at storage [c, r]
    assert torch.equal(mask, expected)
    assert torch.equal(s.gather(name, w.detach()), w.detach()[expected])
    km = s.kron_modules()["transformer.h.0.attn.c_attn"]
    assert km.transposed
    assert (km.n_out, km.n_in) == (48, 16)
    assert km.rows.tolist() == rows
    assert km.cols.tolist() == cols
    with pytest.raises(ValueError, match=r"rows for .*contains index 48.*size 48"):
        Subset.from_model(gpt2, {name: KronBlock([48])})
    assert Subset.from_model(gpt2, {name: KronBlock(None, [15])}).num_entries() == 48


def test_distilbert_naming(distilbert):
    s = Subset.from_model(
        distilbert, {"classifier.weight": KronBlock(), "classifier.bias": KronBlock()}
    )
    assert s.num_entries() == 2 * 16 + 2
    with pytest.raises(ValueError, match=r"close matches.*pre_classifier.weight"):
        Subset.from_model(distilbert, {"pre_clasifier.weight": KronBlock()})
    n_emb = sum(
        p.numel()
        for n, p in distilbert.named_parameters()
        if "embeddings" in n and "LayerNorm" not in n
    )
    total = sum(p.numel() for p in distilbert.parameters())
    assert countable_parameters(distilbert) == total - n_emb
