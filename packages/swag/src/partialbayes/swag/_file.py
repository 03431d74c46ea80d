"""Reading a saved SWAG file so that every way it can be broken is a ValueError naming the file."""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

_FIELDS: dict[str, tuple[type, ...]] = {
    "subset": (str,),
    "names": (list,),
    "shapes": (list,),
    "num_entries": (int,),
    "max_rank": (int,),
    "diagonal_only": (bool,),
    "n_snapshots": (int,),
    "dtype": (str,),
}
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16}
_DTYPES["bfloat16"] = torch.bfloat16


def read_swag_file(path: str, key: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Metadata (JSON under ``key``) and tensors of a SWAG file, checked for completeness and finiteness.

    Args:
        path: The file.
        key: Name of the JSON metadata entry of the safetensors header.

    Returns:
        ``(metadata, tensors)``: every field of ``_FIELDS`` present with its type, ``dtype`` a known name,
        ``mean`` and ``sq_mean`` of shape ``(num_entries,)``, ``deviations`` ``(num_entries, k)`` with
        ``k <= min(max_rank, n_snapshots)`` (present exactly when not ``diagonal_only``), all finite.

    Raises:
        FileNotFoundError: If there is no file.
        ValueError: Naming the file, if it is not safetensors (garbage, truncated), is not a SWAG file,
            has metadata that is not JSON or lacks / mistypes a field, or a tensor is missing, of the wrong
            shape, or holds NaN or inf.
    """
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path!r} is not a readable safetensors file (truncated or not a saved SWAG): {err}"
        ) from err
    if key not in header:
        raise ValueError(f"{path!r} is not a partialbayes SWAG file (no {key} metadata)")
    try:
        meta = json.loads(header[key])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!r}: the SWAG metadata is not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{path!r}: the SWAG metadata is not a JSON object")
    for name, kinds in _FIELDS.items():
        if name not in meta:
            raise ValueError(f"{path!r}: the SWAG metadata has no {name!r} field")
        value = meta[name]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValueError(
                f"{path!r}: SWAG metadata field {name!r} has the wrong type ({type(value).__name__})"
            )
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{path!r}: unknown dtype {meta['dtype']!r} in the SWAG metadata")
    if meta["n_snapshots"] < 1 or meta["num_entries"] < 1:
        raise ValueError(
            f"{path!r}: SWAG metadata has n_snapshots={meta['n_snapshots']}, "
            f"num_entries={meta['num_entries']} (both must be >= 1)"
        )
    d = meta["num_entries"]
    expected: dict[str, tuple[int, ...] | None] = {"mean": (d,), "sq_mean": (d,)}
    if not meta["diagonal_only"]:
        expected["deviations"] = None  # (d, k), checked below
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{path!r}: tensor {name!r} is missing")
        t = tensors[name]
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{path!r}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"{path!r}: tensor {name!r} has NaN or inf entries; the saved SWAG is corrupt"
            )
    if "deviations" in expected:
        dev = tensors["deviations"]
        k_max = min(meta["max_rank"], meta["n_snapshots"])
        if dev.ndim != 2 or dev.shape[0] != d or dev.shape[1] > k_max:
            raise ValueError(
                f"{path!r}: tensor 'deviations' has shape {tuple(dev.shape)}, expected ({d}, k) with "
                f"k <= {k_max}"
            )
    return meta, tensors


def saved_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The moments' dtype recorded by `read_swag_file`'s metadata."""
    return _DTYPES[meta["dtype"]]
