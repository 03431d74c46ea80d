"""Per-example gradients and logit Jacobians of linear maps from hooked activations (no vmap over the model).

For a linear map with inputs ``x_t`` and output gradients ``δ_t`` over the tokens ``t`` of one example, the
per-example gradient of its weight is ``Σ_t δ_t x_tᵀ`` (logical n_out x n_in orientation) and of its bias
``Σ_t δ_t``. Every token counts here (these are exact gradients); padding tokens have ``δ_t = 0`` whenever the
logits do not depend on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import Recorder, prepared
from partialbayes.curvature._likelihood import logits_of, model_device, split_batch
from partialbayes.selection import KronBlock, KronModule, Subset, linear_modules


def example_weight_grads(x: Tensor, d: Tensor) -> Tensor:
    """Per-example weight gradients ``[B, r, c]`` from ``x`` ``[B, (T,) c]`` and ``δ`` ``[B, (T,) r]``."""
    if x.ndim == 2:
        return d[:, :, None] * x[:, None, :]
    return torch.einsum("btr,btc->brc", d, x)


def example_bias_grads(d: Tensor) -> Tensor:
    """Per-example bias gradients ``[B, r]`` from ``δ`` ``[B, (T,) r]``."""
    return d if d.ndim == 2 else d.sum(1)


def block_grads(x: Tensor, d: Tensor, bias: bool) -> Tensor:
    """Per-example gradient of the block ``(W[R][:, C] | b[R])``: ``[B, r, c (+1)]``, bias column last.

    ``x`` is already gathered to ``C`` and ``δ`` to ``R``.
    """
    w = example_weight_grads(x, d)
    if not bias:
        return w
    return torch.cat([w, example_bias_grads(d)[:, :, None]], dim=-1)


def logit_jacobians(
    model: nn.Module, batch: Any, subset: Subset
) -> tuple[Tensor, dict[str, Tensor]]:
    """Exact per-example Jacobians of the logits w.r.t. each Kronecker module's selected block.

    ``C`` backward passes through the logits (one per class, cotangent ``e_c`` for every example) with
    hooks recording ``x[:, C]`` and ``δ[:, R]``; for token sequences ``J = Σ_t δ_t x_tᵀ``. The model's mode
    is left as it is (call it in eval mode).

    Args:
        model: Network returning logits ``[B, C]``.
        batch: Tensor ``x``, pair ``(x, y)`` or Hugging Face dict batch (``"labels"`` ignored).
        subset: Kronecker-structured subset.

    Returns:
        ``(logits [B, C], {module: J [B, C, r, c]})`` with ``r = |R|``, ``c = |C|`` (``+1``, the bias column
        last, when the bias is selected); rows / columns in the logical (n_out x n_in) orientation.

    Raises:
        TypeError: For a subset with mask blocks.
    """
    from partialbayes.curvature._kfac import kron_targets

    kmods = kron_targets(model, subset, "logit_jacobians")
    return class_block_grads(
        model, batch, kmods, lambda m, x, d: block_grads(x, d, kmods[m].bias_name is not None)
    )


def class_block_grads(
    model: nn.Module,
    batch: Any,
    kmods: Mapping[str, KronModule],
    combine: Callable[[str, Tensor, Tensor], Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """One forward pass with hooks and one backward pass per class, combining inputs and output gradients.

    Args:
        model: Network returning logits ``[B, C]``.
        batch: Tensor, pair or Hugging Face dict batch (``"labels"`` ignored).
        kmods: Kronecker modules to differentiate.
        combine: ``(module, x [B, (T,) |C|], δ_k [B, (T,) r]) -> [B, ...]`` per class ``k``; ``x`` is gathered
            to the selected columns, ``δ_k`` (the gradient of logit ``k``) to the selected rows.

    Returns:
        ``(logits [B, C], {module: [B, C, ...]})``: the per-class results stacked along dim 1.
    """
    named = dict(model.named_modules())
    modules = {m: named[m] for m in kmods}
    device = model_device(model)
    rows = {m: (None if k.rows is None else k.rows.to(device)) for m, k in kmods.items()}
    inputs, _, _ = split_batch(batch, device)
    with (
        prepared(model, modules, switch=False),
        Recorder(modules, {m: k.cols for m, k in kmods.items()}) as rec,
    ):
        logits = logits_of(model, inputs)
        if logits.ndim != 2:
            raise ValueError(
                f"model output must be logits of shape [B, C], got {tuple(logits.shape)}"
            )
        b, c = logits.shape
        names = list(kmods)
        missing = [m for m in names if m not in rec.calls_out]
        if missing:
            raise ValueError(f"modules {missing} were not called by the model's forward pass")
        eye = torch.eye(c, dtype=logits.dtype, device=logits.device)
        per_class: dict[str, list[Tensor]] = {m: [] for m in names}
        for k in range(c):
            # calls of a module used several times are merged as extra token positions
            grads = rec.output_grads(logits, eye[k].expand(b, c), retain_graph=k < c - 1)
            for m in names:
                d, r = grads[m], rows[m]
                if r is not None:
                    d = d.index_select(-1, r)
                per_class[m].append(combine(m, rec.inputs[m], d))
    return logits.detach(), {m: torch.stack(v, dim=1) for m, v in per_class.items()}


# ----------------------------------------------------------------------------- elementwise subsets
@dataclass(frozen=True)
class ParamTarget:
    """A parameter of the subset as the owning linear map sees it."""

    name: str
    module: str
    role: str  # "weight" | "bias"
    transposed: bool
    kron_rows: Tensor | None  # KronBlock weight fast path (logical rows / cols), else None
    kron_cols: Tensor | None
    is_kron: bool
    index: Tensor  # flat indices of the stochastic entries in storage order


def param_targets(
    model: nn.Module, subset: Subset
) -> tuple[list[ParamTarget], dict[str, nn.Module]]:
    """Map every parameter of ``subset`` to its linear map.

    Raises:
        TypeError: If ``subset`` is not a Subset.
        ValueError: A parameter that is not the weight or bias of an ``nn.Linear`` / HF ``Conv1D``.
    """
    if not isinstance(subset, Subset):
        raise TypeError(
            f"subset must be a partialbayes.selection.Subset, got {type(subset).__name__}"
        )
    if not subset.names:
        raise ValueError("subset is empty: no parameter to compute the curvature for")
    lin = linear_modules(model)
    owner = {}
    for mname in lin:
        owner[f"{mname}.weight" if mname else "weight"] = (mname, "weight")
        owner[f"{mname}.bias" if mname else "bias"] = (mname, "bias")
    device = model_device(model)
    out = []
    for n in subset.names:
        if n not in owner:
            raise ValueError(
                f"parameter {n!r} is not the weight or bias of a linear map (nn.Linear / Conv1D); "
                "diag / dense curvature are computed from linear-map hooks"
            )
        mname, role = owner[n]
        blk = subset.block(n)
        kron = blk if isinstance(blk, KronBlock) and role == "weight" else None
        out.append(
            ParamTarget(
                name=n,
                module=mname,
                role=role,
                transposed=subset.transposed(n),
                kron_rows=None if kron is None or kron.rows is None else kron.rows.to(device),
                kron_cols=None if kron is None or kron.cols is None else kron.cols.to(device),
                is_kron=kron is not None,
                index=subset.mask(n).reshape(-1).nonzero().squeeze(1).to(device),
            )
        )
    modules = {t.module: lin[t.module] for t in out}
    return out, modules


def entry_grads(t: ParamTarget, x: Tensor, d: Tensor) -> Tensor:
    """Per-example gradients ``[B, k]`` of the stochastic entries of ``t`` in ``subset.gather`` order."""
    if t.role == "bias":
        return example_bias_grads(d).index_select(1, t.index)
    if t.is_kron:
        xs = x if t.kron_cols is None else x.index_select(-1, t.kron_cols)
        ds = d if t.kron_rows is None else d.index_select(-1, t.kron_rows)
        g = example_weight_grads(xs, ds)
        if t.transposed:
            g = g.transpose(1, 2)
        return g.reshape(g.shape[0], -1)
    g = example_weight_grads(x, d)
    if t.transposed:
        g = g.transpose(1, 2)
    return g.reshape(g.shape[0], -1).index_select(1, t.index)
