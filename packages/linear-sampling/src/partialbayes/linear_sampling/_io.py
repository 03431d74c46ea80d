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
from safetensors import safe_open
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


def read_posterior(
    path: str | os.PathLike[str], model: nn.Module, cls: type[SampledLaplace]
) -> SampledLaplace:
    """The work of `load_sampled_laplace`: the saved posterior built as a ``cls``."""
    with safe_open(os.fspath(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(_KEY)
        meta = json.loads(raw) if raw else {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(path)} is not a saved SampledLaplace (format {FORMAT!r})")
        if meta.get("version") != VERSION:
            raise ValueError(
                f"{os.fspath(path)} has version {meta.get('version')}, this package reads {VERSION}"
            )
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    saved = {n: tuple(s) for n, s in meta["structure"]}
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
            f"model {type(model).__name__} does not match the saved SampledLaplace (fitted on "
            f"{meta['model_class']}): missing parameters {missing}, unexpected {extra}, shape "
            f"mismatches {shapes[:3]}"
        )
    subset = Subset.from_json(meta["subset"], model)
    p = next(model.parameters())
    groups = tensors.get("prior_groups")
    prior = Prior(tensors["prior_alpha"], groups)
    post = cls(
        model,
        subset,
        likelihood=meta["likelihood"],
        prior_precision=prior,
        sigma_noise=meta["sigma_noise"],
        jitter=meta["jitter"],
    )
    samples = tensors["samples"].to(device=p.device, dtype=p.dtype)
    if samples.shape[0] != subset.num_entries():
        raise ValueError(
            f"saved samples have d={samples.shape[0]}, the subset selects {subset.num_entries()} entries"
        )
    post.samples = samples
    post._map = tensors["map"].to(device=p.device, dtype=p.dtype)
    info = meta.get("info")
    post.info = (
        None if info is None else SolveInfo(info["method"], info["steps"], info["converged"])
    )
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
