"""Posterior files: one safetensors file per posterior, one JSON metadata entry, never pickle.

Every family writes and reads through these two functions (tensors on the CPU; metadata ``"partialbayes"``
with ``format``, ``version``, the model's ``structure`` and the family's fields); they import safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive._validate import check_choice

KEY = "partialbayes"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
}


def model_structure(model: nn.Module) -> list[list[Any]]:
    """``[[name, shape], ...]`` of every parameter of ``model``, in ``named_parameters`` order."""
    return [[n, list(p.shape)] for n, p in model.named_parameters()]


def write_posterior_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    *,
    model: nn.Module,
) -> Path:
    """Write ``tensors`` (to CPU, contiguous, unshared) and ``meta`` (with ``format``, ``version``) plus ``model``'s structure.

    Atomic: written to a temporary sibling and renamed into place; a missing parent folder is created.
    """
    from safetensors.torch import save_file

    target = Path(path)
    if target.is_dir():
        raise ValueError(
            f"cannot save a posterior to {os.fspath(path)!r}: it is a folder; give a file path such as "
            f"{os.fspath(target / 'posterior.safetensors')!r}"
        )
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for k, t in tensors.items():  # the families' own tensors: not re-checked
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    header = json.dumps({**meta, "structure": model_structure(model)})
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_file(out, tmp, metadata={KEY: header})
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


class PosteriorFile:
    """A checked posterior file: ``meta`` and its (finite) CPU ``tensors``; accessors' errors name the file."""

    def __init__(self, path: str, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Internal: use `read_posterior_file`."""
        self.path, self.meta, self.tensors = path, meta, tensors

    def error(self, what: str) -> ValueError:
        """A ``ValueError`` about this file: ``"'<path>': <what>"``."""
        return ValueError(f"{self.path!r}: {what}")

    @contextlib.contextmanager
    def reraised(self, what: str) -> Iterator[None]:
        """Re-raise a ``TypeError`` / ``ValueError`` of the body as `error` ``"{what}: {message}"``."""
        try:
            yield
        except (TypeError, ValueError) as err:
            raise self.error(f"{what}: {err}") from err

    def field(self, key: str, kinds: type | tuple[type, ...]) -> Any:
        """Metadata field ``key``, checked to be of ``kinds`` (a bool is not an int unless asked)."""
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if key not in self.meta:
            raise self.error(f"the posterior metadata has no {key!r} field")
        value = self.meta[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise self.error(
                f"metadata field {key!r} has the wrong type ({type(value).__name__}; expected "
                f"{' or '.join(k.__name__ for k in kinds)})"
            )
        return value

    def dtype(self, key: str = "dtype") -> torch.dtype:
        """A floating dtype stored by name (``"float32"`` or ``"torch.float32"``) under ``key``."""
        name = self.field(key, str).removeprefix("torch.")
        with self.reraised("unsupported dtype"):
            return _DTYPES[check_choice(f"field {key!r}", name, _DTYPES)]

    def tensor(self, key: str, shape: Sequence[int] | None = None) -> Tensor:
        """Tensor ``key``, checked to be present (and of ``shape`` when given)."""
        if key not in self.tensors:
            raise self.error(
                f"tensor {key!r} is missing (the file is incomplete or was not written by partialbayes)"
            )
        t = self.tensors[key]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise self.error(f"tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model whose parameter names or shapes differ from the saved ones (first few named)."""
        saved = {n: tuple(s) for n, s in self.meta["structure"]}
        here = {n: tuple(s) for n, s in model_structure(model)}
        if saved == here:
            return
        missing = sorted(set(saved) - set(here))[:3]
        extra = sorted(set(here) - set(saved))[:3]
        shapes = [
            f"{n}: saved {saved[n]}, model {here[n]}"
            for n in saved
            if here.get(n, saved[n]) != saved[n]
        ]
        raise ValueError(
            f"model {type(model).__name__} does not match the posterior saved in {self.path!r}: "
            f"missing parameters {missing}, unexpected {extra}, shape mismatches {shapes[:3]}"
        )


def read_posterior_file(
    path: str | os.PathLike[str],
    *,
    formats: str | Sequence[str],
    version: int,
    fields: Mapping[str, type | tuple[type, ...]] | None = None,
) -> PosteriorFile:
    """Read and check a posterior file of one of ``formats`` at ``version`` with the typed ``fields``.

    Raises ``FileNotFoundError`` for no file; every other fault is a ``ValueError`` naming the file.
    """
    from safetensors import SafetensorError, safe_open

    where = os.fspath(path)
    if os.path.isdir(where):
        raise ValueError(f"{where!r} is a folder, not a saved posterior file")
    try:
        with safe_open(where, framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{where!r} is not a readable safetensors file (truncated, or not a saved posterior): {err}"
        ) from err
    wanted = (formats,) if isinstance(formats, str) else tuple(formats)
    if KEY not in header:
        old = [k for k in header if k.startswith("partialbayes")]
        hint = (
            f" (it has {old[0]!r}: written by an earlier partialbayes; re-save it)" if old else ""
        )
        raise ValueError(f"{where!r} is not a saved partialbayes posterior{hint}")
    try:
        meta = json.loads(header[KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{where!r}: the posterior metadata is not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{where!r}: the posterior metadata is not a JSON object")
    file = PosteriorFile(where, meta, tensors)
    if meta.get("format") not in wanted or meta.get("version") != version:
        raise file.error(
            f"holds format {meta.get('format')!r} version {meta.get('version')!r}; expected "
            f"{' or '.join(map(repr, wanted))} version {version} (a file of an earlier partialbayes "
            "must be re-saved)"
        )
    for key, kinds in {"structure": list, **(fields or {})}.items():
        file.field(key, kinds)
    if not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], list)
        for e in meta["structure"]
    ):
        raise file.error("metadata field 'structure' is malformed")
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise file.error(f"tensor {key!r} has {bad} NaN or inf entries; the file is corrupt")
    return file
