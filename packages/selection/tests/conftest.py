"""Tiny Hugging Face models built in code (the hub is unreachable), shared by the selection tests."""

from __future__ import annotations

import pytest

from tiny_models import tiny_model


@pytest.fixture(scope="session")
def distilbert():
    pytest.importorskip("transformers")
    return tiny_model("distilbert", seed=0, size="s").eval()


@pytest.fixture(scope="session")
def bert():
    pytest.importorskip("transformers")
    return tiny_model("bert", seed=0, size="s").eval()


@pytest.fixture(scope="session")
def roberta():
    pytest.importorskip("transformers")
    return tiny_model("roberta", seed=0, size="s", layers=1, positions=40).eval()


@pytest.fixture(scope="session")
def gpt2():
    pytest.importorskip("transformers")
    return tiny_model("gpt2", seed=0, size="s", bos_token_id=0, eos_token_id=0).eval()
