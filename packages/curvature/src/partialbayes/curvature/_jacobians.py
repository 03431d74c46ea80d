"""Per-example gradients and logit Jacobians of linear maps from hooked activations (reverse mode for the rest)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import check_untied, in_row_order, output_passes
from partialbayes.curvature._kfac import kron_targets
from partialbayes.curvature._likelihood import (
    CurvatureOptions,
    Outputs,
    model_device,
    position_plan,
    read_batch,
    resolve_shift_labels,
)
from partialbayes.predictive.internal import eval_mode, model_logits
from partialbayes.selection import KronBlock, Subset, linear_modules
from partialbayes.selection.internal import check_subset


def example_weight_grads(x: Tensor, d: Tensor) -> Tensor:
    """Per-example weight gradients ``[B, r, c]`` from ``x`` ``[B, (T,) c]`` and ``δ`` ``[B, (T,) r]``."""
    if x.ndim == 2:
        return d[:, :, None] * x[:, None, :]
    return torch.einsum("btr,btc->brc", d, x)


def example_bias_grads(d: Tensor) -> Tensor:
    """Per-example bias gradients ``[B, r]`` from ``δ`` ``[B, (T,) r]``."""
    return d if d.ndim == 2 else d.sum(1)


def block_grads(x: Tensor, d: Tensor, bias: bool) -> Tensor:
    """Per-example gradients ``[B, r, c (+1)]`` of ``(W[R][:, C] | b[R])`` (bias column last)."""
    w = example_weight_grads(x, d)
    if not bias:
        return w
    return torch.cat([w, example_bias_grads(d)[:, :, None]], dim=-1)


def logit_jacobians(
    model: nn.Module, batch: Any, subset: Subset, *, shift_labels: bool | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Exact per-output Jacobians of the logits w.r.t. each Kronecker module's selected block.

    ``C`` backward passes per output (cotangents ``e_c``) with hooks recording ``x[:, C]`` and ``δ[:, R]``;
    for token sequences ``J = Σ_t δ_t x_tᵀ``. Outputs count and skip as in `kfac` (token-level logits: one
    per kept position). The model runs in eval mode (dropout off); every module's mode is restored.

    Args:
        model: Network returning logits ``[B, C]`` or ``[B, T, C]``.
        batch: Any batch `kfac` takes; labels only mark outputs to leave out (-100).
        subset: Kronecker-structured subset.
        shift_labels: Causal-LM convention for token-level outputs (see `kfac`).

    Returns:
        ``(logits [N, C], {module: J [N, C, r, c]})``, rows row-major; ``r = |R|``, ``c = |C|`` (``+1``, the
        bias column last, when the bias is selected), in the logical (n_out x n_in) orientation.

    Raises:
        TypeError: For a subset with mask blocks, or a batch of an unknown kind.
        ValueError: Token-level logits without an attention mask or labels.
    """
    targets = kron_targets(model, subset, "logit_jacobians")
    kmods = targets.kmods
    shift = CurvatureOptions(shift_labels=resolve_shift_labels(model, shift_labels)).shift_labels
    inputs, outputs = read_batch(
        batch, model_device(model), likelihood="classification", shift=shift
    )
    logits, keep, blocks = output_jacobians(
        model,
        inputs,
        outputs,
        targets.modules,
        targets.cols,
        targets.rows,
        lambda x, d: {m: block_grads(x[m], d[m], kmods[m].bias_name is not None) for m in kmods},
    )
    return (logits if keep is None else logits[keep]), blocks


def output_jacobians(
    model: nn.Module,
    inputs: Tensor | Mapping[str, Any],
    outputs: Outputs,
    modules: Mapping[str, nn.Module],
    cols: Mapping[str, Tensor | None],
    rows: Mapping[str, Tensor | None],
    combine: Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], dict[str, Tensor]],
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """``(logits, keep, {key: [N, K, ...]})``: ``combine(x, δ_k)`` of each logit's backward pass, stacked."""
    ps = output_passes(model, inputs, outputs, modules, cols, rows)
    parts: dict[str, list[Tensor]] = {}
    keys: list[Tensor] = []
    for pg in ps.positions:
        n_cls = len(next(iter(pg.grads.values())))
        per_class = [
            combine(ps.inputs, {m: g[k] for m, g in pg.grads.items()}) for k in range(n_cls)
        ]
        for key in per_class[0]:
            stacked = torch.stack([res[key] for res in per_class], dim=1)
            parts.setdefault(key, []).append(stacked.index_select(0, pg.examples))
        keys.append(pg.keys)
    return ps.logits, ps.keep, {key: in_row_order(keys, v) for key, v in parts.items()}


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
    """Every parameter of ``subset`` with its owning linear map (refusing any other parameter), and those maps."""
    check_subset(subset, empty_ok=False)
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
    check_untied(model, modules)
    return out, modules


def entry_grads(t: ParamTarget, x: Tensor, d: Tensor) -> Tensor:
    """Per-example gradients ``[B, k]`` of the stochastic entries of ``t`` in ``subset.gather`` order."""
    if t.role == "bias":
        return example_bias_grads(d).index_select(1, t.index)
    if t.is_kron:  # the block's rows and columns, all its entries
        x = x if t.kron_cols is None else x.index_select(-1, t.kron_cols)
        d = d if t.kron_rows is None else d.index_select(-1, t.kron_rows)
    g = example_weight_grads(x, d)
    g = (g.transpose(1, 2) if t.transposed else g).reshape(g.shape[0], -1)
    return g if t.is_kron else g.index_select(1, t.index)


def param_jacobians(
    model: nn.Module, inputs: Tensor | Mapping[str, Any], outputs: Outputs, subset: Subset
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """``(logits, keep, {param: J [N, K, k]})`` by batched reverse mode (any parameter)."""
    params = dict(model.named_parameters())
    targets = [params[n] for n in subset.names]
    with torch.enable_grad(), eval_mode(model):
        f = model_logits(model, inputs)
        keep = outputs.keep(f)
        ids = outputs.target_ids
        ids = torch.arange(f.shape[-1], device=f.device) if ids is None else ids.to(f.device)
        b, c = f.shape[0], len(ids)
        eye = f.new_zeros(b * c, b, f.shape[-1])  # row (i, k): e_{ids[k]} at example i
        rows = torch.arange(b * c, device=f.device)
        eye[rows, rows // c, ids.repeat(b)] = 1.0
        plan = position_plan(keep, b, f.device)
        parts: dict[str, list[Tensor]] = {n: [] for n in subset.names}
        keys: list[Tensor] = []
        for t, examples in plan:
            if t is None:
                cot = eye
            else:
                cot = f.new_zeros(b * c, *f.shape)
                cot[:, examples, t] = eye[:, examples]
            grads = _batched_grads(f, targets, cot)
            for name, p, g in zip(subset.names, targets, grads, strict=True):
                if g is None:
                    warnings.warn(f"logits do not depend on parameter {name!r}", stacklevel=2)
                    g = f.new_zeros(b * c, *p.shape)
                mask = subset.mask(name).to(g.device)
                jac = g.reshape(b * c, -1)[:, mask.reshape(-1)].reshape(b, c, -1)
                parts[name].append(jac.index_select(0, examples))
            keys.append(examples if t is None else examples * f.shape[1] + t)
    if not plan:  # no kept output
        return f.detach(), keep, {n: f.new_zeros(0, c, subset.num_entries(n)) for n in subset.names}
    return f.detach(), keep, {n: in_row_order(keys, v) for n, v in parts.items()}


def _batched_grads(f: Tensor, targets: Sequence[Tensor], cot: Tensor) -> tuple[Tensor | None, ...]:
    """Gradients ``[K, *p.shape]`` of ``f`` for cotangents ``[K, *f.shape]`` (``None``: unused)."""
    try:
        return torch.autograd.grad(
            f, targets, cot, is_grads_batched=True, allow_unused=True, retain_graph=True
        )
    except RuntimeError:
        pass
    rows = [torch.autograd.grad(f, targets, e, allow_unused=True, retain_graph=True) for e in cot]
    return tuple(
        torch.stack([r[i] if r[i] is not None else torch.zeros_like(t) for r in rows])
        if any(r[i] is not None for r in rows)
        else None
        for i, t in enumerate(targets)
    )


def subset_jacobians(
    model: nn.Module, inputs: Tensor | Mapping[str, Any], outputs: Outputs, subset: Subset
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """``(logits, keep, {param: J [N, K, k]})``: hooks for linear maps, else `param_jacobians`."""
    try:
        targets, modules = param_targets(model, subset)
    except ValueError:
        return param_jacobians(model, inputs, outputs, subset)
    return output_jacobians(
        model,
        inputs,
        outputs,
        modules,
        dict.fromkeys(modules),
        dict.fromkeys(modules),
        lambda x, d: {t.name: entry_grads(t, x[t.module], d[t.module]) for t in targets},
    )
