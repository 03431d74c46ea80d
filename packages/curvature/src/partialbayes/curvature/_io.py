"""Save / load Laplace posteriors: safetensors for the tensors, JSON metadata, never pickle.

This module knows the file format, not the posterior classes: `save_posterior` reads a posterior's state
through its attributes, and `load_posterior` builds the class it is given (``LaplaceBase.load`` passes
``cls``), so the classes import this module and never the other way round.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from partialbayes.selection import Subset

FORMAT = "partialbayes.curvature.Laplace"
VERSION = 1
_DTYPES = {"torch.float64": torch.float64, "torch.float32": torch.float32}


def _structure(model: nn.Module) -> list[list[Any]]:
    return [[n, list(p.shape)] for n, p in model.named_parameters()]


#: The posterior classes a file may hold (``meta["class"]``).
CLASS_NAMES = ("KronLaplace", "DiagLaplace", "DenseLaplace")


def _saved_class(requested: type[Any], saved: str, where: str) -> type[Any]:
    """The class to build: ``requested`` itself, or (``LaplaceBase.load``) its subclass named ``saved``."""
    if requested.__name__ == saved:
        return requested
    for sub in requested.__subclasses__():
        if sub.__name__ == saved:
            return sub
    raise ValueError(f"{where!r} holds a {saved}, not a {requested.__name__}")


def save_posterior(posterior: Any, path: str | os.PathLike[str]) -> None:
    """Write a fitted posterior to ``path`` (one ``.safetensors`` file with JSON metadata).

    Stored: the curvature representation, the MAP entries, the prior precision, the subset (JSON), the
    model's parameter structure (names and shapes) and the options needed to rebuild the posterior.
    """
    posterior._require_fit()
    tensors = {f"curv:{k}": v for k, v in posterior._curvature_state().items()}
    tensors.update({f"map:{k}": v for k, v in posterior._map.items()})
    tensors["prior_precision"] = posterior.prior_precision.detach()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    options = {"max_entries": posterior.max_entries} if hasattr(posterior, "max_entries") else {}
    if hasattr(posterior, "sharing"):
        options["sharing"] = posterior.sharing
    if hasattr(posterior, "bias"):
        options["bias"] = posterior.bias
    if hasattr(posterior, "predictive_rtol"):
        options["predictive_rtol"] = posterior.predictive_rtol
    options["shift_labels"] = posterior.shift_labels
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "class": type(posterior).__name__,
        "model_class": type(posterior.model).__name__,
        "structure": _structure(posterior.model),
        "subset": posterior.subset.to_json(),
        "modules": list(posterior.modules),
        "likelihood": posterior.likelihood,
        "fisher": posterior.fisher,
        "mc_samples": posterior.mc_samples,
        "num_classes": posterior.num_classes,
        "temperature": posterior.temperature,
        "sigma_noise": posterior.sigma_noise,
        "sigma_fit": posterior._sigma_fit,
        "dtype": str(posterior.dtype),
        "n_data": posterior.n_data,
        "n_outputs": posterior.n_outputs,
        "map_loss": posterior.map_loss,
        "options": options,
    }
    save_file(tensors, os.fspath(path), metadata={"partialbayes": json.dumps(meta)})


def _check_structure(meta: dict[str, Any], model: nn.Module) -> None:
    saved = {n: tuple(s) for n, s in meta["structure"]}
    here = {n: tuple(s) for n, s in _structure(model)}
    if saved == here:
        return
    missing = sorted(set(saved) - set(here))[:3]
    extra = sorted(set(here) - set(saved))[:3]
    shapes = [
        f"{n}: saved {saved[n]}, model {here[n]}"
        for n in saved
        if n in here and saved[n] != here[n]
    ]
    raise ValueError(
        f"model {type(model).__name__} does not match the saved posterior (fitted on "
        f"{meta['model_class']}): missing parameters {missing}, unexpected {extra}, shape mismatches "
        f"{shapes[:3]}"
    )


def _read(path: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Metadata and tensors of a posterior file; every way it can be unreadable names the file."""
    try:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get("partialbayes")
            if raw is None:
                raise ValueError(f"{path!r} is not a saved partialbayes Laplace posterior")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path!r} is not a readable safetensors file (truncated or not a saved posterior): {err}"
        ) from err
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!r}: the posterior metadata is not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise ValueError(f"{path!r}: the posterior metadata is not a JSON object")
    return meta, tensors


_REQUIRED: dict[str, tuple[type, ...]] = {
    "class": (str,),
    "model_class": (str,),
    "structure": (list,),
    "subset": (str,),
    "modules": (list,),
    "likelihood": (str,),
    "fisher": (str,),
    "mc_samples": (int,),
    "num_classes": (int, type(None)),
    "temperature": (int, float),
    "sigma_noise": (int, float),
    "sigma_fit": (int, float),
    "dtype": (str,),
    "n_data": (int,),
    "n_outputs": (int,),
    "map_loss": (int, float),
    "options": (dict,),
}


def _check_meta(meta: dict[str, Any], path: str) -> None:
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{path!r}: unsupported posterior file format {meta.get('format')!r} "
            f"v{meta.get('version')}"
        )
    for key, kinds in _REQUIRED.items():
        if key not in meta:
            raise ValueError(f"{path!r}: the posterior metadata has no {key!r} field")
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(
                f"{path!r}: metadata field {key!r} has the wrong type ({type(value).__name__})"
            )
    if meta["class"] not in CLASS_NAMES:
        raise ValueError(
            f"{path!r}: unknown posterior class {meta['class']!r} (known: {sorted(CLASS_NAMES)})"
        )
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{path!r}: unsupported dtype {meta['dtype']!r}")
    structure = meta["structure"]
    if not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], list)
        for e in structure
    ):
        raise ValueError(f"{path!r}: metadata field 'structure' is malformed")


def _tensor(tensors: dict[str, Tensor], key: str, path: str) -> Tensor:
    if key not in tensors:
        raise ValueError(
            f"{path!r}: tensor {key!r} is missing (the file is incomplete or was not written by "
            "save_posterior)"
        )
    return tensors[key]


def _expected_shapes(post: Any) -> dict[str, tuple[int, ...]]:
    """Shapes of the saved tensors that the posterior types below do not check when they load."""
    subset = post.subset
    out: dict[str, tuple[int, ...]] = {f"map:{n}": (subset.num_entries(n),) for n in subset.names}
    out["prior_precision"] = (len(post.modules),)
    name = type(post).__name__
    if name == "DiagLaplace":
        out.update({f"curv:{n}:diag": (subset.num_entries(n),) for n in subset.names})
    elif name == "DenseLaplace":
        p = subset.num_entries()
        out.update({"curv:eigvals": (p,), "curv:eigvecs": (p, p)})
    return out


def load_posterior(path: str | os.PathLike[str], model: nn.Module, cls: type[Any]) -> Any:
    """Load a posterior saved by `save_posterior` onto ``model`` as a ``cls``.

    For a base class (``LaplaceBase``) the posterior is built as the subclass the file names.

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: If the file is not a readable saved posterior (garbage, truncated, metadata that is
            not JSON or misses a field, a missing tensor, a tensor of the wrong shape, NaN or inf in any
            tensor: the file and the field or tensor are named), ``model``'s parameter structure
            (names and shapes) or the saved subset do not match ``model``, or the file holds another
            posterior class than ``cls``.
    """
    where = os.fspath(path)
    meta, tensors = _read(where)
    _check_meta(meta, where)
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"{where!r}: tensor {key!r} has {int((~torch.isfinite(t)).sum())} NaN or inf "
                "entries; the saved posterior is corrupt"
            )
    _check_structure(meta, model)
    subset = Subset.from_json(meta["subset"], model)
    target = _saved_class(cls, meta["class"], where)
    try:
        post = target(
            model,
            subset,
            likelihood=meta["likelihood"],
            prior_precision=_tensor(tensors, "prior_precision", where),
            temperature=meta["temperature"],
            sigma_noise=meta["sigma_noise"],
            fisher=meta["fisher"],
            mc_samples=meta["mc_samples"],
            num_classes=meta["num_classes"],
            dtype=_DTYPES[meta["dtype"]],
            **meta["options"],
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where!r}: the saved settings are invalid: {err}") from err
    if list(post.modules) != meta["modules"]:
        raise ValueError(
            f"saved modules {meta['modules']} do not match the subset's {list(post.modules)}"
        )
    for key, shape in _expected_shapes(post).items():
        got = tuple(_tensor(tensors, key, where).shape)
        if got != shape:
            raise ValueError(f"{where!r}: tensor {key!r} has shape {got}, expected {shape}")
    try:
        post._load_curvature_state({k[5:]: v for k, v in tensors.items() if k.startswith("curv:")})
    except KeyError as err:
        raise ValueError(
            f"{where!r}: tensor 'curv:{err.args[0]}' is missing (the file is incomplete or was not "
            "written by save_posterior)"
        ) from err
    except ValueError as err:
        raise ValueError(f"{where!r}: {err}") from err
    post._map = {
        n: tensors[f"map:{n}"].to(device=post.device, dtype=post.dtype) for n in subset.names
    }
    post.n_data, post.n_outputs, post.map_loss = meta["n_data"], meta["n_outputs"], meta["map_loss"]
    post._sigma_fit = meta["sigma_fit"]
    post._fitted = True
    params = dict(model.named_parameters())
    for n in subset.names:
        here = subset.gather(n, params[n].detach()).to(post.dtype)
        if not torch.allclose(here, post._map[n], rtol=1e-5, atol=1e-6):
            warnings.warn(
                f"the model's current values of {n!r} differ from the saved MAP; the posterior is centred on "
                "the saved MAP (swapped() restores the saved MAP values)",
                stacklevel=2,
            )
            break
    return post
