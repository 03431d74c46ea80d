"""Saving and loading SWAG posteriors as functions (`SWAG.save` / `SWAG.load` do the work; see ``_file``)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from partialbayes.swag._posterior import SWAG


def save_swag(swag: SWAG, path: str | os.PathLike[str]) -> None:
    """Save ``swag`` to ``path`` (one safetensors file; JSON metadata in its header).

    The tensors are ``mean``, ``sq_mean`` and, for the low-rank variant, ``deviations`` (``(d, k)``, oldest
    column first). The metadata records the subset (``Subset.to_json``), parameter names and shapes,
    ``max_rank``, ``diagonal_only``, ``n_snapshots``, the dtype, the likelihood and ``sigma_noise``.

    Raises:
        ValueError: If no snapshot has been collected.
    """
    swag.save(path)


def load_swag(path: str | os.PathLike[str], model: nn.Module, subset: Any | None = None) -> SWAG:
    """Load a SWAG saved by `save_swag` onto ``model``.

    Args:
        path: The safetensors file.
        model: The model the posterior belongs to (same parameter names and shapes as when saved).
        subset: Optional ``Subset``; when given it must select exactly the saved entries. By default the saved
            subset is rebuilt with ``Subset.from_json(..., model)``.

    Returns:
        The SWAG posterior, on the model's device (moments saved in half precision come back in float32).

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: If the file is not a partialbayes SWAG (garbage, truncated, metadata that is not JSON
            or lacks a field, a missing tensor, a tensor of the wrong shape or with NaN / inf entries:
            the file is named), or the model or subset does not match it.
    """
    return SWAG.load(path, model, subset)
