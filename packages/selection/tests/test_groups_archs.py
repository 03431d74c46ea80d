"""Module groups on every architecture the paper's strategies are meant for (tiny configs built in code)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partialbayes.selection import (
    linear_modules,
    max_operator_norm,
    min_operator_norm,
    module_groups,
    random_modules,
)
from partialbayes.selection._modules import grouped_linear_modules
from partialbayes.selection.internal import module_group, rank_by_operator_norm

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402

L = 2  # layers (encoder and decoder each for T5 / BART)


def _tiny(arch, **config):
    return lambda T: tiny_model(arch, size="s", layers=L, **config)


def _deberta_v2(T):
    # relative attention with separate position projections: 5 attention maps in the self-attention
    return T.DebertaV2ForSequenceClassification(
        T.DebertaV2Config(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=L,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            share_att_key=False,
            max_relative_positions=8,
            position_buckets=4,
        )
    )


def _electra(T):
    # embedding_size != hidden_size: ELECTRA adds `embeddings_project`, a map no rule places
    return T.ElectraForSequenceClassification(
        T.ElectraConfig(
            vocab_size=50,
            embedding_size=8,
            hidden_size=16,
            num_hidden_layers=L,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )


def _decoder_kwargs():
    return {
        "vocab_size": 50,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": L,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
        "pad_token_id": 0,
    }


def _qwen2(T):
    return T.Qwen2ForSequenceClassification(T.Qwen2Config(**_decoder_kwargs()))


def _modernbert(T):
    return T.ModernBertForSequenceClassification(
        T.ModernBertConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=L,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=0,
        )
    )


def _t5(T):
    return T.T5ForSequenceClassification(
        T.T5Config(
            vocab_size=50,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=L,
            num_decoder_layers=L,
            num_heads=2,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    )


def _bart(T):
    return T.BartForSequenceClassification(
        T.BartConfig(
            vocab_size=50,
            d_model=16,
            encoder_layers=L,
            decoder_layers=L,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=32,
        )
    )


# name: (builder, transformers class needed, attention maps, mlp maps, other maps). Per layer: BERT-like
# encoders have Q, K, V, O and intermediate / output; DeBERTa-v2 adds the two position projections; GPT-2
# fuses QKV (c_attn, c_proj | c_fc, c_proj); Llama / Qwen2 have gate / up / down; ModernBERT fuses QKV
# (Wqkv, Wo | Wi, Wo); T5 / BART decoders add cross-attention (4 maps). Heads: BERT pooler + classifier,
# DistilBERT pre_classifier + classifier, RoBERTa / ELECTRA / T5 / BART dense + out_proj, DeBERTa pooler +
# classifier, GPT-2 / Llama / Qwen2 score, ModernBERT head.dense + classifier.
ARCHS = {
    "bert": (_tiny("bert"), "BertForSequenceClassification", 4 * L, 2 * L + 2, 0),
    "distilbert": (_tiny("distilbert"), "DistilBertForSequenceClassification", 4 * L, 2 * L + 2, 0),
    "roberta": (
        _tiny("roberta", positions=40),
        "RobertaForSequenceClassification",
        4 * L,
        2 * L + 2,
        0,
    ),
    "deberta-v2": (_deberta_v2, "DebertaV2ForSequenceClassification", 6 * L, 2 * L + 2, 0),
    "electra": (_electra, "ElectraForSequenceClassification", 4 * L, 2 * L + 2, 1),
    "gpt2": (_tiny("gpt2", pad_token_id=0), "GPT2ForSequenceClassification", 2 * L, 2 * L + 1, 0),
    "llama": (
        _tiny("llama", num_key_value_heads=1, pad_token_id=0),
        "LlamaForSequenceClassification",
        4 * L,
        3 * L + 1,
        0,
    ),
    "qwen2": (_qwen2, "Qwen2ForSequenceClassification", 4 * L, 3 * L + 1, 0),
    "modernbert": (_modernbert, "ModernBertForSequenceClassification", 2 * L, 2 * L + 2, 0),
    "t5": (_t5, "T5ForSequenceClassification", 4 * L + 8 * L, 2 * L + 2 * L + 2, 0),
    "bart": (_bart, "BartForSequenceClassification", 4 * L + 8 * L, 2 * L + 2 * L + 2, 0),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    build, cls, *counts = ARCHS[request.param]
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    torch.manual_seed(0)
    return request.param, build(transformers).eval(), counts


def test_every_linear_map_in_exactly_one_group(arch):
    name, model, (n_att, n_mlp, n_other) = arch
    lin = linear_modules(model)
    groups = module_groups(model)
    assert list(groups) == list(lin)
    parts = {
        g: set(grouped_linear_modules(model, g))
        for g in ("attention", "mlp", "other")
        if g in groups.values()
    }
    union = set().union(*parts.values())
    assert union == set(lin), f"{name}: maps in no group: {set(lin) - union}"
    assert sum(len(p) for p in parts.values()) == len(lin)  # pairwise disjoint
    counts = {g: len(p) for g, p in parts.items()}
    assert counts == {
        g: n for g, n in (("attention", n_att), ("mlp", n_mlp), ("other", n_other)) if n
    }


def test_attention_and_mlp_by_role(arch):
    _, model, _ = arch
    groups = module_groups(model)
    for n, g in groups.items():
        parts = n.split(".")
        # cross-attention (T5 EncDecAttention, BART encoder_attn) and self-attention are attention
        if {"EncDecAttention", "encoder_attn", "SelfAttention", "self_attn", "attn"} & set(parts):
            assert g == "attention", n
        if {"mlp", "ffn", "DenseReluDense", "intermediate", "fc1", "fc2"} & set(parts):
            assert g == "mlp", n
        if parts[0] in {"classifier", "score", "pre_classifier", "classification_head", "head"}:
            assert g == "mlp", n  # the heads are MLP, as in the paper
        if "pooler" in parts:
            assert g == "mlp", n


def test_name_rules_agree_with_structure(arch):
    _, model, _ = arch
    for n, g in module_groups(model).items():
        assert module_group(n) == (None if g == "other" else g), n
        assert module_group(f"{n}.weight", model=model) == g


def test_operator_norm_strategies_run(arch):
    name, model, (n_att, n_mlp, _) = arch
    for group, count in (("attention", n_att), ("mlp", n_mlp)):
        k = min(2, count)
        top = max_operator_norm(model, k, group=group, method="gram")
        low = min_operator_norm(model, k, group=group)
        ranked = rank_by_operator_norm(model, group)
        assert len(ranked) == count
        assert {s.rsplit(".", 1)[0] for s in top.names} == {n for n, _ in ranked[:k]}
        assert {s.rsplit(".", 1)[0] for s in low.names} == {n for n, _ in ranked[-k:]}
        assert (
            len({s.rsplit(".", 1)[0] for s in random_modules(model, k, seed=0, group=group).names})
            == k
        )
    assert len(rank_by_operator_norm(model, "all")) == n_att + n_mlp + (name == "electra")


def test_bert_cross_attention_is_attention():
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        is_decoder=True,
        add_cross_attention=True,
    )
    groups = module_groups(transformers.BertModel(cfg, add_pooling_layer=False))
    cross = [n for n in groups if ".crossattention." in n]
    assert len(cross) == 4
    assert all(groups[n] == "attention" for n in cross)
    assert sum(g == "attention" for g in groups.values()) == 8


def test_tied_lm_head_is_grouped_but_never_a_candidate():
    model = tiny_model("gpt2", "causal-lm", size="s", layers=1)
    assert module_groups(model)["lm_head"] == "mlp"
    assert "lm_head" not in grouped_linear_modules(model, "mlp")
    assert len(grouped_linear_modules(model, "all")) == 4


class _TokenMixerAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(4, 4)


class _GatedFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.token = _TokenMixerAttention()
        self.channel = _GatedFeedForward()
        self.proj = nn.Linear(4, 4)


def test_class_rules_and_the_other_group():
    model = _Block()
    groups = module_groups(model)
    assert groups == {"token.mix": "attention", "channel.w": "mlp", "proj": "other"}
    # a name alone cannot see the classes
    assert module_group("token.mix") is None
    assert module_group("token.mix", model=model) == "attention"
    assert module_group("proj", model=model) == "other"
    assert list(grouped_linear_modules(model, "other")) == ["proj"]
    with pytest.raises(ValueError, match=r"'token' is not a linear map"):
        module_group("token", model=model)
    # a user grouping leaves maps it does not name in "other"
    assert module_groups(model, {"mine": r"^proj$"}) == {
        "token.mix": "other",
        "channel.w": "other",
        "proj": "mine",
    }
