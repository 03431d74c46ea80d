"""Saving and loading `SampledLaplace`: safetensors for the tensors, JSON metadata for the rest (no pickle).

`write_posterior` reads a posterior through its attributes and `read_posterior` builds the class it is
given, so ``_posterior`` imports this module and not the other way round (the class is imported for type
annotations only).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from partialbayes.linear_sampling._precision import Prior
from partialbayes.linear_sampling._sgd import SolveInfo
from partialbayes.selection import Subset

if TYPE_CHECKING:
    from partialbayes.linear_sampling._posterior import SampledLaplace

FORMAT = "partialbayes.linear_sampling.SampledLaplace"
VERSION = 1
_KEY = "partialbayes"


def _structure(model: nn.Module) -> list[list[Any]]:
    return [[n, list(p.shape)] for n, p in model.named_parameters()]


def write_posterior(posterior: SampledLaplace, path: str | os.PathLike[str]) -> None:
    """The work of `save_sampled_laplace`."""
    samples = posterior._require_fit()
    assert posterior._map is not None
    tensors = {
        "samples": samples.detach().cpu().contiguous(),
        "map": posterior._map.detach().cpu().contiguous(),
        "prior_alpha": posterior.prior.alpha.detach().cpu().contiguous(),
    }
    if posterior.prior.groups is not None:
        tensors["prior_groups"] = posterior.prior.groups.detach().cpu().contiguous()
    info = posterior.info
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model_class": type(posterior.model).__name__,
        "structure": _structure(posterior.model),
        "subset": posterior.subset.to_json(),
        "likelihood": posterior.likelihood,
        "sigma_noise": posterior.sigma_noise,
        "jitter": posterior.jitter,
        "info": None
        if info is None
        else {"method": info.method, "steps": info.steps, "converged": info.converged},
    }
    save_file(tensors, os.fspath(path), metadata={_KEY: json.dumps(meta)})


def _open(where: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The metadata and tensors of ``where``; a damaged file raises a ``ValueError`` naming it."""
    try:
        with safe_open(where, framework="pt") as f:
            raw = (f.metadata() or {}).get(_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{where!r} is not a readable safetensors file: {err}") from err
    if raw is None:
        raise ValueError(f"{where!r} is not a saved SampledLaplace (no {_KEY!r} metadata)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where!r}: the SampledLaplace metadata is not valid JSON ({err})"
        ) from err
    if not isinstance(meta, dict):
        raise ValueError(f"{where!r}: the SampledLaplace metadata is not a JSON object")
    return meta, tensors


def _field(meta: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in meta:
        raise ValueError(f"{where!r}: the SampledLaplace metadata has no {key!r} field")
    value = meta[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{where!r}: metadata field {key!r} is {value!r}, of the wrong type")
    return value


def _tensor(
    tensors: dict[str, torch.Tensor], key: str, where: str, ndim: int | tuple[int, ...]
) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(f"{where!r}: the file has no tensor {key!r}")
    t = tensors[key]
    if t.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(
            f"{where!r}: tensor {key!r} has shape {tuple(t.shape)}, expected {ndim} dims"
        )
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where!r}: tensor {key!r} holds NaN or inf")
    return t


def read_posterior(
    path: str | os.PathLike[str], model: nn.Module, cls: type[SampledLaplace]
) -> SampledLaplace:
    """The work of `load_sampled_laplace`: the saved posterior built as a ``cls``.

    Every way a file can be damaged (truncated, not safetensors, metadata missing or of the wrong type,
    tensors missing, of the wrong shape or not finite) raises a ``ValueError`` that names the file.
    """
    where = os.fspath(path)
    meta, tensors = _open(where)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where!r} is not a saved SampledLaplace (format {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"{where!r} has version {meta.get('version')}, this package reads {VERSION}"
        )
    structure = _field(meta, "structure", where, list)
    try:
        saved = {str(n): tuple(int(d) for d in s) for n, s in structure}
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where!r}: metadata field 'structure' is malformed ({err})") from err
    likelihood = _field(meta, "likelihood", where, str)
    sigma_noise = _field(meta, "sigma_noise", where, (int, float))
    jitter = _field(meta, "jitter", where, (int, float))
    subset_json = _field(meta, "subset", where, (dict, str))
    model_class = meta.get("model_class", "?")
    here = {n: tuple(s) for n, s in _structure(model)}
    if saved != here:
        missing = sorted(set(saved) - set(here))[:3]
        extra = sorted(set(here) - set(saved))[:3]
        shapes = [
            f"{n}: saved {saved[n]}, model {here[n]}"
            for n in saved
            if n in here and saved[n] != here[n]
        ]
        raise ValueError(
            f"model {type(model).__name__} does not match the saved SampledLaplace {where!r} (fitted "
            f"on {model_class}): missing parameters {missing}, unexpected {extra}, shape "
            f"mismatches {shapes[:3]}"
        )
    try:
        subset = Subset.from_json(subset_json, model)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{where!r}: the saved subset does not apply to the model ({err})"
        ) from err
    samples_t = _tensor(tensors, "samples", where, 2)
    map_t = _tensor(tensors, "map", where, 1)
    alpha = _tensor(tensors, "prior_alpha", where, (0, 1))
    if bool((alpha <= 0).any()):
        raise ValueError(f"{where!r}: tensor 'prior_alpha' has non-positive prior precisions")
    d = subset.num_entries()
    if samples_t.shape[0] != d or map_t.shape[0] != d:
        raise ValueError(
            f"{where!r}: saved samples have d={samples_t.shape[0]} and the MAP d={map_t.shape[0]}, "
            f"the subset selects {d} entries"
        )
    p = next(model.parameters())
    groups = tensors.get("prior_groups")
    try:
        prior = Prior(alpha, groups)
        post = cls(
            model,
            subset,
            likelihood=likelihood,
            prior_precision=prior,
            sigma_noise=sigma_noise,
            jitter=jitter,
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where!r}: the saved settings are invalid ({err})") from err
    post.samples = samples_t.to(device=p.device, dtype=p.dtype)
    post._map = map_t.to(device=p.device, dtype=p.dtype)
    info = meta.get("info")
    try:
        post.info = (
            None if info is None else SolveInfo(info["method"], info["steps"], info["converged"])
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"{where!r}: metadata field 'info' is malformed ({err})") from err
    here_map = torch.cat(
        [
            subset.gather(n, dict(model.named_parameters())[n].detach()).reshape(-1)
            for n in subset.names
        ]
    )
    if not torch.allclose(here_map.to(post._map.dtype), post._map, rtol=1e-5, atol=1e-6):
        warnings.warn(
            "the model's current values of the subset differ from the saved MAP; the linearised "
            "predictive uses the model's current weights",
            stacklevel=3,
        )
    return post
