"""The SWAG file format: one safetensors file, JSON metadata in its header; no pickle.

Written from and read into plain tensors and settings, so that the `SWAG` class uses this module and not the
other way round. Reading checks every way a file can be broken and raises a ValueError naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from partialbayes.selection import Subset
from partialbayes.swag._layout import FlatLayout

FORMAT = "partialbayes-swag"
VERSION = 1
KEY = "partialbayes_swag"

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
    """The moments' dtype of a loaded SWAG: the saved one, float32 for files of half-precision moments."""
    return torch.promote_types(_DTYPES[meta["dtype"]], torch.float32)


def write_swag_file(
    path: str | os.PathLike[str], tensors: dict[str, Tensor], meta: dict[str, Any]
) -> None:
    """Write ``tensors`` (moved to the cpu) and ``meta`` (with the format and version) to ``path``."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {"format": FORMAT, "version": VERSION, **meta}
    save_file(tensors, os.fspath(path), metadata={KEY: json.dumps(meta)})


def read_saved_swag(
    path: str | os.PathLike[str], model: nn.Module, subset: Any | None
) -> tuple[Any, dict[str, Any], dict[str, Tensor], int]:
    """A saved SWAG checked against ``model`` (and ``subset``), ready to build.

    Returns:
        ``(subset, settings, tensors, n_snapshots)``: the subset to use (``subset`` or the saved one rebuilt
        on ``model``), the constructor's keyword settings, the checked tensors (``mean``, ``sq_mean``,
        ``deviations`` when low-rank) and the number of snapshots.

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: See `read_swag_file`; also an unsupported format, a model whose parameters differ from
            the saved names and shapes, or a ``subset`` that selects other entries (the file is named).
    """
    meta, tensors = read_swag_file(os.fspath(path), KEY)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{path}: unsupported format {meta.get('format')!r} version {meta.get('version')!r}"
        )
    params = dict(model.named_parameters())
    if len(meta["names"]) != len(meta["shapes"]):
        raise ValueError(
            f"{path}: SWAG metadata has {len(meta['names'])} names but shapes for "
            f"{len(meta['shapes'])}"
        )
    for name, shape in zip(meta["names"], meta["shapes"], strict=True):
        if name not in params or list(params[name].shape) != shape:
            got = tuple(params[name].shape) if name in params else "missing"
            raise ValueError(
                f"model does not match the saved SWAG: parameter {name!r} was saved with shape "
                f"{tuple(shape)}, the model has {got}"
            )
    try:
        saved_subset = Subset.from_json(meta["subset"], model)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: the saved subset does not fit the model: {err}") from err
    if subset is None:
        subset = saved_subset
    elif not FlatLayout.from_subset(subset).same_entries(FlatLayout.from_subset(saved_subset)):
        raise ValueError("subset does not match the saved SWAG: it selects different entries")
    settings = {
        "max_rank": meta["max_rank"],
        "diagonal_only": meta["diagonal_only"],
        "dtype": saved_dtype(meta),
        "likelihood": meta.get("likelihood", "classification"),  # files of 0.1 have no likelihood
        "sigma_noise": meta.get("sigma_noise", 1.0),
    }
    return subset, settings, tensors, meta["n_snapshots"]
