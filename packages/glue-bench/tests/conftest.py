"""Fixtures: a tiny tokenizer, tiny random-init encoders (the root ``tiny_models`` builders), a mini GLUE folder."""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest

from tiny_models import tiny_model

SYNTHETIC = {
    "SST-2": (
        "sentence\tlabel\n",
        [
            ("a charming and often affecting journey . ", "1"),
            ("unflinchingly bleak and desperate ", "0"),
            ('the " best " film of the year ', "1"),
            ("dull , lifeless and boring ", "0"),
        ],
    ),
}


def _build_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    words = ["the", "and", "a", "of", "to", "is", "in", "it", "that", "film"]
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *chars,
        *[f"##{c}" for c in chars],
        *words,
    ]
    path = folder / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n")  # "a" is a character and a word
    # transformers 5 reads the vocabulary from `vocab=` (`vocab_file=` is ignored: 5 special tokens only)
    return BertTokenizerFast(vocab=str(path), do_lower_case=True)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    return _build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def tiny_bert_factory(tiny_tokenizer):
    """Returns ``make(num_labels) -> (model, tokenizer)`` with a random-init 2-layer BERT (width 16)."""

    def make(num_labels: int = 2, seed: int = 0):
        model = tiny_model(
            "bert",
            size="s",
            vocab=tiny_tokenizer.vocab_size,
            positions=64,
            num_labels=num_labels,
            seed=seed,
        )
        return model, tiny_tokenizer

    return make


@pytest.fixture
def tiny_distilbert_factory(tiny_tokenizer):
    def make(num_labels: int = 2, seed: int = 0):
        model = tiny_model(
            "distilbert",
            size="s",
            vocab=tiny_tokenizer.vocab_size,
            positions=64,
            num_labels=num_labels,
            seed=seed,
        )
        return model, tiny_tokenizer

    return make


def _head(path: Path, n_rows: int) -> str:
    """Header plus the first ``n_rows`` data lines of a file (bytes kept, BOM included)."""
    with path.open(encoding="utf-8", newline="") as handle:
        lines = [handle.readline() for _ in range(n_rows + 1)]
    return "".join(lines)


@pytest.fixture
def mini_glue(tmp_path) -> Path:
    """A GLUE folder with the first 48 training and 24 dev rows of the real files when
    ``$PARTIALBAYES_DATA`` is set; otherwise a synthetic SST-2 folder of the same layout."""
    out = tmp_path / "glue"
    root = os.environ.get("PARTIALBAYES_DATA")
    if root and (Path(root) / "glue").is_dir():
        for task in ("SST-2", "MRPC", "RTE"):
            (out / task).mkdir(parents=True)
            for split, n in (("train", 48), ("dev", 24)):
                src = Path(root) / "glue" / task / f"{split}.tsv"
                (out / task / f"{split}.tsv").write_text(_head(src, n), encoding="utf-8")
        return out
    header, rows = SYNTHETIC["SST-2"]
    (out / "SST-2").mkdir(parents=True)
    for split, n in (("train", 48), ("dev", 24)):
        body = "".join(f"{rows[i % len(rows)][0]}\t{rows[i % len(rows)][1]}\n" for i in range(n))
        (out / "SST-2" / f"{split}.tsv").write_text(header + body)
    return out
