"""GLUE SST-2, MRPC and RTE: TSV readers, the paper's train/validation splits and tokenised batches.

The GLUE dev set is the test set (test labels are hidden); the training file is split per seed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from partialbayes.predictive.internal import check_int, check_keys, check_known

DATA_ENV = "PARTIALBAYES_DATA"


@dataclass(frozen=True)
class TaskSpec:
    """How to read one GLUE task: its TSV columns, labels (in class order), the paper's split sizes."""

    name: str
    folder: str
    text_columns: tuple[str, ...]
    label_column: str
    labels: tuple[str, ...]
    train_size: int
    val_size: int
    hub_text_columns: tuple[str, ...] = ("sentence1", "sentence2")

    @property
    def num_labels(self) -> int:
        """Number of classes."""
        return len(self.labels)


BINARY, ENTAILMENT = ("0", "1"), ("entailment", "not_entailment")
TASKS: dict[str, TaskSpec] = {
    "sst2": TaskSpec("sst2", "SST-2", ("sentence",), "label", BINARY, 60_600, 6_700, ("sentence",)),
    "mrpc": TaskSpec("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", BINARY, 3_300, 370),
    "rte": TaskSpec("rte", "RTE", ("sentence1", "sentence2"), "label", ENTAILMENT, 2_240, 250),
}


@dataclass(frozen=True)
class Examples:
    """Texts (a tuple of one or two strings per example) and class indices of one data split."""

    texts: tuple[tuple[str, ...], ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, indices: Sequence[int]) -> Examples:
        """The examples at ``indices``, in that order."""
        return Examples(
            tuple(self.texts[i] for i in indices), tuple(self.labels[i] for i in indices)
        )


def task_spec(name: str) -> TaskSpec:
    """The :class:`TaskSpec` of ``name``; raises ``ValueError`` listing the valid names."""
    key = name.lower().replace("-", "")
    check_known("GLUE task", key, TASKS, "valid tasks")
    return TASKS[key]


def default_glue_dir() -> Path | None:
    """``$PARTIALBAYES_DATA/glue`` when the variable is set, else ``None``."""
    root = os.environ.get(DATA_ENV)
    return Path(root) / "glue" if root else None


def read_glue_tsv(path: str | Path, spec: TaskSpec) -> Examples:
    """Read one GLUE TSV file (tab-separated, quoting off, optional UTF-8 BOM); labels index ``spec.labels``.

    Errors (missing file, column, field or an unknown label) name the file and line.
    """
    path = Path(path)  # a missing file: open's FileNotFoundError names it
    label_index = {label: i for i, label in enumerate(spec.labels)}
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    texts: list[tuple[str, ...]] = []
    labels: list[int] = []
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{path}: empty file, expected a header line") from None
        check_keys(
            f"{path}: line 1: header {header}", header, (*spec.text_columns, spec.label_column)
        )
        text_pos = [header.index(c) for c in spec.text_columns]
        label_pos = header.index(spec.label_column)
        for row in reader:
            line = reader.line_num
            if not row or row == [""]:
                continue
            if len(row) != len(header):
                raise ValueError(
                    f"{path}: line {line}: expected {len(header)} tab-separated fields, got {len(row)}"
                )
            label = row[label_pos].strip()
            if label not in label_index:
                raise ValueError(
                    f"{path}: line {line}: label {label!r} is not one of {list(spec.labels)}"
                )
            texts.append(tuple(row[p] for p in text_pos))
            labels.append(label_index[label])
    return Examples(tuple(texts), tuple(labels))


def load_glue_local(task: str, glue_dir: str | Path) -> tuple[Examples, Examples]:
    """Read ``<glue_dir>/<Task>/train.tsv`` and ``dev.tsv``; returns ``(train, test)``."""
    spec = task_spec(task)
    folder = Path(glue_dir) / spec.folder
    return read_glue_tsv(folder / "train.tsv", spec), read_glue_tsv(folder / "dev.tsv", spec)


def load_glue_hub(task: str) -> tuple[Examples, Examples]:
    """Download ``(train, test)`` from the Hugging Face hub (``nyu-mll/glue``; needs the ``hub`` extra)."""
    spec = task_spec(task)
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "loading GLUE from the hub needs `datasets`: pip install 'partialbayes-glue-bench[hub]'"
        ) from err
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise OSError(f"the Hugging Face hub is switched off ({var} is set)")
    ds = datasets.load_dataset("nyu-mll/glue", spec.name)  # pragma: no cover - needs the hub

    def convert(split: Any) -> Examples:
        cols = [split[c] for c in spec.hub_text_columns]
        return Examples(tuple(zip(*cols, strict=True)), tuple(int(v) for v in split["label"]))

    return convert(ds["train"]), convert(ds["validation"])


def glue_missing_message(task: str, glue_dir: Path | None) -> str:
    """A message saying where to put the GLUE files or which flag to pass."""
    spec = task_spec(task)
    where = f"{glue_dir}/{spec.folder}/" if glue_dir else f"$PARTIALBAYES_DATA/glue/{spec.folder}/"
    return (
        f"GLUE data for {task} not found: put train.tsv and dev.tsv (the standard GLUE TSV files) "
        f"in {where}, or pass --glue-dir /path/to/glue (a folder holding {spec.folder}/), "
        f"or set {DATA_ENV} to a folder holding glue/{spec.folder}/"
    )


def load_glue(task: str, glue_dir: str | Path | None = None) -> tuple[Examples, Examples]:
    """``(train, test)`` of a GLUE task from ``glue_dir`` (default ``$PARTIALBAYES_DATA/glue``), else the hub.

    ``FileNotFoundError`` saying where to put the data (and why the hub failed) when neither has it.
    """
    spec = task_spec(task)
    folder = Path(glue_dir) if glue_dir is not None else default_glue_dir()
    if folder is not None and (glue_dir is not None or (folder / spec.folder).is_dir()):
        return load_glue_local(task, folder)
    try:
        return load_glue_hub(task)
    except Exception as err:  # no `datasets`, hub switched off or unreachable, ...: say which
        raise FileNotFoundError(
            f"{glue_missing_message(task, folder)}; the Hugging Face hub (nyu-mll/glue) was tried "
            f"instead and failed: {type(err).__name__}: {err}"
        ) from err


def data_fingerprint(train: Examples, test: Examples) -> dict[str, Any]:
    """``{"sha256", "n_train", "n_test"}`` of the parsed texts and labels (not the files' bytes)."""
    h = hashlib.sha256()
    for part in (train, test):
        h.update(json.dumps([part.texts, part.labels], ensure_ascii=False).encode())
        h.update(b"\x00")
    return {"sha256": h.hexdigest(), "n_train": len(train), "n_test": len(test)}


def split_indices(
    n: int, spec: TaskSpec, split: int, max_train: int | None = None
) -> tuple[list[int], list[int]]:
    """Seeded, disjoint ``(train indices, validation indices)`` into the ``n`` rows of the training file.

    Validation: the first ``spec.val_size`` of a permutation seeded by ``split``, training the next
    ``spec.train_size``; ``max_train`` cuts both in proportion (validation at least 64), nested in the full split.
    """
    check_int("split", split, "[0, inf)")
    if max_train is not None:
        check_int("max_train", max_train)
    gen = torch.Generator().manual_seed(1000 + split)
    perm = torch.randperm(n, generator=gen).tolist()
    full_val = min(spec.val_size, n // 2)
    n_val, n_train = full_val, min(spec.train_size, n - full_val)
    if max_train is not None and max_train < n_train:
        n_val = min(n_val, max(64, round(max_train * spec.val_size / spec.train_size)))
        n_train = max_train
    return perm[full_val : full_val + n_train], perm[:n_val]


def encode(
    examples: Examples,
    tokenizer: Any,
    batch_size: int,
    max_length: int | None = 128,
    sort_by_length: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Tokenise into dict batches padded per batch, with ``labels``; ``sort_by_length`` orders by text length first."""
    if sort_by_length:
        order = sorted(range(len(examples)), key=lambda i: sum(len(t) for t in examples.texts[i]))
        examples = examples.take(order)
    options = {"padding": "longest", "truncation": True, "max_length": max_length}
    options["return_tensors"] = "pt"
    out = []
    for start in range(0, len(examples), batch_size):
        columns = zip(*examples.texts[start : start + batch_size], strict=True)
        batch = dict(tokenizer(*[list(c) for c in columns], **options).items())
        batch["labels"] = torch.tensor(examples.labels[start : start + batch_size])
        out.append(batch)
    return out


def count_truncated(examples: Examples, tokenizer: Any, max_length: int) -> int:
    """How many of ``examples`` have more than ``max_length`` tokens (and are cut by :func:`encode`)."""
    n = 0
    for start in range(0, len(examples), 256):
        columns = list(zip(*examples.texts[start : start + 256], strict=True))
        enc = tokenizer(*[list(c) for c in columns], truncation=False)
        n += sum(len(ids) > max_length for ids in enc["input_ids"])
    return n
