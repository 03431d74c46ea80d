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

from partialbayes.curvature._jacobians import class_block_grads
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
    xq: dict[str, Tensor] = {}

    def combine(m: str, x: Tensor, d: Tensor) -> Tensor:
        if m not in xq:  # inputs are rotated once, output gradients once per class
            x = x.to(dtype)
            if kmods[m].bias_name is not None:
                x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
            xq[m] = x @ bases[m][1]  # rows (Q_Aᵀ x̃)ᵀ
        dq = d.to(dtype) @ bases[m][0]  # rows (Q_Gᵀ δ)ᵀ
        if dq.ndim == 2:
            return dq[:, :, None] * xq[m][:, None, :]
        return torch.einsum("btr,btc->brc", dq, xq[m])

    return class_block_grads(model, batch, kmods, combine)
