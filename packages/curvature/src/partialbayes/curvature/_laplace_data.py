"""Data plumbing of the Laplace posteriors: the training loss at the MAP, eval mode, parameter Jacobians."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._caller import user_stacklevel
from partialbayes.curvature._distributed import all_reduce_max, all_reduce_sum
from partialbayes.curvature._jacobians import (
    entry_grads,
    in_row_order,
    output_jacobians,
    param_targets,
)
from partialbayes.curvature._outputs import Outputs, position_plan
from partialbayes.predictive import model_logits
from partialbayes.selection import KronModule, Subset


class MapLoss:
    """Training loss at the MAP, accumulated from the logits of the curvature pass (a `stream` observer).

    Classification: summed cross-entropy (nats). Regression: summed squared error over all outputs. Both in
    float64, kept on the logits' device (no synchronisation per batch). Pass an instance as ``on_batch`` to
    `kfac` / `diag_curvature` / `dense_curvature`, then read `result`. It sees output rows: for token-level
    logits the kept positions, so the loss, ``n_data`` and ``n_outputs`` count positions as examples.

    Args:
        likelihood: ``"classification"`` or ``"regression"``.
    """

    def __init__(self, likelihood: str) -> None:
        self.likelihood = likelihood
        self.total: Tensor | None = None
        self.n_data = 0
        self.n_outputs = 0

    def __call__(self, index: int, logits: Tensor, labels: Tensor | None) -> None:
        """Add one batch: output rows ``logits [N, C]`` and their labels as validated by ``check_labels``.

        Raises:
            ValueError: If the batch has no labels (the training log-likelihood needs them).
        """
        if labels is None:
            raise ValueError(
                f"batch {index}: fit needs labels (the training log-likelihood at the MAP enters the "
                "marginal likelihood); the batch has none"
            )
        f = logits.detach().double()
        if self.likelihood == "classification":
            loss = nn.functional.cross_entropy(f, labels, reduction="sum")
        else:
            loss = ((f - labels.double()) ** 2).sum()
        self.total = loss if self.total is None else self.total + loss
        self.n_data += int(f.shape[0])
        self.n_outputs = int(f.shape[1])

    def result(self, device: torch.device) -> tuple[float, int, int]:
        """``(loss, n_examples, n_outputs)`` over the data seen, summed over ranks under ``torch.distributed``.

        Every rank takes part in the same two all-reduces and gets the same values, so the checks below
        fail on all ranks together.

        Raises:
            ValueError: If no example was seen, the ranks disagree on the number of outputs, or the loss is
                not finite.
        """
        total = self.total if self.total is not None else torch.zeros((), dtype=torch.float64)
        sums = torch.stack(
            [total.to(device), torch.tensor(float(self.n_data), dtype=torch.float64, device=device)]
        )
        all_reduce_sum(sums)
        # the max of C and of -C: equal on every rank iff the ranks agree
        outs = all_reduce_max(torch.tensor([self.n_outputs, -self.n_outputs], device=device))
        loss, n = float(sums[0]), round(float(sums[1]))
        n_out, neg_min = int(outs[0]), int(outs[1])
        if n == 0:
            raise ValueError("the loader holds no example: the posterior needs at least one")
        if n_out != -neg_min:
            raise ValueError(
                f"ranks disagree on the number of model outputs: between {-neg_min} and {n_out}"
            )
        if not math.isfinite(loss):
            raise ValueError(f"the training loss at the MAP is not finite ({loss})")
        return loss, n, n_out


def param_jacobians(
    model: nn.Module, inputs: Tensor | Mapping[str, Any], outputs: Outputs, subset: Subset
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """Per-output logit Jacobians w.r.t. the subset's entries, by reverse mode over all logits.

    Generic (any parameter, any mask) but costs one batched backward pass over ``B·C`` cotangents per
    output position (falling back to ``B·C`` plain backward passes when batching fails). Examples must not
    interact (eval mode, no batch statistics).

    Returns:
        ``(logits, keep, {param name: J [N, C, k]})`` (see ``output_jacobians``) with ``k`` entries in
        ``subset.gather`` order; one row per example, or per kept position (row-major) of token-level
        logits.
    """
    params = dict(model.named_parameters())
    targets = [params[n] for n in subset.names]
    with torch.enable_grad():
        f = model_logits(model, inputs)
        keep = outputs.keep(f)
        b, c = f.shape[0], f.shape[-1]
        eye = torch.eye(b * c, dtype=f.dtype, device=f.device).reshape(b * c, b, c)
        plan = position_plan(keep, b, f.device)
        parts: dict[str, list[Tensor]] = {n: [] for n in subset.names}
        keys: list[Tensor] = []
        for t, examples in plan:
            if t is None:
                cot = eye
            else:
                cot = torch.zeros((b * c, *f.shape), dtype=f.dtype, device=f.device)
                cot[:, :, t] = eye
            grads = _batched_grads(f, targets, cot)
            for name, p, g in zip(subset.names, targets, grads, strict=True):
                if g is None:
                    warnings.warn(
                        f"logits do not depend on parameter {name!r}", stacklevel=user_stacklevel()
                    )
                    g = torch.zeros((b * c, *p.shape), dtype=f.dtype, device=f.device)
                mask = subset.mask(name).to(g.device)
                jac = g.reshape(b * c, -1)[:, mask.reshape(-1)].reshape(b, c, -1)
                parts[name].append(jac.index_select(0, examples))
            keys.append(examples if t is None else examples * f.shape[1] + t)
    if not plan:
        return (
            f.detach(),
            keep,
            {
                n: torch.zeros(0, c, subset.num_entries(n), dtype=f.dtype, device=f.device)
                for n in subset.names
            },
        )
    return f.detach(), keep, {n: in_row_order(keys, v) for n, v in parts.items()}


def _batched_grads(f: Tensor, targets: Sequence[Tensor], cot: Tensor) -> tuple[Tensor | None, ...]:
    """Gradients of ``f`` w.r.t. ``targets`` for a batch of cotangents ``cot [K, *f.shape]``: ``[K, *p.shape]``.

    ``None`` where ``f`` does not depend on a target.
    """
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


def block_to_params(km: KronModule, block: Tensor) -> dict[str, Tensor]:
    """Split Kronecker block matrices ``[..., r, c]`` (bias column last) into the module's parameters.

    Returns:
        ``{weight name: [..., r·c_w], bias name: [..., r]}`` in ``subset.gather`` order (for a Conv1D the
        storage is ``n_in x n_out``, so the weight part is transposed before flattening).
    """
    cw = km.n_in if km.cols is None else int(km.cols.numel())
    w = block[..., :cw]
    if km.transposed:
        w = w.transpose(-1, -2)
    out = {km.weight_name: w.reshape(*block.shape[:-2], -1)}
    if km.bias_name is not None:
        out[km.bias_name] = block[..., cw]
    return out


def params_to_block(km: KronModule, values: Mapping[str, Tensor]) -> Tensor:
    """Inverse of `block_to_params`: ``{param: [..., k]}`` -> ``[..., r, c]``."""
    r = km.n_out if km.rows is None else int(km.rows.numel())
    cw = km.n_in if km.cols is None else int(km.cols.numel())
    w = values[km.weight_name]
    lead = w.shape[:-1]
    w = w.reshape(*lead, cw, r).transpose(-1, -2) if km.transposed else w.reshape(*lead, r, cw)
    if km.bias_name is None:
        return w
    return torch.cat([w, values[km.bias_name].unsqueeze(-1)], dim=-1)


def subset_jacobians(
    model: nn.Module, inputs: Tensor | Mapping[str, Any], outputs: Outputs, subset: Subset
) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """Per-output logit Jacobians ``{param: [N, C, k]}`` in ``subset.gather`` order.

    Subsets of weights and biases of linear maps (Kronecker or elementwise blocks) use the hooks (``C``
    backward passes per output position, per-example gradients from recorded activations); any other
    subset falls back to `param_jacobians`.

    Returns:
        ``(logits, keep, {param name: J [N, C, k]})``: one row per example, or per kept position of
        token-level logits (row-major).
    """
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
