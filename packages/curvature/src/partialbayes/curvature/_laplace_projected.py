"""Logit Jacobians of Kronecker blocks directly in the eigenbases, ``M = Q_Gᵀ J Q_A``, without forming ``J``.

For one example with tokens ``t``, ``J_k = Σ_t δ_{k,t} x̃_tᵀ`` (``x̃ = (x[C] | 1)`` when the bias is in the
block), so ``M_k = Σ_t (Q_Gᵀ δ_{k,t}) (Q_Aᵀ x̃_t)ᵀ``: the inputs are rotated once and the output gradients
once per class. Cost per module ``B T (c² + C r² + C r c)`` instead of ``B C (T r c + r² c + r c²)`` for
rotating formed Jacobians (``T = 1`` for unshared layers: ~``min(r, c)`` times cheaper).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import Recorder, prepared
from partialbayes.curvature._likelihood import logits_of, model_device, split_batch
from partialbayes.selection import KronModule


def projected_jacobians(
    model: nn.Module,
    batch: Any,
    kmods: Mapping[str, KronModule],
    bases: Mapping[str, tuple[Tensor, Tensor]],
    dtype: torch.dtype,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(logits [B, C], {module: M [B, C, r, c]})`` with ``M = Q_Gᵀ J Q_A`` per example and class.

    Args:
        model: Network returning logits (call in eval mode).
        batch: Tensor, pair or Hugging Face dict batch.
        kmods: Kronecker modules of the subset.
        bases: ``{module: (Q_G [r, r], Q_A [c, c])}``.
        dtype: Dtype of the projection.
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
        outs = [rec.outputs[m] for m in names]
        xq = {}
        for m in names:
            x = rec.inputs[m].to(dtype)
            if kmods[m].bias_name is not None:
                x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
            xq[m] = x @ bases[m][1]  # rows (Q_Aᵀ x̃)ᵀ
        eye = torch.eye(c, dtype=logits.dtype, device=logits.device)
        per_class: dict[str, list[Tensor]] = {m: [] for m in names}
        for k in range(c):
            grads = torch.autograd.grad(
                logits, outs, eye[k].expand(b, c), retain_graph=k < c - 1, allow_unused=True
            )
            for m, o, g in zip(names, outs, grads, strict=True):
                d = torch.zeros_like(o) if g is None else g
                if rows[m] is not None:
                    d = d.index_select(-1, rows[m])
                dq = d.to(dtype) @ bases[m][0]  # rows (Q_Gᵀ δ)ᵀ
                if dq.ndim == 2:
                    per_class[m].append(dq[:, :, None] * xq[m][:, None, :])
                else:
                    per_class[m].append(torch.einsum("btr,btc->brc", dq, xq[m]))
    return logits.detach(), {m: torch.stack(v, dim=1) for m, v in per_class.items()}
