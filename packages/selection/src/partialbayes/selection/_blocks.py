"""Block types of a Subset: Kronecker-structured index blocks and elementwise masks."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _as_index(value: Tensor | Sequence[int] | None, what: str) -> Tensor | None:
    """Convert to a sorted unique int64 cpu tensor (``None`` passes through)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"KronBlock {what} must be integer indices, got dtype {value.dtype}")
        t = value.detach().to("cpu", torch.int64)
    else:
        iterable = not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")
        items = list(value) if iterable else [value]
        # only true integers (numpy ints too): 0.5 must not become 0
        bad = [v for v in items if isinstance(v, bool) or not hasattr(type(v), "__index__")]
        if bad or not iterable:
            got = f"{bad[0]!r} in {value!r}" if bad and iterable else repr(value)
            raise TypeError(f"KronBlock {what} must be a sequence of ints, got {got}")
        items = [operator.index(v) for v in items]
        t = torch.tensor(items, dtype=torch.int64)
    if t.ndim != 1 or (t.numel() and int(t.min()) < 0):
        low = int(t.min()) if t.numel() else None
        raise ValueError(
            f"KronBlock {what} must be 1-D and non-negative, got shape {tuple(t.shape)}, min {low}"
        )
    return torch.unique(t, sorted=True)


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


@dataclass(frozen=True, eq=False)
class KronBlock:
    """Kronecker-structured block: the entries ``rows x cols`` of a parameter (``None``: all).

    For a linear map's weight ``rows`` index outputs and ``cols`` inputs in the logical (n_out x n_in)
    orientation, also for Hugging Face ``Conv1D``; for a 1-D parameter ``rows`` are the entries and ``cols``
    is ``None``; for other 2-D parameters they index the storage dimensions. Stored as sorted, unique int64
    cpu tensors.
    """

    rows: Tensor | None = None
    cols: Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", _as_index(self.rows, "rows"))
        object.__setattr__(self, "cols", _as_index(self.cols, "cols"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KronBlock):
            return NotImplemented
        return _same(self.rows, other.rows) and _same(self.cols, other.cols)

    def __hash__(self) -> int:
        key = tuple(None if t is None else tuple(t.tolist()) for t in (self.rows, self.cols))
        return hash(key)

    def __repr__(self) -> str:
        def fmt(t: Tensor | None) -> str:
            if t is None:
                return "all"
            body = t.tolist() if t.numel() <= 8 else [*t[:4].tolist(), "...", *t[-2:].tolist()]
            return f"{body} (n={t.numel()})"

        return f"KronBlock(rows={fmt(self.rows)}, cols={fmt(self.cols)})"


@dataclass(frozen=True, eq=False)
class MaskBlock:
    """Elementwise block: a boolean mask in the parameter's storage shape (stored on cpu).

    Attributes:
        mask: Boolean tensor, ``True`` marks a stochastic entry.
    """

    mask: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.mask, Tensor) or self.mask.dtype != torch.bool:
            got = getattr(self.mask, "dtype", type(self.mask).__name__)
            raise TypeError(f"MaskBlock mask must be a Tensor of dtype torch.bool, got {got}")
        object.__setattr__(self, "mask", self.mask.detach().to("cpu").clone())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MaskBlock):
            return NotImplemented
        return self.mask.shape == other.mask.shape and bool(torch.equal(self.mask, other.mask))

    def __hash__(self) -> int:
        return hash(
            (tuple(self.mask.shape), tuple(self.mask.flatten().nonzero().flatten().tolist()))
        )

    def __repr__(self) -> str:
        return f"MaskBlock(shape={tuple(self.mask.shape)}, n={int(self.mask.sum())})"


Block = KronBlock | MaskBlock
"""A block of a Subset."""


@dataclass(frozen=True, eq=False)
class KronModule:
    """A linear map of a Kronecker-structured Subset, as KFAC-type methods consume it.

    ``bias_name`` is ``None`` when the bias is not in the subset; ``rows`` / ``cols`` (sorted int64, ``None``:
    all) index the logical ``n_out x n_in`` weight, ``n_rows`` / ``n_cols`` count them; ``transposed`` marks a
    Hugging Face ``Conv1D``.
    """

    module_name: str
    weight_name: str
    bias_name: str | None
    rows: Tensor | None
    cols: Tensor | None
    n_out: int
    n_in: int
    transposed: bool
    n_rows: int
    n_cols: int

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KronModule):
            return NotImplemented
        return (
            (
                self.module_name,
                self.weight_name,
                self.bias_name,
                self.n_out,
                self.n_in,
                self.transposed,
            )
            == (
                other.module_name,
                other.weight_name,
                other.bias_name,
                other.n_out,
                other.n_in,
                other.transposed,
            )
            and _same(self.rows, other.rows)
            and _same(self.cols, other.cols)
        )

    __hash__ = None  # type: ignore[assignment]
