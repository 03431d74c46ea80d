"""Results store: one JSON record per (task, split, method, size) cell, written atomically.

Layout of a results folder::

    config.json                                  the run configuration and its fingerprint
    data/<task>.json                             fingerprint of the data each task was run on
    records/<task>/split<k>/<method>/<size>.json  one record per finished cell
    checkpoints/<task>/split<k>/<model>-<fp>/    fine-tuned MAP weights (safetensors) + meta.json,
                                                 and the shared curvature pass (curvature-*.safetensors)

A cell whose record exists is finished and never recomputed; a folder created with another
configuration, or a task whose data changed, is refused. ``config.json`` is written only when the first
result (a checkpoint or a record) is stored, so a run that fails before producing anything (a model that
cannot be loaded, missing data) leaves no folder that would refuse the next attempt.
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

# Record and checkpoint-meta fields that are wall-clock or CPU times: the only fields of two runs with the
# same settings on the same machine that may differ (everything else is bit-identical, see
# `without_timings`).
TIMING_FIELDS = frozenset(
    {
        "seconds",
        "cpu_seconds",
        "fit_seconds",
        "predict_seconds",
        "finetune_seconds",
        "finetune_cpu_seconds",
        "posterior_setup_seconds",
        "curvature_seconds",
    }
)


def without_timings(obj: Any) -> Any:
    """``obj`` (a record, a checkpoint meta, any JSON value) with every :data:`TIMING_FIELDS` key removed.

    Applied recursively to nested dicts and lists: two runs with the same configuration on the same
    machine and device give equal results under this function.
    """
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMING_FIELDS}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


def read_json(path: Path, what: str = "file") -> Any:
    """Parse the JSON file ``path``; a missing, unreadable or corrupt file raises ``ValueError`` naming it.

    Raises:
        ValueError: The file cannot be read or is not valid JSON (the message names ``path`` and ``what``
            it is, and says how to recover).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {what} {path}: {err}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{what} {path} is not valid JSON ({err}); it is damaged: delete or restore it"
        ) from err


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
        self._check_config()

    @property
    def config_path(self) -> Path:
        """``<root>/config.json``."""
        return self.root / "config.json"

    def _check_config(self) -> bool:
        """Refuse a folder holding another configuration; ``True`` when ``config.json`` exists (and matches)."""
        path = self.config_path
        if not path.is_file():
            return False
        old = read_json(path, "results configuration")
        if not isinstance(old, dict) or not isinstance(old.get("config", {}), dict):
            raise ValueError(
                f"results configuration {path} is damaged (not a JSON object with 'config'): "
                "delete or restore it"
            )
        if old.get("fingerprint") != self.fingerprint:
            diff = sorted(
                k
                for k in set(old.get("config", {})) | set(self.config)
                if old.get("config", {}).get(k) != self.config.get(k)
            )
            raise ValueError(
                f"results folder {self.root} holds results of another configuration "
                f"(fingerprint {old.get('fingerprint')} != {self.fingerprint}; differs in {diff}); "
                "use a new --results folder or the same settings"
            )
        return True

    def claim(self) -> None:
        """Write ``config.json`` unless it is there (checked again first): called before storing a result."""
        if not self._check_config():
            atomic_write_json(
                self.config_path, {"fingerprint": self.fingerprint, "config": self.config}
            )

    def check_data(self, task: str, data: dict[str, Any]) -> None:
        """Refuse to mix results computed on different data for ``task``; record the data on first use.

        Args:
            task: Task name.
            data: The data fingerprint, e.g. ``{"sha256": ..., "n_train": ..., "n_test": ...}``
                (:func:`partialbayes.glue_bench.data_glue.data_fingerprint`).

        Raises:
            ValueError: ``<root>/data/<task>.json`` holds another fingerprint (the message names the task and
                both digests), or is damaged.
        """
        path = self.root / "data" / f"{task}.json"
        if path.is_file():
            old = read_json(path, "data fingerprint")
            if old != data:
                raise ValueError(
                    f"results folder {self.root} holds {task} results computed on other data "
                    f"({path}: sha256 {_digest(old)}, now {_digest(data)}); the {task} files changed: "
                    "use a new --results folder, or the original data"
                )
            return
        self.claim()
        atomic_write_json(path, data)

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
        self.claim()
        atomic_write_json(self.record_path(cell), full)

    def read(self, cell: Cell) -> dict[str, Any]:
        """The record of a finished cell (``ValueError`` naming the file when it is damaged)."""
        return _record(self.record_path(cell))

    def checkpoint_dir(self, task: str, split: int, model: str) -> Path:
        """Folder of the fine-tuned checkpoint of (task, split, model) under this configuration."""
        slug = re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name or model)
        return self.root / "checkpoints" / task / f"split{split}" / f"{slug}-{self.fingerprint}"


def iter_records(root: str | Path) -> Iterator[dict[str, Any]]:
    """Every record under ``root/records`` (sorted by path).

    Raises:
        ValueError: A damaged record (the message names the file).
    """
    for path in sorted((Path(root) / "records").rglob("*.json")):
        yield _record(path)


def _record(path: Path) -> dict[str, Any]:
    record = read_json(path, "result record")
    if not isinstance(record, dict):
        raise ValueError(f"result record {path} is damaged (not a JSON object): delete it")
    return record


def _digest(data: Any) -> str:
    return str(data.get("sha256", "?"))[:16] if isinstance(data, dict) else "?"


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
