"""The KFAC factors of one linear map and their streamed accumulation.

Convention (laplace-torch): ``G`` is SUMMED over examples, ``A`` AVERAGED, so ``G ⊗ A`` approximates the
summed curvature of the block ``vec(W[R][:, C] | b[R])`` taken row-major (entry ``(i, j)`` ↔ ``i·c + j``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.curvature._distributed import all_reduce_sum


@dataclass(frozen=True)
class ModuleFactors:
    """Kronecker factors ``G ⊗ A`` of one linear map (or its S-KFAC block).

    Attributes:
        module: Module name in the model.
        G: ``[r, r]``, ``r = |R|`` or ``n_out``: output-gradient factor, SUMMED over examples.
        A: ``[c, c]``, ``c = |C|`` or ``n_in``, ``+1`` when the bias is folded in (last index = the constant
            input 1): input factor, AVERAGED over examples (over unmasked tokens with ``sharing="expand"``).
        rows: Selected output indices ``R`` (``None`` = all).
        cols: Selected input indices ``C`` (``None`` = all).
        bias: ``True`` when the bias entries of ``R`` are folded into ``A`` as its last row / column.
        n_examples: Examples (sequences) the factors were computed from.

    The block covers ``vec(W[R][:, C] | b[R])`` row-major; for HF ``Conv1D`` the logical (n_out x n_in)
    orientation.
    """

    module: str
    G: Tensor
    A: Tensor
    rows: Tensor | None
    cols: Tensor | None
    bias: bool
    n_examples: int


class FactorAccumulator:
    """Running sums for one module: ``Σ δδᵀ``, ``Σ xxᵀ``, ``Σ x`` and the number of rows of ``x``.

    The bias column of ``A`` is assembled at the end from ``Σ x`` and the count, so ``x`` is never
    concatenated with ones.
    """

    def __init__(self, r: int, c: int, dtype: torch.dtype, device: torch.device) -> None:
        self.gg = torch.zeros(r, r, dtype=dtype, device=device)
        self.xx = torch.zeros(c, c, dtype=dtype, device=device)
        self.xs = torch.zeros(c, dtype=dtype, device=device)
        self.count = torch.zeros((), dtype=dtype, device=device)

    def add_inputs(self, x: Tensor, count: Tensor | float) -> Tensor:
        """Add rows ``x`` ``[m, c]`` (zero rows allowed for masked tokens) counting ``count``; returns ``xᵀx``."""
        x = x.to(self.xx.dtype)
        xx = x.T @ x
        self.xx += xx
        self.xs += x.sum(0)
        self.count += count
        return xx

    def add_grads(self, d: Tensor) -> Tensor:
        """Add rows ``δ`` ``[m, r]``; returns ``δᵀδ``."""
        d = d.to(self.gg.dtype)
        gg = d.T @ d
        self.gg += gg
        return gg

    def all_reduce(self) -> None:
        """Sum the running sums over ranks when ``torch.distributed`` is initialised (no-op otherwise)."""
        for t in (self.gg, self.xx, self.xs, self.count):
            all_reduce_sum(t)

    def factors(self, bias: bool) -> tuple[Tensor, Tensor]:
        """``(G, A)``: ``G`` summed, ``A = Σ x̃x̃ᵀ / count`` with ``x̃ = (x, 1)`` when ``bias``."""
        count = self.count.clamp_min(1)
        if not bias:
            return self.gg, self.xx / count
        top = torch.cat([self.xx, self.xs[:, None]], dim=1)
        bottom = torch.cat([self.xs, self.count.reshape(1)])[None]
        return self.gg, torch.cat([top, bottom], dim=0) / count
