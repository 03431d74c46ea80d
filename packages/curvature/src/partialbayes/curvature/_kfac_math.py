"""The KFAC statistics of one linear map: ``G = Σ_n Σ_s δ δᵀ`` (summed), ``A = Σ_n x̃ x̃ᵀ / N`` (averaged).

Token sequences first become rows (`shared_rows`): ``"reduce"`` one per sequence, ``"expand"`` one per token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shared_rows(t: Tensor, mask: Tensor | None, sharing: str, *, mean: bool) -> Tensor:
    """The rows ``[m, d]`` of ``t`` (``[B, d]`` as is, ``[B, T, d]`` by ``mask``): summed (``mean``: averaged) or one per token."""
    if mask is None:
        return t
    if sharing == "expand":
        return (t * mask[..., None]).reshape(-1, t.shape[-1])
    s = torch.einsum("btd,bt->bd", t, mask)
    return s / mask.sum(1, keepdim=True) if mean else s


def row_count(x: Tensor, mask: Tensor | None, sharing: str) -> Tensor | int:
    """How many rows `shared_rows` gives the input factor's average: examples, or unmasked tokens (expand)."""
    if mask is None or sharing == "reduce":
        return x.shape[0]
    return mask.sum()


def input_factor(xx: Tensor, xs: Tensor, count: Tensor | float, *, bias: bool) -> Tensor:
    """``A = Σ x̃x̃ᵀ / count`` from ``Σ xxᵀ`` ``[c, c]`` and ``Σ x`` ``[c]``; ``x̃ = (x, 1)`` with ``bias``."""
    n = torch.as_tensor(count, dtype=xx.dtype, device=xx.device)
    if bias:
        top = torch.cat([xx, xs[:, None]], dim=1)
        xx = torch.cat([top, torch.cat([xs, n.reshape(1)])[None]], dim=0)
    return xx / n.clamp_min(1)


def kfac_factors(
    inputs: Tensor, output_grads: Tensor, *, bias: bool = False
) -> tuple[Tensor, Tensor]:
    """``(G [n_out, n_out], A [n_in (+1), n_in (+1)])`` of inputs ``[N, n_in]`` and output gradients ``[N, n_out]``."""
    if inputs.ndim != 2 or output_grads.ndim != 2 or inputs.shape[0] != output_grads.shape[0]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and output_grads {tuple(output_grads.shape)} must be "
            "[N, n_in] and [N, n_out]"
        )
    A = input_factor(inputs.T @ inputs, inputs.sum(0), inputs.shape[0], bias=bias)
    return output_grads.T @ output_grads, A
