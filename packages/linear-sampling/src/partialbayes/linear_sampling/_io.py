"""`SampledLaplace` files: ``partialbayes.predictive``'s posterior files with this family's fields."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from partialbayes.linear_sampling._network import network_parameters
from partialbayes.linear_sampling._precision import Prior
from partialbayes.linear_sampling._sgd import SolveInfo
from partialbayes.predictive.internal import read_posterior_file, write_posterior_file
from partialbayes.selection import Subset

if TYPE_CHECKING:
    from partialbayes.linear_sampling._posterior import SampledLaplace

FORMAT = "partialbayes.linear_sampling.SampledLaplace"
VERSION = 2
_FIELDS = {
    "subset": str,
    "likelihood": str,
    "sigma_noise": (int, float),
    "jitter": (int, float),
    "info": (dict, type(None)),
}


def write_posterior(posterior: SampledLaplace, path: str | os.PathLike[str]) -> None:
    """The work of `SampledLaplace.save`."""
    samples = posterior._require_fit()
    assert posterior._map is not None
    tensors = {"samples": samples, "map": posterior._map, "prior_alpha": posterior.prior.alpha}
    if posterior.prior.groups is not None:
        tensors["prior_groups"] = posterior.prior.groups
    info = posterior.info
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "subset": posterior.subset.to_json(),
        "likelihood": posterior.likelihood,
        "sigma_noise": posterior.sigma_noise,
        "jitter": posterior.jitter,
        "info": None
        if info is None
        else {"method": info.method, "steps": info.steps, "converged": info.converged},
    }
    write_posterior_file(path, tensors, meta, model=posterior.model)


def read_posterior(
    path: str | os.PathLike[str], model: nn.Module, cls: type[SampledLaplace], check_weights: bool
) -> SampledLaplace:
    """The work of `SampledLaplace.load`; every fault is a ``ValueError`` naming the file."""
    file = read_posterior_file(path, formats=FORMAT, version=VERSION, fields=_FIELDS)
    file.check_model(model)
    meta = file.meta
    with file.reraised("the saved subset does not apply to the model"):
        subset = Subset.from_json(meta["subset"], model)
    d = subset.num_entries()
    samples, map_t = file.tensor("samples"), file.tensor("map")
    if samples.ndim != 2 or samples.shape[0] != d or tuple(map_t.shape) != (d,):
        raise file.error(
            f"saved samples have shape {tuple(samples.shape)} and the MAP {tuple(map_t.shape)}, but "
            f"the subset selects d={d} entries"
        )
    alpha = file.tensor("prior_alpha")  # Prior refuses non-positive precisions
    with file.reraised("the saved settings are invalid"):
        post = cls(
            model,
            subset,
            likelihood=meta["likelihood"],
            prior_precision=Prior(alpha, file.tensors.get("prior_groups")),
            sigma_noise=meta["sigma_noise"],
            jitter=meta["jitter"],
        )
        info = meta["info"]
        post.info = None if info is None else SolveInfo(**info)
    here = network_parameters(model, subset)
    post.samples = samples.to(here.device, torch.promote_types(here.dtype, torch.float32))
    post._map = map_t.to(here.device, here.dtype)
    if check_weights and not torch.allclose(here, post._map, rtol=1e-5, atol=1e-6):
        raise file.error(
            "the model's current values of the subset differ from the saved MAP (by up to "
            f"{float((here - post._map).abs().max()):.3g}): the samples were drawn at other weights. "
            "Load it onto the model it was fitted on (the same checkpoint), or pass check_weights=False "
            "to use it anyway (the linearised predictive then uses the model's current weights)"
        )
    return post
