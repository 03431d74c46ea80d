"""Features of a linearised network: the Jacobian of the logits in chosen parameters, via torch.func.

Batches are read with ``partialbayes.predictive.split_batch`` (tensors, ``(inputs, labels)`` pairs, dicts,
``transformers.BatchEncoding``). One output per example for ``[B, C]`` logits; for token-level logits
``[B, T, C]`` every kept position (attention mask 1 and label not -100) is one output, in row-major
``(b, t)`` order (as ``partialbayes.predictive.flatten_outputs`` orders them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from partialbayes.linear_sampling._features import Features
from partialbayes.predictive import kept_positions, output_logits, split_batch

Inputs = Tensor | Mapping[str, Any]
ParamSpec = Sequence[str] | Mapping[str, Tensor] | Any
OutputFn = Callable[[Any], Tensor]


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

    For a ``partialbayes.selection.Subset`` this is the concatenation of ``subset.gather`` over
    ``subset.names``.

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


class _Chosen:
    """The chosen entries: names, masks, MAP values, and flat <-> per-parameter conversions."""

    def __init__(self, model: nn.Module, params: ParamSpec) -> None:
        self.masks = _masks(model, params)
        named = dict(model.named_parameters())
        self.names = list(self.masks)
        self.primals = tuple(named[n].detach() for n in self.names)
        self.sizes = [
            p.numel() if (mk := self.masks[n]) is None else int(mk.sum())
            for n, p in zip(self.names, self.primals, strict=True)
        ]
        self.d = sum(self.sizes)

    def unflatten(self, z: Tensor) -> tuple[Tensor, ...]:
        """``z [d]`` -> one storage-shaped tangent per parameter (zeros outside the masks)."""
        out = []
        for nm, chunk, prim in zip(self.names, z.split(self.sizes), self.primals, strict=True):
            mask = self.masks[nm]
            if mask is None:
                out.append(chunk.reshape(prim.shape).to(prim.dtype))
            else:
                t = torch.zeros_like(prim)
                t[mask] = chunk.to(prim.dtype)
                out.append(t)
        return tuple(out)

    def unflatten_batched(self, z: Tensor) -> tuple[Tensor, ...]:
        """``z [d, k]`` -> ``[k, *shape]`` tangents per parameter."""
        out = []
        k = z.shape[1]
        for nm, chunk, prim in zip(self.names, z.split(self.sizes), self.primals, strict=True):
            mask = self.masks[nm]
            if mask is None:
                out.append(chunk.T.reshape(k, *prim.shape).to(prim.dtype))
            else:
                t = torch.zeros(k, *prim.shape, dtype=prim.dtype, device=prim.device)
                t[:, mask] = chunk.T.to(prim.dtype)
                out.append(t)
        return tuple(out)

    def flatten(self, grads: Sequence[Tensor]) -> Tensor:
        """Storage-shaped gradients -> ``[d]``."""
        return torch.cat(
            [
                g[self.masks[nm]] if self.masks[nm] is not None else g.reshape(-1)
                for nm, g in zip(self.names, grads, strict=True)
            ]
        )

    def flatten_batched(self, grads: Sequence[Tensor]) -> Tensor:
        """``[*shape, k]`` gradients -> ``[d, k]``."""
        parts = []
        for nm, g in zip(self.names, grads, strict=True):
            g = g.movedim(-1, 0)
            mask = self.masks[nm]
            parts.append(g[:, mask] if mask is not None else g.reshape(g.shape[0], -1))
        return torch.cat(parts, 1).T


def _n_examples(inputs: Inputs) -> int:
    if isinstance(inputs, Tensor):
        if inputs.ndim == 0:
            raise ValueError("inputs must have a batch dimension, got a 0-d tensor")
        return int(inputs.shape[0])
    sizes = {k: int(v.shape[0]) for k, v in inputs.items() if isinstance(v, Tensor) and v.ndim > 0}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"inputs disagree on the number of examples: {sizes}")
    return next(iter(sizes.values()))


def _index(inputs: Inputs, idx: Tensor, n: int) -> Inputs:
    """Examples ``idx`` of the inputs (mapping values that are not ``[n, ...]`` tensors pass through)."""
    if isinstance(inputs, Tensor):
        return inputs[idx.to(inputs.device)]
    return {
        k: v[idx.to(v.device)] if isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == n else v
        for k, v in inputs.items()
    }


class _Operators:
    """``J z`` and ``Jᵀ v`` of the network's output in the chosen entries, on given inputs.

    Outputs keep the model's shape (``[b, m]`` or ``[b, T, m]``; a ``[b]`` output becomes ``[b, 1]``)
    with the ``k`` right-hand sides as the last dimension.
    """

    def __init__(self, model: nn.Module, chosen: _Chosen, output_fn: OutputFn | None) -> None:
        self.model = model
        self.chosen = chosen
        self.get = output_fn or output_logits
        self.batched = {"jvp": True, "vjp": True}  # vmap over the k columns; off after a failure

    def call(self, inputs: Inputs) -> Callable[..., Tensor]:
        names = self.chosen.names

        def fn(*ps: Tensor) -> Tensor:
            p = dict(zip(names, ps, strict=True))
            if isinstance(inputs, Mapping):
                out = self.get(functional_call(self.model, p, (), dict(inputs)))
            else:
                out = self.get(functional_call(self.model, p, (inputs,)))
            if not isinstance(out, Tensor):
                raise TypeError(f"output_fn must return a tensor, got {type(out).__name__}")
            return out.unsqueeze(1) if out.ndim == 1 else out

        return fn

    def forward(self, inputs: Inputs) -> Tensor:
        with torch.no_grad():
            return self.call(inputs)(*self.chosen.primals)

    def jvp(self, inputs: Inputs, z: Tensor) -> Tensor:
        """``J z`` for ``z [d, k]``: ``[*out, k]``."""
        fn, primals, chosen = self.call(inputs), self.chosen.primals, self.chosen
        # forward-mode AD has no rule for the fused attention kernels: use the math backend
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            if self.batched["jvp"] and z.shape[1] > 1:
                try:
                    tangents = chosen.unflatten_batched(z)
                    out = vmap(lambda *t: jvp(fn, primals, t)[1], out_dims=-1)(*tangents)
                    return out.to(z.dtype)
                except Exception:  # data-dependent control flow (Hugging Face): loop instead
                    self.batched["jvp"] = False
            cols = [jvp(fn, primals, chosen.unflatten(z[:, j]))[1] for j in range(z.shape[1])]
        return torch.stack(cols, -1).to(z.dtype)

    def vjp(self, inputs: Inputs, v: Tensor) -> Tensor:
        """``Jᵀ v`` for ``v [*out, k]``: ``[d, k]``."""
        chosen = self.chosen
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            out, pull = vjp(self.call(inputs), *chosen.primals)  # type: ignore[misc]
            if self.batched["vjp"] and v.shape[-1] > 1:
                try:
                    grads = vmap(pull, in_dims=-1, out_dims=-1)(v.to(out.dtype))
                    return chosen.flatten_batched(grads).to(v.dtype)
                except Exception:
                    self.batched["vjp"] = False
            cols = [chosen.flatten(pull(v[..., j].to(out.dtype))) for j in range(v.shape[-1])]
        return torch.stack(cols, -1).to(v.dtype)


@dataclass(frozen=True)
class _Part:
    """The outputs of one batch: its inputs and, for token-level outputs, the kept positions."""

    inputs: Inputs
    n_examples: int
    n_outputs: int
    example: Tensor | None  # [n_outputs] example of each output (token-level), else None
    position: Tensor | None  # [n_outputs] position of each output (token-level), else None
    length: int = 0  # T of token-level outputs


def _part(ops: _Operators, batch: Any, device: torch.device) -> tuple[_Part, int]:
    """Read one batch: its inputs on ``device``, its kept outputs, and the number of logits ``m``."""
    b = split_batch(batch, device=device)
    n = _n_examples(b.inputs)
    first = ops.forward(_index(b.inputs, torch.arange(1), n))
    if first.ndim not in (2, 3):
        raise ValueError(
            f"model output has shape {tuple(first.shape)} for one example; expected [1, m] or "
            "token-level [1, T, m] logits (pass output_fn to pick the logits)"
        )
    m = int(first.shape[-1])
    if first.ndim == 2:
        return _Part(b.inputs, n, n, None, None), m
    length = int(first.shape[1])
    shape = (n, length, 0)
    keep = kept_positions(
        torch.empty(shape, device=device), attention_mask=b.attention_mask, labels=b.labels
    )
    assert keep is not None
    example, position = keep.nonzero(as_tuple=True)
    if example.numel() == 0:
        raise ValueError("the batch has no kept token positions (attention mask 0 or labels -100)")
    return _Part(b.inputs, n, int(example.numel()), example, position, length), m


def _features(ops: _Operators, parts: Sequence[_Part], m: int, *, check_finite: bool) -> Features:
    """Features over the outputs of ``parts`` in order (observation ``i`` is the ``i``-th kept output)."""
    chosen = ops.chosen
    sizes = torch.tensor([p.n_outputs for p in parts])
    starts = (torch.cumsum(sizes, 0) - sizes).tolist()
    dtype, device = chosen.primals[0].dtype, chosen.primals[0].device

    def pieces(idx: Tensor) -> Iterable[tuple[_Part, Tensor, Tensor]]:
        for part, start in zip(parts, starts, strict=True):
            sel = (idx >= start) & (idx < start + part.n_outputs)
            if bool(sel.any()):
                yield part, sel, idx[sel] - start

    def jvp_fn(idx: Tensor, z: Tensor) -> Tensor:
        out = torch.empty(idx.shape[0], m, z.shape[1], dtype=z.dtype, device=z.device)
        for part, sel, local in pieces(idx):
            if part.example is None:
                out[sel] = ops.jvp(_index(part.inputs, local, part.n_examples), z).to(z.dtype)
            else:
                assert part.position is not None
                ex, pos = part.example[local], part.position[local]
                uniq, inv = torch.unique(ex, return_inverse=True)
                full = ops.jvp(_index(part.inputs, uniq, part.n_examples), z)  # [u, T, m, k]
                out[sel] = full[inv, pos].to(z.dtype)
        return out

    def vjp_fn(idx: Tensor, v: Tensor) -> Tensor:
        out = torch.zeros(chosen.d, v.shape[2], dtype=v.dtype, device=v.device)
        for part, sel, local in pieces(idx):
            if part.example is None:
                out += ops.vjp(_index(part.inputs, local, part.n_examples), v[sel]).to(v.dtype)
            else:
                assert part.position is not None
                ex, pos = part.example[local], part.position[local]
                uniq, inv = torch.unique(ex, return_inverse=True)
                full = torch.zeros(
                    uniq.shape[0], part.length, m, v.shape[2], dtype=v.dtype, device=v.device
                )
                full.index_put_((inv, pos), v[sel], accumulate=True)
                out += ops.vjp(_index(part.inputs, uniq, part.n_examples), full).to(v.dtype)
        return out

    n = int(sizes.sum())
    return Features(jvp_fn, vjp_fn, n, m, chosen.d, dtype, device, check_finite=check_finite)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def loader_features(
    model: nn.Module,
    batches: Iterable[Any],
    params: ParamSpec,
    *,
    output_fn: OutputFn | None = None,
    check_finite: bool = True,
) -> Features:
    """Features ``Φ`` over every output of several batches (a training loader), at the current weights.

    Observation ``i`` is the ``i``-th kept output in loader order (examples in batch order; kept token
    positions in row-major order). Each batch keeps its own padding length, so a loader built with
    Hugging Face's ``DataCollatorWithPadding`` works; the batches are read once and held (on the model's
    device) for as long as the features live. An operator call on indices spread over several batches
    costs one JVP (or VJP) per batch touched, on the touched examples only.

    Args:
        model: The network, in eval mode.
        batches: Batches of any kind ``partialbayes.predictive.split_batch`` reads (labels only decide which
            token positions count).
        params: Parameter names, ``{name: bool mask}`` or a ``Subset``.
        output_fn: Maps the model output to logits (default: ``.logits``, else the first element of a
            tuple, else the tensor).
        check_finite: Raise on non-finite Jacobian products.

    Returns:
        Operator features: ``n`` = number of kept outputs, ``m`` = number of logits, ``d`` = chosen entries.

    Raises:
        ValueError: If the model is in training mode, ``batches`` is empty, the batches disagree on ``m``, or
            token-level outputs come without an attention mask or labels.
    """
    if model.training:
        raise ValueError("model is in training mode: call model.eval() so that dropout is off")
    ops = _Operators(model, _Chosen(model, params), output_fn)
    parts, ms = [], set()
    for batch in batches:
        part, m = _part(ops, batch, _device(model))
        parts.append(part)
        ms.add(m)
    if not parts:
        raise ValueError("batches is empty")
    if len(ms) != 1:
        raise ValueError(f"the batches disagree on the number of logits: {sorted(ms)}")
    return _features(ops, parts, ms.pop(), check_finite=check_finite)


def network_features(
    model: nn.Module,
    inputs: Any,
    params: ParamSpec,
    *,
    output_fn: OutputFn | None = None,
    check_finite: bool = True,
) -> Features:
    """Features ``Φ_n = ∂ f(x_n; θ) / ∂ θ_S`` of the network linearised at its current weights.

    ``θ_S`` is the flat vector of the chosen entries (see
    [`network_parameters`][partialbayes.linear_sampling.network_parameters]). ``Φ z`` is a forward-mode
    ``torch.func.jvp`` and ``Φᵀ v`` a reverse-mode ``torch.func.vjp`` through
    ``torch.func.functional_call`` on the minibatch; there is no ``vmap`` over the model, so Hugging Face
    models with dict batches work. ``k`` columns cost ``k`` JVPs, or one forward and ``k`` backward passes.
    For several batches (a loader) use [`loader_features`][partialbayes.linear_sampling.loader_features].

    Args:
        model: The network, in eval mode (dropout would make the features random).
        inputs: One batch of any kind ``partialbayes.predictive.split_batch`` reads: a ``[n, ...]`` tensor,
            an ``(inputs, labels)`` pair, or a mapping (``dict``, ``transformers.BatchEncoding``) of
            ``[n, ...]`` tensors passed as keyword arguments (labels are not passed to the model).
            Token-level logits ``[n, T, m]`` give one observation per kept position (attention mask 1,
            label not -100).
        params: Parameter names, ``{name: bool mask}`` in storage shape, or a Subset-like object with
            ``names`` and ``mask(name)``.
        output_fn: Maps the model output to logits (default: ``.logits``, else the first element of a
            tuple, else the tensor; ``[b]`` becomes ``[b, 1]``).
        check_finite: Raise on non-finite Jacobian products.

    Returns:
        Operator features with ``d`` = number of chosen entries and ``m`` = number of logits.

    Raises:
        ValueError: If the model is in training mode, names are unknown or masks do not fit.
        TypeError: If ``params`` or ``inputs`` have the wrong type.
    """
    return loader_features(model, [inputs], params, output_fn=output_fn, check_finite=check_finite)


def network_logits(
    model: nn.Module,
    inputs: Any,
    *,
    batch_size: int = 64,
    output_fn: OutputFn | None = None,
) -> Tensor:
    """Logits ``[n, m]`` of the network at its current weights, in minibatches, without gradients.

    Args:
        model: The network.
        inputs: One batch of any kind (see [`network_features`][partialbayes.linear_sampling.network_features]).
        batch_size: Examples per forward pass.
        output_fn: As in [`network_features`][partialbayes.linear_sampling.network_features].

    Returns:
        ``[n, m]`` logits, one row per observation of `network_features` (for token-level logits the
        kept positions, in row-major order).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    b = split_batch(inputs, device=_device(model))
    get = output_fn or output_logits
    n = _n_examples(b.inputs)
    outs = []
    with torch.no_grad():
        for s in range(0, n, batch_size):
            batch = _index(b.inputs, torch.arange(s, min(s + batch_size, n)), n)
            out = model(**batch) if isinstance(batch, Mapping) else model(batch)
            logits = get(out)
            outs.append(logits.unsqueeze(1) if logits.ndim == 1 else logits)
    logits = torch.cat(outs)
    if logits.ndim == 3:
        keep = kept_positions(logits, attention_mask=b.attention_mask, labels=b.labels)
        return logits[keep]
    return logits
