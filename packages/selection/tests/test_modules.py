import re

import pytest
import torch
from torch import nn

from partialbayes.selection import linear_modules
from partialbayes.selection._modules import grouped_linear_modules
from partialbayes.selection.internal import module_group


def test_linear_modules_in_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert list(linear_modules(model)) == ["0", "2.0"]


def test_no_linear_maps():
    with pytest.raises(ValueError, match="no linear maps"):
        linear_modules(nn.Sequential(nn.ReLU()))
    with pytest.raises(TypeError, match=r"nn.Module"):
        linear_modules("model")


def test_distilbert_groups(distilbert):
    groups = {n: module_group(n) for n in linear_modules(distilbert)}
    layer = "distilbert.transformer.layer.0"
    for proj in ("q_lin", "k_lin", "v_lin", "out_lin"):
        assert groups[f"{layer}.attention.{proj}"] == "attention"
    assert groups[f"{layer}.ffn.lin1"] == "mlp"
    assert groups[f"{layer}.ffn.lin2"] == "mlp"
    assert groups["pre_classifier"] == "mlp"
    assert groups["classifier"] == "mlp"
    assert len(groups) == 2 * 6 + 2
    assert None not in groups.values()


def test_bert_groups(bert):
    groups = {n: module_group(n) for n in linear_modules(bert)}
    layer = "bert.encoder.layer.1"
    for proj in ("self.query", "self.key", "self.value", "output.dense"):
        assert groups[f"{layer}.attention.{proj}"] == "attention"
    assert groups[f"{layer}.intermediate.dense"] == "mlp"
    assert groups[f"{layer}.output.dense"] == "mlp"
    assert groups["bert.pooler.dense"] == "mlp"
    assert groups["classifier"] == "mlp"
    assert sum(g == "attention" for g in groups.values()) == 8
    assert None not in groups.values()


def test_roberta_groups(roberta):
    groups = {n: module_group(n) for n in linear_modules(roberta)}
    assert groups["classifier.out_proj"] == "mlp"
    assert groups["classifier.dense"] == "mlp"
    assert groups["roberta.encoder.layer.0.attention.output.dense"] == "attention"
    assert groups["roberta.encoder.layer.0.output.dense"] == "mlp"


def test_gpt2_groups(gpt2):
    groups = {n: module_group(n) for n in linear_modules(gpt2)}
    assert groups["transformer.h.0.attn.c_attn"] == "attention"
    assert groups["transformer.h.0.attn.c_proj"] == "attention"
    assert groups["transformer.h.0.mlp.c_fc"] == "mlp"
    assert groups["transformer.h.0.mlp.c_proj"] == "mlp"
    assert groups["score"] == "mlp"


def test_parameter_names_accepted():
    assert module_group("bert.encoder.layer.0.attention.self.query.weight") == "attention"
    assert module_group("classifier.bias") == "mlp"
    assert module_group("bert.embeddings.LayerNorm") is None


def test_user_grouping_regex_and_callable():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    grouping = {"head": r"^2$", "body": r"^[01]$"}
    assert [module_group(n, grouping) for n in linear_modules(model)] == ["body", "body", "head"]
    assert module_group("0", {"x": re.compile("1")}) is None
    assert module_group("0", lambda n: "even" if int(n) % 2 == 0 else None) == "even"
    assert list(grouped_linear_modules(model, "head", grouping)) == ["2"]


def test_grouping_errors():
    with pytest.raises(TypeError, match="grouping"):
        module_group("a", 3)
    with pytest.raises(TypeError, match=r"grouping\(.a.\).*must be a str or None, got int"):
        module_group("a", lambda n: 1)
    with pytest.raises(TypeError, match="name must be a str"):
        module_group(1)
    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"group='mlp'.*groups present"):
        grouped_linear_modules(model, "mlp")


def test_conv1d_logical_shape(gpt2):
    mods = linear_modules(gpt2)
    c_attn = mods["transformer.h.0.attn.c_attn"]
    assert c_attn.weight.shape == (16, 48)  # storage n_in x n_out
    x = torch.randn(3, 16)
    assert torch.allclose(c_attn(x), x @ c_attn.weight + c_attn.bias)
