"""Tiny Hugging Face models built in code (the hub is unreachable), shared by the selection tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def distilbert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(
        vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32
    )
    return transformers.DistilBertForSequenceClassification(cfg).eval()


@pytest.fixture(scope="session")
def bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    return transformers.BertForSequenceClassification(cfg).eval()


@pytest.fixture(scope="session")
def roberta():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
    )
    return transformers.RobertaForSequenceClassification(cfg).eval()


@pytest.fixture(scope="session")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=50,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2ForSequenceClassification(cfg).eval()
