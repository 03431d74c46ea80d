"""Bayesian LoRA subsets over PEFT adapters, and tied weights in the candidate lists."""

from __future__ import annotations

import pytest
import torch

from partialbayes.selection import (
    KronBlock,
    last_layer,
    linear_modules,
    lora_modules,
    lora_subset,
    max_operator_norm,
    module_groups,
    modules,
    random_modules,
    sparse_kfac,
    summary,
    tied_linear_modules,
)
from partialbayes.selection._modules import grouped_linear_modules
from partialbayes.selection._norms import operator_norms
from partialbayes.selection.internal import module_group

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tiny_models import tiny_model  # noqa: E402

# peft calls a transformers method that transformers 5 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


def _bert():
    return tiny_model("bert", seed=0, size="s").eval()


def _lora(model, targets, r=2, task_type=None, **kw):
    # init_lora_weights=False: random B as well (PEFT's default B = 0 would tie every operator norm)
    cfg = peft.LoraConfig(
        r=r, target_modules=targets, init_lora_weights=False, task_type=task_type, **kw
    )
    return peft.get_peft_model(model, cfg).eval()


def _adapter_names(model):
    return [n for n in linear_modules(model) if ".lora_A." in n or ".lora_B." in n]


@pytest.fixture
def peft_bert():
    return _lora(_bert(), ["query", "value"], task_type="SEQ_CLS")


def _llama_lm():
    return tiny_model(
        "llama", "causal-lm", seed=1, size="s", vocab=40, num_key_value_heads=1
    ).eval()


def _gpt2_lm():
    return tiny_model("gpt2", "causal-lm", seed=2, size="s", vocab=40).eval()


def test_lora_subset_holds_exactly_the_adapters(peft_bert):
    mods = lora_modules(peft_bert)
    assert list(mods) == _adapter_names(peft_bert)
    assert len(mods) == 2 * 2 * 2  # 2 layers x (query, value) x (A, B)
    s = lora_subset(peft_bert)
    assert s.names == tuple(f"{n}.weight" for n in mods)
    assert s.num_entries() == 8 * 2 * 16
    assert all(s.block(n) == KronBlock() for n in s.names)
    assert list(s.kron_modules()) == list(mods)
    trainable = {n for n, p in peft_bert.named_parameters() if p.requires_grad}
    assert set(s.names) <= trainable
    assert "lora_A.default" in summary(s)


def test_lora_with_modules_to_save(peft_bert):
    s = lora_subset(peft_bert, modules_to_save=True)
    head = "base_model.model.classifier.modules_to_save.default"
    assert s.names[-2:] == (f"{head}.weight", f"{head}.bias")
    assert {n for n, p in peft_bert.named_parameters() if p.requires_grad} == set(s.names)
    plain = _lora(_bert(), ["query"])
    with pytest.raises(ValueError, match="no PEFT modules_to_save"):
        lora_subset(plain, modules_to_save=True)


@pytest.mark.parametrize("build", [_llama_lm, _gpt2_lm], ids=["llama", "gpt2"])
def test_causal_lm_adapters_skfac_and_operator_norm(build):
    base = build()
    gpt2 = "GPT2" in type(base).__name__
    targets = ["c_attn", "c_fc"] if gpt2 else ["q_proj", "v_proj", "down_proj"]
    model = _lora(base, targets, r=3, task_type="CAUSAL_LM", fan_in_fan_out=gpt2)
    mods = lora_modules(model)
    assert list(mods) == _adapter_names(model)
    assert len(mods) == 2 * len(targets) * 2
    full = lora_subset(model)
    # S-KFAC restricted to the adapters: ceil(p r / 100) of the rank dimension, inside the LoRA subset
    s = sparse_kfac(model, 50, modules=mods)
    assert s <= full
    assert set(s.kron_modules()) == set(mods)
    for name, km in s.kron_modules().items():
        n_out, n_in = mods[name].weight.shape
        assert len(km.rows) == -(-50 * n_out // 100)
        assert len(km.cols) == -(-50 * n_in // 100)
    # operator norm over the adapters only: the k largest spectral norms among them
    norms = {n: float(torch.linalg.matrix_norm(m.weight.detach(), ord=2)) for n, m in mods.items()}
    top = sorted(norms, key=norms.get, reverse=True)[:3]
    picked = max_operator_norm(model, 3, group="all", modules=mods)
    assert {n.rsplit(".", 1)[0] for n in picked.names} == set(top)
    assert picked <= full
    got = operator_norms(model, modules=mods)
    assert got == pytest.approx(norms, rel=1e-5)
    # attention / mlp groups follow the wrapped layer
    groups = module_groups(model)
    for n in mods:
        want = "mlp" if (".mlp." in n) else "attention"
        assert groups[n] == want
    assert len(random_modules(model, 2, seed=0, group="attention", modules=mods).names) == 2
    # the tied language-model head of GPT-2 is no candidate; Llama's is untied (tie_word_embeddings=False)
    if gpt2:
        assert set(tied_linear_modules(model)) == {"base_model.model.lm_head"}
        assert "base_model.model.lm_head" not in grouped_linear_modules(model)
        sparse_kfac(model, 10)  # every untied map, without tripping on lm_head


@pytest.mark.filterwarnings(
    "ignore:Already unmerged"
)  # peft, for the never-merged adapter "second"
def test_lora_adapter_choice_and_errors():
    model = _lora(_bert(), ["query"])
    model.add_adapter("second", peft.LoraConfig(r=3, target_modules=["value"]))
    # only the active adapter by default
    assert all(".default" in n for n in lora_modules(model))
    assert list(lora_modules(model, "second")) == [
        n for n in _adapter_names(model) if n.endswith(".second")
    ]
    assert len(lora_modules(model, ["default", "second"])) == 8
    with pytest.raises(
        ValueError, match=r"unknown LoRA adapter\(s\) \['third'\]; adapters present"
    ):
        lora_modules(model, "third")
    with pytest.raises(TypeError, match="adapter"):
        lora_modules(model, [1])
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged into the base weights"):
        lora_subset(model)
    model.unmerge_adapter()
    assert len(lora_subset(model)) == 4


def test_no_adapters_says_so():
    with pytest.raises(
        ValueError, match=r"BertForSequenceClassification has no LoRA adapters.*peft"
    ):
        lora_subset(_bert())
    with pytest.raises(TypeError, match=r"nn\.Module"):
        lora_modules("model")


def test_peft_wrappers_are_grouped_and_original_module_is_idle(peft_bert):
    groups = module_groups(peft_bert)
    assert set(groups) == set(linear_modules(peft_bert))
    assert "other" not in groups.values()
    wrapped = "base_model.model.bert.encoder.layer.0.attention.self.query"
    for part in ("base_layer", "lora_A.default", "lora_B.default"):
        assert groups[f"{wrapped}.{part}"] == "attention"
        assert module_group(f"{wrapped}.{part}.weight") == "attention"  # by name alone too
    assert module_group("base_model.model.classifier.modules_to_save.default.bias") == "mlp"
    head = "base_model.model.classifier"
    assert groups[f"{head}.original_module"] == groups[f"{head}.modules_to_save.default"] == "mlp"
    # the frozen original head takes no part in the forward pass: never a default candidate
    assert f"{head}.original_module" not in grouped_linear_modules(peft_bert)
    assert f"{head}.modules_to_save.default" in grouped_linear_modules(peft_bert, "mlp")
    assert all("original_module" not in n for n in sparse_kfac(peft_bert, 30).names)
    with pytest.raises(
        ValueError, match=r"among the given modules; groups present: \['attention'\]"
    ):
        max_operator_norm(peft_bert, 1, group="mlp", modules=lora_modules(peft_bert))


def test_tied_head_is_refused_with_a_clear_message():
    model = _gpt2_lm()
    assert tied_linear_modules(model) == {"lm_head": "transformer.wte.weight"}
    assert "lm_head" not in {n.rsplit(".", 1)[0] for n in sparse_kfac(model, 50).names}
    assert len(max_operator_norm(model, 4, group="all").names) == 8
    with pytest.raises(
        ValueError, match=r"'lm_head' shares its weight with 'transformer\.wte\.weight'"
    ):
        sparse_kfac(model, 50, modules=["lm_head"])
    with pytest.raises(ValueError, match=r"'lm_head'.*tied to the token embedding"):
        last_layer(model)
    with pytest.raises(ValueError, match=r"same tensor as 'transformer\.wte\.weight'"):
        modules(model, ["lm_head"])


def test_original_head_with_several_maps_is_idle():
    roberta = tiny_model("roberta", seed=0, size="s", layers=1, positions=40)
    model = _lora(roberta, ["query"], task_type="SEQ_CLS")
    names = set(grouped_linear_modules(model))
    head = "base_model.model.classifier"
    assert {
        f"{head}.modules_to_save.default.dense",
        f"{head}.modules_to_save.default.out_proj",
    } <= names
    assert not any(".original_module." in n for n in names)
    s = lora_subset(model, modules_to_save=True)
    assert f"{head}.modules_to_save.default.out_proj.weight" in s.names
