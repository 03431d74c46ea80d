"""Save / load IVON posteriors: one safetensors file with JSON metadata, written atomically, never pickle."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from partialbayes.ivon.posterior import GaussianPosterior, MultiIVON

FORMAT = "partialbayes.ivon.posterior"
VERSION = 1
_KEY = "partialbayes"  # the safetensors metadata entry that holds our JSON


def save_posterior(posterior: GaussianPosterior | MultiIVON, path: str | os.PathLike[str]) -> None:
    """Write a :class:`GaussianPosterior` or :class:`MultiIVON` to ``path`` (one ``.safetensors`` file).

    Tensors ``"<component>/mean/<name>"`` and ``"<component>/std/<name>"`` (moved to the CPU), plus JSON
    metadata naming the format, the kind, the number of components, every parameter's shape and dtype, the
    likelihood and ``sigma_noise``.
    The file is written to a temporary sibling and renamed into place, so an interrupted save never leaves
    a truncated file behind.

    Args:
        posterior: The posterior to save.
        path: Destination file.

    Raises:
        TypeError: If ``posterior`` is neither a :class:`GaussianPosterior` nor a :class:`MultiIVON`.
    """
    if isinstance(posterior, MultiIVON):
        components: tuple[GaussianPosterior, ...] = posterior.components
    elif isinstance(posterior, GaussianPosterior):
        components = (posterior,)
    else:
        raise TypeError(
            f"save_posterior: expected a GaussianPosterior or MultiIVON, got {type(posterior).__name__}"
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        # safetensors refuses tensors that share memory (components may share their tensors)
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        return t

    for k, comp in enumerate(components):
        for name, m in comp.mean.items():
            tensors[f"{k}/mean/{name}"] = own(m)
            tensors[f"{k}/std/{name}"] = own(comp.std[name])
    first = components[0]
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kind": type(posterior).__name__,
        "components": len(components),
        "parameters": [[n, list(m.shape), str(m.dtype)] for n, m in first.mean.items()],
        "likelihood": posterior.likelihood,
        "sigma_noise": posterior.sigma_noise,
    }
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={_KEY: json.dumps(meta)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_posterior(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
) -> GaussianPosterior | MultiIVON:
    """Read a posterior written by :func:`save_posterior`.

    Args:
        path: The ``.safetensors`` file.
        model: If given, every saved parameter must exist in ``model.named_parameters()`` with the saved
            shape; the tensors are then placed on that parameter's device (unless ``device`` is given).
        device: Device for the loaded tensors; default: the model's parameters' devices, else the CPU.

    Returns:
        A :class:`GaussianPosterior`, or a :class:`MultiIVON` if a mixture was saved; bound to ``model``
        when one is given (a ready ``partialbayes.predictive.Posterior``).

    Raises:
        ValueError: If the file is not an IVON posterior of a known version, or does not fit ``model``
            (the message names the parameter).
    """
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(_KEY)
        meta = json.loads(raw) if raw else {}
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"load_posterior: {path} is not an IVON posterior file (format {FORMAT!r})"
            )
        if meta.get("version") != VERSION:
            raise ValueError(
                f"load_posterior: {path} has version {meta.get('version')}, this package reads {VERSION}"
            )
        params = dict(model.named_parameters()) if model is not None else {}
        targets: dict[str, torch.device | str] = {}
        for name, shape, _dtype in meta["parameters"]:
            if model is not None:
                p = params.get(name)
                if p is None:
                    raise ValueError(
                        f"load_posterior: the model has no parameter {name!r} (saved in {path})"
                    )
                if list(p.shape) != shape:
                    raise ValueError(
                        f"load_posterior: parameter {name!r} has shape {tuple(p.shape)} in the model, "
                        f"{tuple(shape)} in {path}"
                    )
            targets[name] = (
                device if device is not None else (params[name].device if name in params else "cpu")
            )
        likelihood = meta.get("likelihood", "classification")  # files of 0.2 have none
        sigma_noise = meta.get("sigma_noise", 1.0)
        components = [
            GaussianPosterior(
                {n: f.get_tensor(f"{k}/mean/{n}").to(targets[n]) for n in targets},
                {n: f.get_tensor(f"{k}/std/{n}").to(targets[n]) for n in targets},
                model,
                likelihood=likelihood,
                sigma_noise=sigma_noise,
            )
            for k in range(int(meta["components"]))
        ]
    if meta["kind"] == "MultiIVON":
        return MultiIVON(components, model)
    return components[0]
