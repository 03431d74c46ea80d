"""The IVON posterior file format: one safetensors file, JSON metadata in its header; never pickle.

Written from and read into plain tensors and settings, so that the posterior classes use this module and not
the other way round. Reading checks every way a file can be broken and raises a ``ValueError`` naming the
file and the field or tensor at fault.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

FORMAT = "partialbayes.ivon.posterior"
VERSION = 1
KEY = "partialbayes"  # the safetensors metadata entry that holds our JSON
KINDS = ("GaussianPosterior", "MultiIVON")

#: One run's ``(mean, std)``: parameter name -> tensor in the parameter's storage shape.
Run = tuple[Mapping[str, Tensor], Mapping[str, Tensor]]


class SavedPosterior(NamedTuple):
    """What a posterior file holds, checked: the kind, every run's CPU tensors and the likelihood."""

    kind: str
    runs: list[tuple[dict[str, Tensor], dict[str, Tensor]]]
    likelihood: str
    sigma_noise: float


def write_posterior_file(
    path: str | os.PathLike[str],
    runs: Sequence[Run],
    *,
    kind: str,
    likelihood: str,
    sigma_noise: float,
) -> None:
    """Write ``runs`` to ``path`` atomically (a temporary sibling renamed into place).

    Tensors ``"<run>/mean/<name>"`` and ``"<run>/std/<name>"`` (moved to the CPU); JSON metadata naming the
    format, ``kind``, the number of runs, every parameter's name, shape and dtype (the first run's means),
    the likelihood and ``sigma_noise``.
    """
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()

    def own(t: Tensor) -> Tensor:
        # safetensors refuses tensors that share memory (the runs of a mixture may share theirs)
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        return t

    for k, (mean, std) in enumerate(runs):
        for name, m in mean.items():
            tensors[f"{k}/mean/{name}"] = own(m)
            tensors[f"{k}/std/{name}"] = own(std[name])
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "components": len(runs),
        "parameters": [[n, list(m.shape), str(m.dtype)] for n, m in runs[0][0].items()],
        "likelihood": likelihood,
        "sigma_noise": sigma_noise,
    }
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={KEY: json.dumps(meta)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(where: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Metadata and tensors of a file; every way it can be unreadable names the file."""
    try:
        with safe_open(where, framework="pt") as f:
            raw = (f.metadata() or {}).get(KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{where!r} is not a readable safetensors file (truncated or not a saved IVON posterior): "
            f"{err}"
        ) from err
    if raw is None:
        raise ValueError(f"{where!r} is not an IVON posterior file (no {KEY!r} metadata)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where!r}: the IVON posterior metadata is not valid JSON ({err})"
        ) from err
    if not isinstance(meta, dict):
        raise ValueError(f"{where!r}: the IVON posterior metadata is not a JSON object")
    return meta, tensors


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    )


def _check_meta(meta: dict[str, Any], where: str) -> list[tuple[str, list[int], str]]:
    """Check the metadata's fields; returns the ``parameters`` entries ``(name, shape, dtype)``."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where!r} is not an IVON posterior file (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{where!r} has version {meta.get('version')!r}, this package reads {VERSION}"
        )
    for key in ("kind", "components", "parameters"):
        if key not in meta:
            raise ValueError(f"{where!r}: the IVON posterior metadata has no {key!r} field")
    kind, count, params = meta["kind"], meta["components"], meta["parameters"]
    if kind not in KINDS:
        raise ValueError(f"{where!r}: metadata field 'kind' is {kind!r}, expected one of {KINDS}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"{where!r}: metadata field 'components' is {count!r}, expected an int >= 1"
        )
    if kind == "GaussianPosterior" and count != 1:
        raise ValueError(f"{where!r}: a GaussianPosterior file with {count} components")
    if not isinstance(params, list) or not params:
        raise ValueError(f"{where!r}: metadata field 'parameters' is not a non-empty list")
    for entry in params:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and _is_shape(entry[1])
            and isinstance(entry[2], str)
        ):
            raise ValueError(
                f"{where!r}: metadata field 'parameters' has a malformed entry {entry!r} "
                "(expected [name, shape, dtype])"
            )
    if len({e[0] for e in params}) != len(params):
        raise ValueError(f"{where!r}: metadata field 'parameters' names a parameter twice")
    for key, kinds in (("likelihood", (str,)), ("sigma_noise", (int, float))):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ValueError(
                f"{where!r}: metadata field {key!r} has the wrong type ({type(value).__name__})"
            )
    return [(e[0], e[1], e[2]) for e in params]


def _check_tensor(t: Tensor, key: str, shape: list[int], where: str) -> None:
    if not t.is_floating_point():
        raise ValueError(
            f"{where!r}: tensor {key!r} has dtype {t.dtype}, expected a floating dtype"
        )
    if list(t.shape) != shape:
        raise ValueError(
            f"{where!r}: tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"{where!r}: tensor {key!r} has {int((~torch.isfinite(t)).sum())} NaN or inf entries; "
            "the saved posterior is corrupt"
        )
    if "/std/" in key and bool((t < 0).any()):
        raise ValueError(f"{where!r}: tensor {key!r} has negative standard deviations")


def _check_model(model: nn.Module, params: list[tuple[str, list[int], str]], where: str) -> None:
    here = dict(model.named_parameters())
    for name, shape, _ in params:
        if name not in here:
            raise ValueError(f"{where!r}: the model has no parameter {name!r} (saved in the file)")
        if list(here[name].shape) != shape:
            raise ValueError(
                f"{where!r}: parameter {name!r} has shape {tuple(here[name].shape)} in the model, "
                f"{tuple(shape)} in the file"
            )


def read_posterior_file(
    path: str | os.PathLike[str], model: nn.Module | None = None
) -> SavedPosterior:
    """Read and check a file written by `write_posterior_file` (tensors stay on the CPU).

    Args:
        path: The ``.safetensors`` file.
        model: If given, every saved parameter must exist in it with the saved shape.

    Returns:
        The file's kind, runs, likelihood (``"classification"`` for files without one) and ``sigma_noise``.

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: Naming the file, if it is not safetensors (garbage, truncated), not an IVON posterior of
            this version, has metadata that is not JSON or lacks / mistypes a field, a tensor is missing,
            unexpected, of the wrong shape or dtype, or holds NaN or inf (or a negative standard
            deviation), or ``model`` lacks a saved parameter or has it in another shape.
    """
    where = os.fspath(path)
    meta, tensors = _read(where)
    params = _check_meta(meta, where)
    if model is not None:
        _check_model(model, params, where)
    count = meta["components"]
    expected = {
        f"{k}/{what}/{name}"
        for k in range(count)
        for what in ("mean", "std")
        for name, _, _ in params
    }
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(
            f"{where!r}: tensors {unexpected[:3]} are not named by the metadata "
            f"({count} components of {len(params)} parameters)"
        )
    runs = []
    for k in range(count):
        mean: dict[str, Tensor] = {}
        std: dict[str, Tensor] = {}
        for name, shape, dtype in params:
            for what, out in (("mean", mean), ("std", std)):
                key = f"{k}/{what}/{name}"
                if key not in tensors:
                    raise ValueError(
                        f"{where!r}: tensor {key!r} is missing (the metadata names {count} "
                        "components; the file is incomplete or was not written by save_posterior)"
                    )
                _check_tensor(tensors[key], key, shape, where)
                out[name] = tensors[key]
            if str(mean[name].dtype) != dtype:
                raise ValueError(
                    f"{where!r}: tensor '{k}/mean/{name}' has dtype {mean[name].dtype}, the metadata "
                    f"says {dtype}"
                )
        runs.append((mean, std))
    likelihood = meta.get("likelihood")  # files of 0.2 have none
    sigma_noise = meta.get("sigma_noise")
    return SavedPosterior(
        meta["kind"],
        runs,
        "classification" if likelihood is None else likelihood,
        1.0 if sigma_noise is None else float(sigma_noise),
    )
