"""The KFAC statistics of one linear map, as pure functions: the one place they are stated.

For a linear map with inputs ``x_n`` and output gradients ``δ_{n,s}`` (one per backward pass ``s`` of the
fisher type) of example ``n``, the summed curvature of its weight is approximated by ``G ⊗ A`` with

* ``G = Σ_n Σ_s δ_{n,s} δ_{n,s}ᵀ`` — SUMMED over the examples, and
* ``A = (1 / N) Σ_n x̃_n x̃_nᵀ`` — AVERAGED, ``x̃ = (x, 1)`` when the bias is folded in,

the laplace-torch convention (vec row-major). Token sequences first become rows (`shared_rows`):
``"reduce"`` sums ``δ`` and averages ``x`` over the unmasked tokens of each sequence (one row per sequence),
``"expand"`` makes every unmasked token a row. `kfac` streams batches through `shared_rows` and sums
``Σ δδᵀ``, ``Σ xxᵀ``, ``Σ x`` and the row count; `input_factor` turns the sums into ``A``. `kfac_factors`
is the same statement for data held at once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shared_rows(t: Tensor, mask: Tensor | None, sharing: str, *, mean: bool) -> Tensor:
    """The rows a token tensor contributes to a factor under weight sharing.

    Args:
        t: ``[B, d]`` (one row per example, returned as it is) or ``[B, T, d]`` tokens.
        mask: ``[B, T]`` float mask of the tokens that count (``None`` for ``[B, d]``).
        sharing: ``"reduce"``: the masked sum over tokens (``mean=True``: their mean), ``[B, d]``;
            ``"expand"``: every token a row, masked tokens zeroed, ``[B·T, d]``.
        mean: Average instead of sum under ``"reduce"`` (inputs ``x``; output gradients ``δ`` are summed).

    Returns:
        ``[m, d]`` rows.
    """
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
    """``A = Σ x̃x̃ᵀ / count`` from the sums ``Σ xxᵀ`` and ``Σ x``; ``x̃ = (x, 1)`` when ``bias``.

    Args:
        xx: ``[c, c]`` summed ``x xᵀ``.
        xs: ``[c]`` summed ``x``.
        count: Number of rows summed (``A`` is zero without any).
        bias: Fold the bias in as the constant last input: ``[[Σxxᵀ, Σx], [Σxᵀ, count]] / count``.

    Returns:
        ``[c, c]``, or ``[c + 1, c + 1]`` with the bias. The separate bias's factor ``A_bias = [1]`` is this
        with ``c = 0`` and ``bias=True``.
    """
    n = torch.as_tensor(count, dtype=xx.dtype, device=xx.device)
    if bias:
        top = torch.cat([xx, xs[:, None]], dim=1)
        xx = torch.cat([top, torch.cat([xs, n.reshape(1)])[None]], dim=0)
    return xx / n.clamp_min(1)


def kfac_factors(
    inputs: Tensor, output_grads: Tensor, *, bias: bool = False
) -> tuple[Tensor, Tensor]:
    """KFAC factors of one linear map from per-example inputs and output gradients held at once.

    Convention (laplace-torch): ``G`` is summed over the N examples and ``A`` averaged, so that ``G ⊗ A``
    approximates the summed curvature of the (n_out x n_in) weight, vec taken row-major. `kfac` computes the
    same factors streamed over a loader.

    Args:
        inputs: Layer inputs ``x``, shape ``[N, n_in]``.
        output_grads: Gradients ``δ`` of the per-example loss w.r.t. the layer outputs, shape
            ``[N, n_out]``.
        bias: Fold the bias in as a constant input 1 (``A`` gets a last row and column).

    Returns:
        ``(G, A)`` with shapes ``[n_out, n_out]`` and ``[n_in, n_in]`` (``[n_in + 1, n_in + 1]`` with ``bias``).

    Raises:
        ValueError: If the shapes do not agree on N or are not 2-D.
    """
    if inputs.ndim != 2 or output_grads.ndim != 2 or inputs.shape[0] != output_grads.shape[0]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and output_grads {tuple(output_grads.shape)} must be "
            "[N, n_in] and [N, n_out]"
        )
    A = input_factor(inputs.T @ inputs, inputs.sum(0), inputs.shape[0], bias=bias)
    return output_grads.T @ output_grads, A
