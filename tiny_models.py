"""Tiny randomly initialised Hugging Face models, built in code, for every package's tests.

The hub is unreachable in tests, so models come from configs written here. The root ``conftest.py`` puts this
file's folder on ``sys.path``, so a test module of any package imports it as ``from tiny_models import
tiny_model`` both in the workspace environment and in nox's ``isolated`` sessions (which run a package's
tests from the checkout against its installed wheel). ``transformers`` is imported on first use only: a
package whose tests do not need it does not need it installed.

Two presets give the sizes the tests use: ``"xs"`` (hidden 8, one layer, 2 heads, intermediate 12, 16
positions, vocabulary 30) and ``"s"`` (hidden 16, two layers, 2 heads, intermediate 32, 32 positions,
vocabulary 50). Generic keywords (``vocab``, ``hidden``, ``layers``, ``heads``, ``intermediate``,
``positions``) override a preset and are mapped to each architecture's own config names; any other keyword
is passed to the config unchanged (``pad_token_id=0``, ``num_key_value_heads=1``, ...). GPT-2 keeps its own
inner size (``4 · hidden``) unless ``intermediate`` is given.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PRESETS: dict[str, dict[str, int]] = {
    "xs": {"vocab": 30, "hidden": 8, "layers": 1, "heads": 2, "intermediate": 12, "positions": 16},
    "s": {"vocab": 50, "hidden": 16, "layers": 2, "heads": 2, "intermediate": 32, "positions": 32},
}

# generic keyword -> the architecture's config field (None: not set from the preset)
_BERT_LIKE = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "intermediate": "intermediate_size",
    "positions": "max_position_embeddings",
}
_FIELDS: dict[str, dict[str, str]] = {
    "bert": _BERT_LIKE,
    "roberta": _BERT_LIKE,
    "llama": _BERT_LIKE,
    "albert": {**_BERT_LIKE, "embedding": "embedding_size"},
    "distilbert": {
        "vocab": "vocab_size",
        "hidden": "dim",
        "layers": "n_layers",
        "heads": "n_heads",
        "intermediate": "hidden_dim",
        "positions": "max_position_embeddings",
    },
    "gpt2": {
        "vocab": "vocab_size",
        "hidden": "n_embd",
        "layers": "n_layer",
        "heads": "n_head",
        "intermediate": "n_inner",
        "positions": "n_positions",
    },
}
_PREFIX = {
    "bert": "Bert",
    "roberta": "Roberta",
    "llama": "Llama",
    "albert": "Albert",
    "distilbert": "DistilBert",
    "gpt2": "GPT2",
}
_HEADS = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}
_CAUSAL_LM = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def tiny_config(
    arch: str,
    *,
    size: str = "xs",
    num_labels: int = 2,
    vocab: int | None = None,
    hidden: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    intermediate: int | None = None,
    positions: int | None = None,
    **config: Any,
) -> Any:
    """The config of a tiny ``arch`` model (``bert``, ``roberta``, ``distilbert``, ``albert``, ``gpt2``, ``llama``).

    Args:
        arch: Architecture.
        size: Preset, ``"xs"`` or ``"s"``.
        num_labels: Classes of a classification head.
        vocab: Vocabulary size (overrides the preset).
        hidden: Hidden size (ALBERT: also the embedding size).
        layers: Number of layers.
        heads: Attention heads.
        intermediate: Feed-forward size (GPT-2: ``n_inner``, only when given).
        positions: Maximum number of positions.
        **config: Further config fields, passed unchanged (they win over the generic ones).

    Returns:
        A ``transformers`` config.
    """
    import transformers

    if arch not in _FIELDS:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(_FIELDS)}")
    given = {
        "vocab": vocab,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "intermediate": intermediate,
        "positions": positions,
    }
    values = {**PRESETS[size], **{k: v for k, v in given.items() if v is not None}}
    if arch == "gpt2" and intermediate is None:
        del values["intermediate"]
    values["embedding"] = values["hidden"]
    fields = _FIELDS[arch]
    kwargs = {fields[k]: v for k, v in values.items() if k in fields}
    kwargs.update(config)
    cfg = getattr(transformers, f"{_PREFIX[arch]}Config")(**kwargs)
    cfg.num_labels = num_labels
    return cfg


def tiny_model(
    arch: str, head: str = "sequence", *, seed: int | None = None, **options: Any
) -> nn.Module:
    """A tiny randomly initialised ``arch`` model with a ``head`` (in training mode, as built).

    Args:
        arch: Architecture (see `tiny_config`).
        head: ``"sequence"`` (sequence classification), ``"token"`` (token classification) or
            ``"causal-lm"`` (GPT-2 / Llama language models).
        seed: ``torch.manual_seed(seed)`` right before building (``None``: the current RNG state).
        **options: `tiny_config`'s keywords.

    Returns:
        The model.
    """
    import transformers

    cfg = tiny_config(arch, **options)
    if head == "causal-lm":
        name = _CAUSAL_LM[arch]
    elif head in _HEADS:
        name = _PREFIX[arch] + _HEADS[head]
    else:
        raise ValueError(f"unknown head {head!r}; known: sequence, token, causal-lm")
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, name)(cfg)


def lora_gpt2(layers: int = 2, width: int = 256, *, tied: bool = False, seed: int = 0) -> nn.Module:
    """A GPT-2-shaped causal LM with GPT-2's 50,257-token vocabulary and PEFT LoRA r=8, in eval mode.

    Random weights (memory and time depend on the sizes, not the values): ``layers`` blocks of ``width``
    (``width // 64`` heads, at least 4), a head tied to the embeddings or not, and random rank-8 adapters on
    ``c_attn``, ``c_proj`` and ``c_fc``. The defaults are the model of issue #23; ``layers=12, width=768,
    tied=True`` is GPT-2 small (124M parameters). Needs ``peft``.
    """
    import peft

    base = tiny_model(
        "gpt2",
        "causal-lm",
        seed=seed,
        vocab=50257,
        hidden=width,
        layers=layers,
        heads=max(4, width // 64),
        positions=1024,
        tie_word_embeddings=tied,
    )
    targets = ["c_attn", "c_proj", "c_fc"]
    lora = peft.LoraConfig(
        r=8, target_modules=targets, fan_in_fan_out=True, init_lora_weights=False
    )
    return peft.get_peft_model(base, lora).eval()


def answer_batches(
    n_batches: int, size: int, length: int, *, span: int = 1, vocab: int = 50257, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Batches of ``size`` random sequences of ``length`` tokens with one answer token each.

    The answer stands in the last ``span`` positions (at random); every other label is -100, the attention
    mask is all ones.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, vocab, (size, length), generator=g)
        labels = torch.full_like(ids, -100)
        answer = torch.randint(length - span, length, (size,), generator=g)
        labels[torch.arange(size), answer] = ids[torch.arange(size), answer]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def peak_gib() -> float:
    """Peak resident memory of this process so far, GiB (``VmHWM``; the memory scripts' measure)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 2**20
