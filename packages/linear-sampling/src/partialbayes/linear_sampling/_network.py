"""Features of a linearised network: the Jacobian of the logits in chosen parameters, via torch.func.

Every labelled output is one observation, in ``partialbayes.predictive.flatten_outputs`` order; the
Jacobian products run on those only, a few columns at a time (no ``[B, T, C, k]`` block).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from partialbayes.linear_sampling._features import WORKING_BYTES, Features
from partialbayes.predictive import is_causal_lm, kept_positions
from partialbayes.predictive.internal import (
    IGNORE_INDEX,
    Batch,
    check_int,
    check_type,
    output_logits,
    prefixed,
    split_batch,
    take_inputs,
)
from partialbayes.predictive.internal import batch_size as n_examples
from partialbayes.selection import KronBlock, MaskBlock, Subset

Inputs = Tensor | Mapping[str, Any]
ParamSpec: TypeAlias = Sequence[str] | Mapping[str, Tensor | None] | Subset
OutputFn = Callable[[Any], Tensor]
Rows = tuple[Tensor, ...]


def as_subset(model: nn.Module, params: ParamSpec) -> Subset:
    """``params`` as a ``Subset`` of ``model``: names are whole parameters, ``{name: bool mask}`` masks."""
    if isinstance(params, Subset):
        return params
    if isinstance(params, Mapping):
        blocks = {n: KronBlock() if m is None else MaskBlock(m) for n, m in params.items()}
    elif isinstance(params, (list, tuple)):
        blocks = {n: KronBlock() for n in params}
    else:
        raise TypeError(
            "params must be a list of parameter names, a {name: bool mask} mapping or a "
            f"partialbayes.selection.Subset, got {type(params).__name__}"
        )
    if not blocks:
        raise ValueError("params is empty: choose at least one parameter")
    return Subset.from_model(model, blocks)


def network_parameters(model: nn.Module, params: ParamSpec) -> Tensor:
    """The chosen entries as one flat vector ``[d]``, detached: ``subset.gather`` over ``subset.names``.

    ``params``: parameter names, ``{name: bool mask}`` (storage shape) or a ``partialbayes.selection.Subset``.
    """
    subset = as_subset(model, params)
    return torch.cat([subset.gather(n, p.detach()) for n, p in subset.parameters_of(model).items()])


class _Chosen:
    """The chosen entries: names, masks, MAP values, and flat ``[d, k]`` (dtype at least float32) <-> per parameter."""

    def __init__(self, model: nn.Module, params: ParamSpec) -> None:
        subset = as_subset(model, params)
        named = subset.parameters_of(model)
        self.names = list(named)
        self.primals = tuple(p.detach() for p in named.values())
        self.masks = [subset.mask(n).to(p.device) for n, p in named.items()]
        self.sizes = [subset.num_entries(n) for n in self.names]
        self.d = sum(self.sizes)
        self.dtype = torch.promote_types(self.primals[0].dtype, torch.float32)

    def tangents(self, z: Tensor) -> tuple[Tensor, ...]:
        """``z [d, k]`` -> ``[k, *shape]`` per parameter (zeros outside the chosen entries)."""
        out = []
        for chunk, prim, mask in zip(z.split(self.sizes), self.primals, self.masks, strict=True):
            t = torch.zeros(z.shape[1], *prim.shape, dtype=prim.dtype, device=prim.device)
            t[:, mask] = chunk.T.to(prim.dtype)
            out.append(t)
        return tuple(out)

    def gather(self, grads: Sequence[Tensor]) -> Tensor:
        """``[*shape, k]`` per parameter -> ``[d, k]``."""
        parts = [g.movedim(-1, 0)[:, mask] for g, mask in zip(grads, self.masks, strict=True)]
        return torch.cat(parts, 1).T


def _columns(numel: int, k: int, dtype: torch.dtype) -> int:
    """Right-hand sides per operator call: a ``[numel, columns]`` block stays under `WORKING_BYTES`."""
    return max(1, min(k, WORKING_BYTES // max(1, numel * dtype.itemsize)))


class _Operators:
    """``J z`` and ``Jᵀ v`` (``k`` right-hand sides last) of the output in the chosen entries, on given inputs.

    Outputs keep the model's shape (``[b]`` becomes ``[b, 1]``), or ``[r, m]`` for selected ``rows``; columns
    go a few at a time so that one call's tangents of ``numel`` outputs stay under `WORKING_BYTES`.
    """

    def __init__(self, model: nn.Module, chosen: _Chosen, output_fn: OutputFn | None) -> None:
        self.model = model
        self.chosen = chosen
        self.get = output_fn or output_logits
        self.batched = {"jvp": True, "vjp": True}  # vmap over the k columns; off after a failure

    def call(self, inputs: Inputs, rows: Rows | None = None) -> Callable[..., Tensor]:
        names = self.chosen.names

        def fn(*ps: Tensor) -> Tensor:
            p = dict(zip(names, ps, strict=True))
            if isinstance(inputs, Mapping):
                out = self.get(functional_call(self.model, p, (), dict(inputs)))
            else:
                out = self.get(functional_call(self.model, p, (inputs,)))
            check_type("output_fn's result", out, Tensor, "a tensor")
            out = out.unsqueeze(1) if out.ndim == 1 else out
            return out if rows is None else out[rows]

        return fn

    def forward(self, inputs: Inputs) -> Tensor:
        with torch.no_grad():
            return self.call(inputs)(*self.chosen.primals)

    def jvp(
        self, inputs: Inputs, z: Tensor, numel: int, rows: Rows | None = None
    ) -> Iterator[Tensor]:
        """``J z`` for ``z [d, k]``, a few columns at a time: ``[*out, c]`` pieces."""
        fn, primals, chosen = self.call(inputs, rows), self.chosen.primals, self.chosen
        step = _columns(numel, z.shape[1], z.dtype)
        for start in range(0, z.shape[1], step):
            zc = z[:, start : start + step]
            # forward-mode AD has no rule for the fused attention kernels: use the math backend
            with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
                tangents, out = chosen.tangents(zc), None
                if self.batched["jvp"] and zc.shape[1] > 1:
                    try:
                        out = vmap(lambda *t: jvp(fn, primals, t)[1], out_dims=-1)(*tangents)
                    except Exception:  # data-dependent control flow (Hugging Face): loop instead
                        self.batched["jvp"] = False
                if out is None:
                    cols = [
                        jvp(fn, primals, tuple(t[j] for t in tangents))[1] for j in range(len(zc.T))
                    ]
                    out = torch.stack(cols, -1)
            yield out.to(z.dtype)

    def vjp(self, inputs: Inputs, v: Tensor, numel: int, rows: Rows | None = None) -> Tensor:
        """``Jᵀ v`` for ``v [*out, k]``: ``[d, k]``."""
        chosen, pieces = self.chosen, []
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            out, pull = vjp(self.call(inputs, rows), *chosen.primals)  # type: ignore[misc]
            step = _columns(numel, v.shape[-1], v.dtype)
            for start in range(0, v.shape[-1], step):
                vc = v[..., start : start + step].to(out.dtype)
                if self.batched["vjp"] and vc.shape[-1] > 1:
                    try:
                        pieces.append(chosen.gather(vmap(pull, in_dims=-1, out_dims=-1)(vc)))
                        continue
                    except Exception:
                        self.batched["vjp"] = False
                for j in range(vc.shape[-1]):
                    pieces.append(chosen.gather([g.unsqueeze(-1) for g in pull(vc[..., j])]))
        return torch.cat(pieces, -1).to(v.dtype)


def _kept(out: Tensor, batch: Batch, model: nn.Module) -> Rows:
    """``(example,)`` or ``(example, position)`` of every labelled output of ``out`` (``kept_positions`` rules)."""
    if out.ndim == 3:
        mask, labels = batch.attention_mask, batch.labels
        keep = kept_positions(out, attention_mask=mask, labels=labels, shift=is_causal_lm(model))
        assert keep is not None
        return keep.nonzero(as_tuple=True)
    labels = batch.labels
    if labels is None or labels.ndim != 1 or labels.is_floating_point():
        return (torch.arange(out.shape[0], device=out.device),)
    return ((labels.to(out.device) != IGNORE_INDEX).nonzero()[:, 0],)


@dataclass(frozen=True)
class _Part:
    """The outputs of one batch: its inputs and the example (and position) of each kept output."""

    inputs: Inputs
    n_examples: int
    rows: Rows  # ([n_outputs] example,) or ([n_outputs] example, [n_outputs] position)
    length: int  # T of token-level outputs, 1 for [B, m]

    def select(self, local: Tensor, m: int) -> tuple[Inputs, Rows, int]:
        """Outputs ``local``: the inputs of their examples, their rows there, the output's size."""
        uniq, inv = torch.unique(self.rows[0][local], return_inverse=True)
        rows = (inv, *(r[local] for r in self.rows[1:]))
        return take_inputs(self.inputs, uniq, self.n_examples), rows, uniq.numel() * self.length * m


def read_batches(
    ops: _Operators, batches: Iterable[Any], *, check_finite: bool = True
) -> tuple[Features, Tensor]:
    """Features over every kept output of ``batches`` (each read once) and the logits ``[n, m]`` there."""
    parts: list[_Part] = []
    logits: list[Tensor] = []
    total = 0
    device = ops.chosen.primals[0].device
    for i, batch in enumerate(batches):
        total += 1
        with prefixed(f"batch {i}"):
            b = split_batch(batch, device=device)
            n = n_examples(b.inputs)
            out = ops.forward(b.inputs)
            if out.ndim not in (2, 3):
                raise ValueError(
                    f"model output has shape {tuple(out.shape)}; expected [B, m] or token-level "
                    "[B, T, m] logits (pass output_fn to pick the logits)"
                )
            rows = _kept(out, b, ops.model)
        if logits and out.shape[-1] != logits[0].shape[-1]:
            raise ValueError(
                f"the batches disagree on the number of logits: batch {i} has {out.shape[-1]}, "
                f"the first {logits[0].shape[-1]}"
            )
        if rows[0].numel():
            length = out.shape[1] if out.ndim == 3 else 1
            parts.append(_Part(b.inputs, n, rows, length))
            logits.append(out[rows])
    skipped = total - len(parts)
    if not parts:  # none usable: no batch, or only unlabelled ones
        raise ValueError(
            f"every batch ({skipped} of {total}) has no labelled outputs (labels -100, or attention "
            "mask 0): nothing to fit"
            if total
            else "batches is empty"
        )
    if skipped:
        warnings.warn(
            f"skipped {skipped} of {total} batches with no labelled outputs", stacklevel=3
        )
    m = int(logits[0].shape[-1])
    return _features(ops, parts, m, check_finite=check_finite), torch.cat(logits)


def _features(ops: _Operators, parts: Sequence[_Part], m: int, *, check_finite: bool) -> Features:
    """Features over the outputs of ``parts`` in order (observation ``i`` is the ``i``-th kept output)."""
    chosen = ops.chosen
    sizes = torch.tensor([p.rows[0].numel() for p in parts])
    starts = (torch.cumsum(sizes, 0) - sizes).tolist()

    def pieces(idx: Tensor) -> Iterable[tuple[Tensor, Inputs, Rows, int]]:
        for part, start in zip(parts, starts, strict=True):
            sel = (idx >= start) & (idx < start + part.rows[0].numel())
            if bool(sel.any()):
                yield (sel, *part.select(idx[sel] - start, m))

    def jvp_fn(idx: Tensor, z: Tensor) -> Tensor:
        out = torch.empty(idx.shape[0], m, z.shape[1], dtype=z.dtype, device=z.device)
        for sel, inputs, rows, numel in pieces(idx):
            out[sel] = torch.cat(list(ops.jvp(inputs, z, numel, rows)), -1)
        return out

    def vjp_fn(idx: Tensor, v: Tensor) -> Tensor:
        out = torch.zeros(chosen.d, v.shape[2], dtype=v.dtype, device=v.device)
        for sel, inputs, rows, numel in pieces(idx):
            out += ops.vjp(inputs, v[sel], numel, rows)
        return out

    n = int(sizes.sum())
    device = chosen.primals[0].device
    return Features(jvp_fn, vjp_fn, n, m, chosen.d, chosen.dtype, device, check_finite=check_finite)


def loader_features(
    model: nn.Module,
    batches: Iterable[Any],
    params: ParamSpec,
    *,
    output_fn: OutputFn | None = None,
    check_finite: bool = True,
) -> Features:
    """Features ``Φ`` over every kept output of several batches (a training loader), at the current weights.

    Observation ``i`` is the ``i``-th kept output in loader order (token positions row-major). Batches keep
    their own padding length and are held on the model's device while the features live; a call touching
    several batches costs one JVP / VJP per batch touched. Batches without a labelled output are skipped
    (one warning).

    Args:
        model: The network, in eval mode.
        batches: Batches of any kind ``partialbayes.predictive.internal.split_batch`` reads (labels only decide which
            outputs count).
        params: Parameter names, ``{name: bool mask}`` or a ``Subset``.
        output_fn: Maps the model output to logits (default: ``.logits``, else the first element of a
            tuple, else the tensor).
        check_finite: Raise on non-finite Jacobian products.

    Returns:
        Operator features: ``n`` = number of kept outputs, ``m`` = number of logits, ``d`` = chosen entries.

    Raises:
        ValueError: If the model is in training mode, ``batches`` or one of them is empty (the batch is
            named), no batch has a labelled output, the batches disagree on ``m``, or token-level
            outputs come without an attention mask or labels.
    """
    if model.training:
        raise ValueError("model is in training mode: call model.eval() so that dropout is off")
    ops = _Operators(model, _Chosen(model, params), output_fn)
    return read_batches(ops, batches, check_finite=check_finite)[0]


def network_features(
    model: nn.Module,
    inputs: Any,
    params: ParamSpec,
    *,
    output_fn: OutputFn | None = None,
    check_finite: bool = True,
) -> Features:
    """Features ``Φ_n = ∂ f(x_n; θ) / ∂ θ_S`` of the network linearised at its current weights, on one batch.

    ``Φ z`` is a ``torch.func.jvp``, ``Φᵀ v`` a ``torch.func.vjp`` (``k`` columns under ``vmap`` where the
    model allows it). This is `loader_features` on one batch: same observations, arguments and errors.

    Args:
        model: The network, in eval mode (dropout would make the features random).
        inputs: One batch of any kind ``partialbayes.predictive.internal.split_batch`` reads.
        params: Parameter names, ``{name: bool mask}`` in storage shape, or a
            ``partialbayes.selection.Subset`` (the flat order: ``subset.gather`` of each parameter, in
            ``subset.names`` order).
        output_fn: Maps the model output to logits (``[b]`` becomes ``[b, 1]``).
        check_finite: Raise on non-finite Jacobian products.

    Returns:
        Operator features with ``d`` = number of chosen entries and ``m`` = number of logits.
    """
    return loader_features(model, [inputs], params, output_fn=output_fn, check_finite=check_finite)


def network_logits(
    model: nn.Module, inputs: Any, *, batch_size: int = 64, output_fn: OutputFn | None = None
) -> Tensor:
    """Logits ``[n, m]`` at the current weights, one row per observation of `network_features`, without gradients.

    ``inputs`` and ``output_fn`` as in [`network_features`][partialbayes.linear_sampling.network_features];
    ``batch_size`` examples go per forward pass.
    """
    check_int("batch_size", batch_size)
    b = split_batch(inputs, device=next(model.parameters()).device)
    get = output_fn or output_logits
    n = n_examples(b.inputs)
    outs = []
    with torch.no_grad():
        for s in range(0, n, batch_size):
            batch = take_inputs(b.inputs, torch.arange(s, min(s + batch_size, n)), n)
            out = get(model(**batch) if isinstance(batch, Mapping) else model(batch))
            outs.append(out.unsqueeze(1) if out.ndim == 1 else out)
    logits = torch.cat(outs)
    return logits[_kept(logits, b, model)]
