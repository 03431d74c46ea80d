"""Saving and loading SWAG posteriors: safetensors for the tensors, JSON metadata for the rest (no pickle)."""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors.torch import save_file
from torch import nn

from partialbayes.swag._file import read_swag_file, saved_dtype
from partialbayes.swag._layout import FlatLayout
from partialbayes.swag._posterior import SWAG

_FORMAT = "partialbayes-swag"
_VERSION = 1


def save_swag(swag: SWAG, path: str | os.PathLike[str]) -> None:
    """Save ``swag`` to ``path`` (one safetensors file; JSON metadata in its header).

    The tensors are ``mean``, ``sq_mean`` and, for the low-rank variant, ``deviations`` (``(d, k)``, oldest
    column first). The metadata records the subset (``Subset.to_json``), parameter names and shapes,
    ``max_rank``, ``diagonal_only``, ``n_snapshots``, the dtype, the likelihood and ``sigma_noise``.

    Raises:
        ValueError: If no snapshot has been collected.
    """
    swag._require_snapshots(1)
    tensors = {
        "mean": swag.mean.detach().cpu().contiguous(),
        "sq_mean": swag.sq_mean.detach().cpu().contiguous(),
    }
    deviations = swag.deviations
    if deviations is not None:
        tensors["deviations"] = deviations.detach().cpu().contiguous()
    meta = {
        "format": _FORMAT,
        "version": _VERSION,
        "subset": swag.subset.to_json(),
        "names": list(swag.layout.names),
        "shapes": [list(s) for s in swag.layout.shapes],
        "num_entries": swag.num_entries,
        "max_rank": swag.max_rank,
        "diagonal_only": swag.diagonal_only,
        "n_snapshots": swag.n_snapshots,
        "dtype": str(swag.dtype).removeprefix("torch."),
        "likelihood": swag.likelihood,
        "sigma_noise": swag.sigma_noise,
    }
    save_file(tensors, os.fspath(path), metadata={"partialbayes_swag": json.dumps(meta)})


def load_swag(path: str | os.PathLike[str], model: nn.Module, subset: Any | None = None) -> SWAG:
    """Load a SWAG saved by `save_swag` onto ``model``.

    Args:
        path: The safetensors file.
        model: The model the posterior belongs to (same parameter names and shapes as when saved).
        subset: Optional ``Subset``; when given it must select exactly the saved entries. By default the saved
            subset is rebuilt with ``Subset.from_json(..., model)``.

    Returns:
        The SWAG posterior, on the model's device.

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: If the file is not a partialbayes SWAG (garbage, truncated, metadata that is not JSON
            or lacks a field, a missing tensor, a tensor of the wrong shape or with NaN / inf entries:
            the file is named), or the model or subset does not match it.
    """
    meta, tensors = read_swag_file(str(path), "partialbayes_swag")
    if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
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
    from partialbayes.selection import Subset

    try:
        saved_subset = Subset.from_json(meta["subset"], model)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: the saved subset does not fit the model: {err}") from err
    if subset is None:
        subset = saved_subset
    elif not FlatLayout.from_subset(subset).same_entries(FlatLayout.from_subset(saved_subset)):
        raise ValueError("subset does not match the saved SWAG: it selects different entries")
    swag = SWAG(
        model,
        subset,
        max_rank=meta["max_rank"],
        diagonal_only=meta["diagonal_only"],
        dtype=saved_dtype(meta),
        likelihood=meta.get("likelihood", "classification"),  # files of 0.1 have no likelihood
        sigma_noise=meta.get("sigma_noise", 1.0),
    )
    if swag.num_entries != meta["num_entries"] or tensors["mean"].shape != (swag.num_entries,):
        raise ValueError(
            f"subset does not match the saved SWAG: {swag.num_entries} entries, saved "
            f"{meta['num_entries']}"
        )
    swag._set_state(
        tensors["mean"], tensors["sq_mean"], tensors.get("deviations"), meta["n_snapshots"]
    )
    return swag
