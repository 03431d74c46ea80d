"""Features of a linearised network: the Jacobian of the logits in chosen parameters, via torch.func."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from partialbayes.linear_sampling._features import Features

Inputs = Tensor | Mapping[str, Tensor]
ParamSpec = Sequence[str] | Mapping[str, Tensor] | Any


def _masks(model: nn.Module, params: ParamSpec) -> dict[str, Tensor | None]:
    """Parameter name -> storage-shaped bool mask (``None``: every entry)."""
    named = dict(model.named_parameters())
    if hasattr(params, "names") and hasattr(params, "mask"):  # a selection.Subset, duck-typed
        spec: dict[str, Tensor | None] = {n: params.mask(n) for n in params.names}
    elif isinstance(params, Mapping):
        spec = dict(params)
    elif isinstance(params, (list, tuple)):
        spec = dict.fromkeys(params)
    else:
        raise TypeError(
            "params must be a list of parameter names, a {name: bool mask} mapping or a Subset, "
            f"got {type(params).__name__}"
        )
    if not spec:
        raise ValueError("params is empty: choose at least one parameter")
    out: dict[str, Tensor | None] = {}
    for name in named:  # model order
        if name not in spec:
            continue
        mask = spec[name]
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"mask of parameter {name!r} must be a bool tensor")
            if mask.shape != named[name].shape:
                raise ValueError(
                    f"mask of parameter {name!r} has shape {tuple(mask.shape)} but the parameter has "
                    f"{tuple(named[name].shape)}"
                )
            if not bool(mask.any()):
                raise ValueError(f"mask of parameter {name!r} selects no entries")
            mask = mask.to(named[name].device)
        out[name] = mask
    unknown = sorted(set(spec) - set(named))
    if unknown:
        raise ValueError(f"unknown parameter names {unknown[:5]} (not in model.named_parameters())")
    return out


def network_parameters(model: nn.Module, params: ParamSpec) -> Tensor:
    """The chosen parameter entries as one flat vector ``[d]`` (model order, row-major within a mask).

    Args:
        model: The network.
        params: Parameter names, ``{name: bool mask}`` (storage shape) or a Subset-like object with
            ``names`` and ``mask(name)``.

    Returns:
        ``[d]`` detached values.
    """
    named = dict(model.named_parameters())
    parts = [
        named[n].detach()[m] if m is not None else named[n].detach().reshape(-1)
        for n, m in _masks(model, params).items()
    ]
    return torch.cat(parts)


def _logits(out: Any) -> Tensor:
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(
            f"model output has no logits tensor (got {type(out).__name__}); pass output_fn"
        )
    return out.unsqueeze(1) if out.ndim == 1 else out


def _index(inputs: Inputs, idx: Tensor) -> Inputs:
    if isinstance(inputs, Mapping):
        return {k: v[idx] for k, v in inputs.items()}
    return inputs[idx]


def _n(inputs: Inputs) -> int:
    if isinstance(inputs, Mapping):
        sizes = {k: v.shape[0] for k, v in inputs.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"inputs disagree on the number of examples: {sizes}")
        return next(iter(sizes.values()))
    if not isinstance(inputs, Tensor):
        raise TypeError(
            f"inputs must be a tensor or a dict of tensors, got {type(inputs).__name__}"
        )
    return inputs.shape[0]


def network_features(
    model: nn.Module,
    inputs: Inputs,
    params: ParamSpec,
    *,
    output_fn: Callable[[Any], Tensor] | None = None,
    check_finite: bool = True,
) -> Features:
    """Features ``Φ_n = ∂ f(x_n; θ) / ∂ θ_S`` of the network linearised at its current weights.

    ``θ_S`` is the flat vector of the chosen entries (see
    [`network_parameters`][partialbayes.linear_sampling.network_parameters]). ``Φ z`` is a forward-mode
    ``torch.func.jvp`` and ``Φᵀ v`` a reverse-mode ``torch.func.vjp`` through
    ``torch.func.functional_call`` on the minibatch; there is no ``vmap`` over the model, so Hugging Face
    models with dict batches work. ``k`` columns cost ``k`` JVPs, or one forward and ``k`` backward passes.

    Args:
        model: The network, in eval mode (dropout would make the features random).
        inputs: ``[n, ...]`` tensor, or a dict of ``[n, ...]`` tensors passed as keyword arguments
            (a Hugging Face batch).
        params: Parameter names, ``{name: bool mask}`` in storage shape, or a Subset-like object with
            ``names`` and ``mask(name)``.
        output_fn: Maps the model output to ``[b, m]`` logits (default: ``.logits``, else the first
            element of a tuple, else the tensor; ``[b]`` becomes ``[b, 1]``).
        check_finite: Raise on non-finite Jacobian products.

    Returns:
        Operator features with ``d`` = number of chosen entries and ``m`` = number of logits.

    Raises:
        ValueError: If the model is in training mode, names are unknown or masks do not fit.
        TypeError: If ``params`` or ``inputs`` have the wrong type.
    """
    if model.training:
        raise ValueError("model is in training mode: call model.eval() so that dropout is off")
    masks = _masks(model, params)
    named = dict(model.named_parameters())
    names = list(masks)
    primals = tuple(named[nm].detach() for nm in names)
    sizes = [named[nm].numel() if (mk := masks[nm]) is None else int(mk.sum()) for nm in names]
    d = sum(sizes)
    n = _n(inputs)
    get = output_fn or _logits
    dtype, device = primals[0].dtype, primals[0].device

    def f(batch: Inputs) -> Callable[..., Tensor]:
        def call(*ps: Tensor) -> Tensor:
            p = dict(zip(names, ps, strict=True))
            if isinstance(batch, Mapping):
                return get(functional_call(model, p, (), dict(batch)))
            return get(functional_call(model, p, (batch,)))

        return call

    def unflatten(z: Tensor) -> tuple[Tensor, ...]:
        out = []
        for nm, chunk, prim in zip(names, z.split(sizes), primals, strict=True):
            mask = masks[nm]
            if mask is None:
                out.append(chunk.reshape(prim.shape).to(prim.dtype))
            else:
                t = torch.zeros_like(prim)
                t[mask] = chunk.to(prim.dtype)
                out.append(t)
        return tuple(out)

    def flatten(grads: tuple[Tensor, ...]) -> Tensor:
        return torch.cat(
            [
                g[masks[nm]] if masks[nm] is not None else g.reshape(-1)
                for nm, g in zip(names, grads, strict=True)
            ]
        )

    batched = {"jvp": True, "vjp": True}  # vmap over the k columns; switched off after a failure

    def jvp_fn(idx: Tensor, z: Tensor) -> Tensor:
        fn = f(_index(inputs, idx.to(_device(inputs))))
        # forward-mode AD has no rule for the fused attention kernels: use the math backend
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            if batched["jvp"] and z.shape[1] > 1:
                try:
                    tangents = unflatten_batched(z)
                    out = vmap(lambda *t: jvp(fn, primals, t)[1], out_dims=-1)(*tangents)
                    return out.to(z.dtype)
                except Exception:  # data-dependent control flow (Hugging Face): loop instead
                    batched["jvp"] = False
            cols = [jvp(fn, primals, unflatten(z[:, j]))[1] for j in range(z.shape[1])]
        return torch.stack(cols, -1).to(z.dtype)

    def vjp_fn(idx: Tensor, v: Tensor) -> Tensor:
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            out, pull = vjp(f(_index(inputs, idx.to(_device(inputs)))), *primals)  # type: ignore[misc]
            if batched["vjp"] and v.shape[2] > 1:
                try:
                    grads = vmap(pull, in_dims=-1, out_dims=-1)(v.to(out.dtype))
                    return flatten_batched(grads).to(v.dtype)
                except Exception:
                    batched["vjp"] = False
            cols = [flatten(pull(v[..., j].to(out.dtype))) for j in range(v.shape[2])]
        return torch.stack(cols, -1).to(v.dtype)

    def unflatten_batched(z: Tensor) -> tuple[Tensor, ...]:
        out = []
        k = z.shape[1]
        for nm, chunk, prim in zip(names, z.split(sizes), primals, strict=True):
            mask = masks[nm]
            if mask is None:
                out.append(chunk.T.reshape(k, *prim.shape).to(prim.dtype))
            else:
                t = torch.zeros(k, *prim.shape, dtype=prim.dtype, device=prim.device)
                t[:, mask] = chunk.T.to(prim.dtype)
                out.append(t)
        return tuple(out)

    def flatten_batched(grads: tuple[Tensor, ...]) -> Tensor:
        parts = []
        for nm, g in zip(names, grads, strict=True):
            g = g.movedim(-1, 0)
            parts.append(g[:, masks[nm]] if masks[nm] is not None else g.reshape(g.shape[0], -1))
        return torch.cat(parts, 1).T

    with torch.no_grad():
        first = _index(inputs, torch.arange(1, device=_device(inputs)))
        m = f(first)(*primals).shape[-1]
    return Features(jvp_fn, vjp_fn, n, m, d, dtype, device, check_finite=check_finite)


def _device(inputs: Inputs) -> torch.device:
    if isinstance(inputs, Mapping):
        return next(iter(inputs.values())).device
    return inputs.device


def network_logits(
    model: nn.Module,
    inputs: Inputs,
    *,
    batch_size: int = 64,
    output_fn: Callable[[Any], Tensor] | None = None,
) -> Tensor:
    """Logits ``[n, m]`` of the network at its current weights, in minibatches, without gradients.

    Args:
        model: The network.
        inputs: ``[n, ...]`` tensor or dict of tensors.
        batch_size: Examples per forward pass.
        output_fn: As in [`network_features`][partialbayes.linear_sampling.network_features].

    Returns:
        ``[n, m]`` logits.
    """
    get = output_fn or _logits
    n = _n(inputs)
    outs = []
    with torch.no_grad():
        for s in range(0, n, batch_size):
            idx = torch.arange(s, min(s + batch_size, n), device=_device(inputs))
            batch = _index(inputs, idx)
            out = model(**batch) if isinstance(batch, Mapping) else model(batch)
            outs.append(get(out))
    return torch.cat(outs)
