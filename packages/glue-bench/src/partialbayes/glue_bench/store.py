"""Results store: one JSON record per (task, split, method, size) cell, written atomically.

Layout of a results folder::

    config.json                                  the run configuration and its fingerprint
    records/<task>/split<k>/<method>/<size>.json  one record per finished cell
    checkpoints/<task>/split<k>/<model>-<fp>/    fine-tuned MAP weights (safetensors) + meta.json

A cell whose record exists is finished and never recomputed; a folder created with another
configuration is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, order=True)
class Cell:
    """One cell of the experiment grid."""

    task: str
    split: int
    method: str
    size: str

    def relpath(self) -> Path:
        """Path of the record relative to ``records/``."""
        size = re.sub(r"[^A-Za-z0-9._-]", "_", self.size)
        return Path(self.task) / f"split{self.split}" / self.method / f"{size}.json"


def fingerprint(config: dict[str, Any]) -> str:
    """Short sha256 of the canonical JSON of ``config``."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def temp_path(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` to write before an atomic rename onto ``path``.

    The name ``.<name>.tmp-<host>-<pid>-<token>`` holds the host name, the process id and a random token
    (``uuid4`` hex), so writers on several machines sharing one results folder (a network file system, where
    process ids repeat across machines) never write the same temporary file.
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    return path.with_name(f".{path.name}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex}")


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` via a unique temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class ResultStore:
    """A results folder bound to one configuration.

    Args:
        root: The results folder (created if missing).
        config: The configuration that determines every result (model, training settings, data
            caps, seed, ...); not the grid (tasks, splits, methods), which may grow between runs.

    Raises:
        ValueError: ``root`` already holds results of a different configuration.
    """

    def __init__(self, root: str | Path, config: dict[str, Any]) -> None:
        self.root = Path(root)
        self.config = config
        self.fingerprint = fingerprint(config)
        self.failures: list[str] = []
        path = self.root / "config.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old.get("fingerprint") != self.fingerprint:
                diff = sorted(
                    k
                    for k in set(old.get("config", {})) | set(config)
                    if old.get("config", {}).get(k) != config.get(k)
                )
                raise ValueError(
                    f"results folder {self.root} holds results of another configuration "
                    f"(fingerprint {old.get('fingerprint')} != {self.fingerprint}; differs in {diff}); "
                    "use a new --results folder or the same settings"
                )
        else:
            atomic_write_json(path, {"fingerprint": self.fingerprint, "config": config})

    def record_path(self, cell: Cell) -> Path:
        """Where the record of ``cell`` lives."""
        return self.root / "records" / cell.relpath()

    def has(self, cell: Cell) -> bool:
        """Whether ``cell`` is finished."""
        return self.record_path(cell).is_file()

    def write(self, cell: Cell, record: dict[str, Any]) -> None:
        """Write the record of ``cell`` atomically (the cell's keys and the fingerprint are added)."""
        full = {
            **record,
            "task": cell.task,
            "split": cell.split,
            "method": cell.method,
            "size": cell.size,
            "fingerprint": self.fingerprint,
        }
        atomic_write_json(self.record_path(cell), full)

    def read(self, cell: Cell) -> dict[str, Any]:
        """The record of a finished cell."""
        return json.loads(self.record_path(cell).read_text())

    def checkpoint_dir(self, task: str, split: int, model: str) -> Path:
        """Folder of the fine-tuned checkpoint of (task, split, model) under this configuration."""
        slug = re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name or model)
        return self.root / "checkpoints" / task / f"split{split}" / f"{slug}-{self.fingerprint}"


def iter_records(root: str | Path) -> Iterator[dict[str, Any]]:
    """Every record under ``root/records`` (sorted by path)."""
    for path in sorted((Path(root) / "records").rglob("*.json")):
        yield json.loads(path.read_text())


def parse_shard(text: str | None) -> tuple[int, int]:
    """Parse ``"i/n"`` (0 <= i < n) into ``(i, n)``; ``None`` means ``(0, 1)``."""
    if text is None:
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m[1]) < int(m[2]):
        raise ValueError(f"--shard must look like i/n with 0 <= i < n, got {text!r}")
    return int(m[1]), int(m[2])


def shard_units(
    units: Sequence[tuple[str, int, str]], shard: tuple[int, int]
) -> list[tuple[str, int, str]]:
    """The (task, split, method) units of shard ``i`` of ``n``: every n-th of the sorted units.

    Every unit lands in exactly one shard, whatever order the caller listed them in.
    """
    i, n = shard
    ordered = sorted(set(units))
    return [u for k, u in enumerate(ordered) if k % n == i]
