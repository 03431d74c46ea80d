"""Results store: one JSON record per (task, split, method, size) cell, written atomically.

Layout of a results folder::

    config.json                                  the run configuration and its fingerprint
    data/<task>.json                             fingerprint of the data each task was run on
    records/<task>/split<k>/<method>/<size>.json  one record per finished cell
    checkpoints/<task>/split<k>/<model>-<fp>/    fine-tuned MAP weights (safetensors) + meta.json
    claims/<task>-split<k>.json                  while a process works on the unit (task, split): who

A cell whose record exists is finished and never recomputed; a folder holding records of another
configuration, or of a task whose data changed, is refused. ``config.json`` and ``data/<task>.json`` are
written with the first record, and a folder without records is bound to nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

# Record and checkpoint-meta fields that are wall-clock or CPU times: the only fields of two runs with the
# same settings on the same machine that may differ (everything else is bit-identical, see
# `without_timings`).
TIMING_FIELDS = frozenset(
    {"seconds", "cpu_seconds", "fit_seconds", "predict_seconds", "finetune_seconds"}
    | {"finetune_cpu_seconds", "posterior_setup_seconds", "curvature_seconds"}
)


def without_timings(obj: Any) -> Any:
    """``obj`` (any JSON value) with every :data:`TIMING_FIELDS` key removed, recursively."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMING_FIELDS}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


def read_json(path: Path, what: str = "file") -> dict[str, Any]:
    """The JSON object in ``path``; a missing, unreadable, corrupt or non-object file raises ``ValueError`` naming it."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {what} {path}: {err}") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{what} {path} is not valid JSON ({err}); it is damaged: delete or restore it"
        ) from err
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} is not a JSON object; it is damaged: delete or restore it")
    return obj


def json_text(obj: Any) -> str:
    """The JSON text every file of a results folder is written with (indented, keys sorted)."""
    return json.dumps(obj, indent=2, sort_keys=True)


def json_ready(config: Any) -> dict[str, Any]:
    """A configuration dataclass as plain JSON values (tuples become lists), for fingerprints and files."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


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


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def temp_path(path: Path) -> Path:
    """A fresh hidden sibling ``.<name>.tmp-<host>-<pid>-<token>`` of ``path``, unique across machines."""
    return path.with_name(f".{path.name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex}")


def atomic_write(path: Path, content: str | Callable[[Path], object]) -> Path:
    """Write ``path`` (its folder created) into a :func:`temp_path` sibling, then ``os.replace``; ``path``.

    The one writer of every file glue-bench stores: ``content`` is the text, or ``write(temporary path)``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            content(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class UnitBusyError(RuntimeError):
    """The unit (task, split) is claimed by another process that may still be running it."""


def owner_gone(owner: dict[str, Any]) -> bool:
    """Whether a claim's process is provably gone: on this host, with no live process of its pid."""
    if owner.get("host") != _host():
        return False  # a process of another machine cannot be checked from here
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, TypeError, ValueError, OverflowError):  # alive (another user's) or unreadable
        pass
    return False


def _owner(path: Path) -> dict[str, Any] | None:
    """The owner a claim file holds; ``None`` when there is none; unknown while it is being written."""
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        owner = None
    return owner if isinstance(owner, dict) else {"host": "?", "pid": "?", "token": "?"}


def _create(path: Path, owner: dict[str, Any]) -> bool:
    """Create ``path`` holding ``owner`` unless it exists (``O_CREAT | O_EXCL``: atomic, also on NFS)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except FileNotFoundError:  # the empty folder was just removed by a process that finished
        path.parent.mkdir(parents=True, exist_ok=True)
        return _create(path, owner)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(owner))
    return True


class ResultStore:
    """A results folder (``root``, created with the first result) bound to one configuration.

    ``config`` determines every result (model, training settings, data caps, seed); the grid (tasks,
    splits, methods) may grow between runs. A ``root`` holding records of another configuration raises
    ``ValueError``.
    """

    def __init__(self, root: str | Path, config: dict[str, Any]) -> None:
        self.root = Path(root)
        self.config = config
        self.fingerprint = fingerprint(config)
        self.failures: list[str] = []
        self._data: dict[str, dict[str, Any]] = {}
        self._check_config()

    @property
    def config_path(self) -> Path:
        """``<root>/config.json``."""
        return self.root / "config.json"

    def _stored(self, path: Path, what: str, records: Path) -> tuple[Any, bool]:
        """``(the JSON at path or None, whether a record under records binds the folder to it)``."""
        if not path.is_file():
            return None, False
        return read_json(path, what), records.is_dir() and any(records.rglob("*.json"))

    def _check_config(self) -> bool:
        """Refuse a folder whose records belong to another configuration; whether it holds this one."""
        old, binds = self._stored(self.config_path, "results configuration", self.root / "records")
        if old is None:
            return False
        if not isinstance(old.get("config", {}), dict):
            raise ValueError(
                f"results configuration {self.config_path} is damaged ('config' is not a JSON "
                "object): delete or restore it"
            )
        if old.get("fingerprint") == self.fingerprint or not binds:
            return old.get("fingerprint") == self.fingerprint
        stored = old.get("config", {})
        diff = sorted(k for k in {*stored, *self.config} if stored.get(k) != self.config.get(k))
        raise ValueError(
            f"results folder {self.root} holds results of another configuration "
            f"(fingerprint {old.get('fingerprint')} != {self.fingerprint}; differs in {diff}); "
            "use a new --results folder or the same settings"
        )

    def check_data(self, task: str, data: dict[str, Any]) -> bool:
        """Refuse to mix results of ``task`` computed on other data; ``data`` is remembered for :meth:`claim`.

        ``data``: the task's ``data_glue.data_fingerprint``. Returns whether ``data/<task>.json`` holds it
        already; another one, with records of ``task``, raises ``ValueError`` naming both digests.
        """
        path = self.root / "data" / f"{task}.json"
        old, binds = self._stored(path, "data fingerprint", self.root / "records" / task)
        if old is not None and old != data and binds:
            raise ValueError(
                f"results folder {self.root} holds {task} results computed on other data "
                f"({path}: sha256 {_digest(old)}, now {_digest(data)}); the {task} files changed: "
                "use a new --results folder, or the original data"
            )
        self._data[task] = data
        return old == data

    def claim(self) -> None:
        """Bind the folder to this configuration (and the checked data) before a result is stored.

        Checks again (another process may have bound it meanwhile), then writes ``config.json`` and
        ``data/<task>.json`` where they do not hold them yet.
        """
        if not self._check_config():
            atomic_write(
                self.config_path,
                json_text({"fingerprint": self.fingerprint, "config": self.config}),
            )
        for task, data in self._data.items():
            if not self.check_data(task, data):
                atomic_write(self.root / "data" / f"{task}.json", json_text(data))

    def record_path(self, cell: Cell) -> Path:
        """Where the record of ``cell`` lives."""
        return self.root / "records" / cell.relpath()

    def has(self, cell: Cell) -> bool:
        """Whether ``cell`` is finished."""
        return self.record_path(cell).is_file()

    def write(self, cell: Cell, record: dict[str, Any]) -> None:
        """Write the record of ``cell`` atomically (the cell's keys and the fingerprint are added)."""
        full = {**record, **dataclasses.asdict(cell), "fingerprint": self.fingerprint}
        self.claim()
        atomic_write(self.record_path(cell), json_text(full))

    def read(self, cell: Cell) -> dict[str, Any]:
        """The record of a finished cell (``ValueError`` naming the file when it is damaged)."""
        return read_json(self.record_path(cell), "result record")

    def checkpoint_dir(self, task: str, split: int, model: str) -> Path:
        """Folder of the fine-tuned checkpoint of (task, split, model) under this configuration."""
        slug = re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name or model)
        return self.root / "checkpoints" / task / f"split{split}" / f"{slug}-{self.fingerprint}"

    @contextmanager
    def unit_claim(self, task: str, split: int, take_over: bool = False) -> Iterator[None]:
        """Hold the claim of the unit (task, split) while the block runs, so no other process runs it.

        The claim, ``claims/<task>-split<k>.json`` (``O_CREAT | O_EXCL``: atomic, also on network file
        systems), is removed when the block ends; a dead owner's is taken over when provably dead (same host,
        no such pid), another host's only with ``take_over``. ``UnitBusyError`` when another process holds it,
        ``OSError`` naming the folder and host when the claims folder cannot be written.
        """
        path = self.root / "claims" / f"{task}-split{split}.json"
        me = {"host": _host(), "pid": os.getpid(), "started": time.ctime()}
        me["token"] = uuid.uuid4().hex
        made = [d for d in (self.root, path.parent) if not d.exists()]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            while not _create(path, me):
                other = _owner(path)
                if other is not None and not (take_over or owner_gone(other)):
                    raise UnitBusyError(
                        f"unit {task} split {split} is claimed by host {other.get('host')} pid "
                        f"{other.get('pid')} since {other.get('started')} ({path}): it runs there; if "
                        "that process is gone, rerun with --take-over (or delete the file)"
                    )
                if other is not None:
                    _take_over(path, other)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot claim unit {task} split {split} in the results folder {self.root} on host "
                f"{_host()}: {err.strerror or err}; every worker needs write access to the same folder",
            ) from err
        try:
            yield
        finally:
            if (_owner(path) or {}).get("token") == me["token"]:
                path.unlink(missing_ok=True)
            for folder in reversed(made):  # a refused run leaves no empty folders behind
                with suppress(OSError):
                    folder.rmdir()


def _take_over(path: Path, stale: dict[str, Any]) -> None:
    """Remove the stale claim ``path`` (if it still holds ``stale``'s token) under an ``O_EXCL`` marker."""
    marker = path.with_name(path.name + ".takeover")
    if not _create(marker, {"host": _host(), "pid": os.getpid()}):
        raise UnitBusyError(f"another process is taking over {path} (delete {marker} if none is)")
    try:
        if (_owner(path) or {}).get("token") == stale.get("token"):
            path.unlink(missing_ok=True)
    finally:
        marker.unlink(missing_ok=True)


def iter_records(root: str | Path) -> Iterator[dict[str, Any]]:
    """Every record under ``root/records`` (sorted by path); a damaged one raises ``ValueError`` naming it."""
    for path in sorted((Path(root) / "records").rglob("*.json")):
        yield read_json(path, "result record")


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


def grid_units(
    tasks: Sequence[str], splits: Sequence[int], shard: tuple[int, int] = (0, 1)
) -> list[tuple[str, int]]:
    """The (task, split) units of a grid, sorted, and of those shard ``i`` of ``n``: every n-th."""
    i, n = shard
    return sorted({(t, s) for t in tasks for s in splits})[i::n]


def unit_states(root: str | Path) -> list[dict[str, Any]]:
    """Where each (task, split) unit of a results folder stands, for ``glue-bench report``.

    Rows ``task, split, records, map`` (best / trained epochs or fine-tuning progress) and ``state``: ``running``
    (claimed), ``partial`` (a progress file, no claim) or ``done``.
    """
    root = Path(root)
    units: dict[tuple[str, int], dict[str, Any]] = {}

    def unit(task: str, split: str) -> dict[str, Any]:
        key = (task, int(split.removeprefix("split")))
        return units.setdefault(key, {"records": 0, "map": "-", "state": "done"})

    for path in (root / "records").glob("*/split*/*/*.json"):
        unit(path.parts[-4], path.parts[-3])["records"] += 1
    for path in (root / "checkpoints").glob("*/split*/*"):
        row = unit(path.parts[-3], path.parts[-2])
        if path.name.endswith(".progress.safetensors"):
            done = progress_epoch(path)
            row["map"] = f"fine-tuning: {done[0]}/{done[1]} epochs" if done else "fine-tuning"
            row["state"] = "partial"
        elif (path / "meta.json").is_file():
            meta = read_json(path / "meta.json", "checkpoint meta")
            row["map"] = f"epoch {meta.get('best_epoch')} of {len(meta.get('history', []))}"
    for path in (root / "claims").glob("*-split*.json"):
        task, _, split = path.stem.rpartition("-")
        unit(task, split)["state"] = "running"
    return [{"task": t, "split": s, **row} for (t, s), row in sorted(units.items())]


def progress_epoch(path: Path) -> tuple[int, int] | None:
    """``(finished epochs, planned epochs)`` of a fine-tuning progress file, ``None`` if unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            state = json.loads(f.metadata()["state"])
        return int(state["epoch"]), int(state["config"]["epochs"])
    except Exception:  # a report must not fail on a file being written or damaged
        return None
