"""The KFAC factors of one linear map and their streamed accumulation.

Convention (laplace-torch): ``G`` is SUMMED over examples, ``A`` AVERAGED, so ``G ⊗ A`` approximates the
summed curvature of the block ``vec(W[R][:, C] | b[R])`` taken row-major (entry ``(i, j)`` ↔ ``i·c + j``).

The bias is either folded into ``A`` (``x̃ = (x, 1)``; ``A`` carries the weight–bias cross terms) or kept
separate: the weight block is ``G ⊗ A`` with ``A`` over the inputs only and the bias block is
``G ⊗ A_bias``. The bias's input is the constant 1, so its output-gradient factor is the weight's ``G``
(same δ, same reduce / expand treatment) and ``A_bias = [Σ 1·1 / count] = [1]`` (the average of 1 over the
counted rows: examples for ``reduce``, unmasked positions for ``expand``). "Separate" is thus the folded
approximation with the cross terms ``A[:c, c]`` (the mean input) set to zero: ``blockdiag(A, A_bias)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.curvature._distributed import all_reduce_sum
from partialbayes.curvature._kfac_math import input_factor


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
        bias: ``True`` when the bias entries of ``R`` are in the block (folded into ``A`` as its last row /
            column, or kept separate with ``A_bias``).
        n_examples: Examples (sequences) the factors were computed from.
        A_bias: ``[1, 1]`` input factor of the bias kept separate (``kfac(..., bias="separate")``): the
            bias block is ``G ⊗ A_bias`` (``A_bias = [1]``, the average of the constant input 1) and ``A``
            covers the weight inputs only; ``None`` when the bias is folded or not in the block.

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
    A_bias: Tensor | None = None

    def input_factor(self) -> Tensor:
        """The input factor of the whole block (bias column last): ``A`` folded, ``blockdiag(A, A_bias)`` separate.

        Returns:
            ``[c, c]`` with ``c = |C| (+1 with a bias)``; ``G ⊗ input_factor()`` is the block's curvature in
            ``vec(W[R][:, C] | b[R])`` order either way.
        """
        if self.A_bias is None:
            return self.A
        return torch.block_diag(self.A, self.A_bias.to(self.A))


class FactorAccumulator:
    """Running sums for one module: ``Σ δδᵀ``, ``Σ xxᵀ``, ``Σ x`` and the number of rows of ``x``.

    The bias column of ``A`` is assembled at the end from ``Σ x`` and the count, so ``x`` is never
    concatenated with ones. Buffers are created by the first batch (no zero-fill pass).
    """

    def __init__(self, r: int, c: int, dtype: torch.dtype, device: torch.device) -> None:
        self.r, self.c, self.dtype, self.device = r, c, dtype, device
        self.gg: Tensor | None = None
        self.xx: Tensor | None = None
        self.xs: Tensor | None = None
        self.count = torch.zeros((), dtype=dtype, device=device)

    def add_inputs(self, x: Tensor, count: Tensor | float) -> None:
        """Add rows ``x`` ``[m, c]`` (zero rows allowed for masked tokens) counting ``count``."""
        x = x.to(self.dtype)
        if self.xx is None or self.xs is None:
            self.xx, self.xs = x.T @ x, x.sum(0)
        else:
            self.xx.addmm_(x.T, x)
            self.xs += x.sum(0)
        self.count += count

    def add_grads(self, d: Tensor) -> None:
        """Add rows ``δ`` ``[m, r]``."""
        d = d.to(self.dtype)
        if self.gg is None:
            self.gg = d.T @ d
        else:
            self.gg.addmm_(d.T, d)

    def _sums(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(Σ δδᵀ, Σ xxᵀ, Σ x)``, zeros where no batch contributed."""
        if self.gg is None:
            self.gg = torch.zeros(self.r, self.r, dtype=self.dtype, device=self.device)
        if self.xx is None or self.xs is None:
            self.xx = torch.zeros(self.c, self.c, dtype=self.dtype, device=self.device)
            self.xs = torch.zeros(self.c, dtype=self.dtype, device=self.device)
        return self.gg, self.xx, self.xs

    def all_reduce(self) -> None:
        """Sum the running sums over ranks when ``torch.distributed`` is initialised (no-op otherwise)."""
        for t in (*self._sums(), self.count):
            all_reduce_sum(t)

    def bias_factor(self) -> Tensor:
        """``A_bias = [count / count]`` ``[1, 1]``: the separate bias's input factor (1 once any row counted)."""
        empty = self.count.new_zeros(0)
        return input_factor(empty.reshape(0, 0), empty, self.count, bias=True)

    def factors(self, bias: bool) -> tuple[Tensor, Tensor]:
        """``(G, A)``: ``G`` summed, ``A = Σ x̃x̃ᵀ / count`` with ``x̃ = (x, 1)`` when ``bias`` (`input_factor`)."""
        gg, xx, xs = self._sums()
        return gg, input_factor(xx, xs, self.count, bias=bias)
