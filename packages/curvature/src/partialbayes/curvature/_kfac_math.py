"""Kronecker-factor algebra for one linear map."""

from __future__ import annotations

from torch import Tensor


def kfac_factors(inputs: Tensor, output_grads: Tensor) -> tuple[Tensor, Tensor]:
    """KFAC factors of one linear map from per-example inputs and output gradients.

    Convention (laplace-torch): ``G`` is summed over the N examples and ``A`` averaged, so that ``G ⊗ A``
    approximates the summed curvature of the (n_out x n_in) weight, vec taken row-major.

    Args:
        inputs: Layer inputs ``x``, shape ``[N, n_in]``.
        output_grads: Gradients ``δ`` of the per-example loss w.r.t. the layer outputs, shape ``[N, n_out]``.

    Returns:
        ``(G, A)`` with shapes ``[n_out, n_out]`` and ``[n_in, n_in]``.

    Raises:
        ValueError: If the shapes do not agree on N or are not 2-D.
    """
    if inputs.ndim != 2 or output_grads.ndim != 2 or inputs.shape[0] != output_grads.shape[0]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and output_grads {tuple(output_grads.shape)} must be [N, n_in] and [N, n_out]"
        )
    n = inputs.shape[0]
    return output_grads.T @ output_grads, inputs.T @ inputs / n
