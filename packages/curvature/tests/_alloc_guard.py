"""A test guard that refuses, before it is allocated, any tensor above a number of elements.

Every aten operation run under `LargestTensor` is first replayed on ``meta`` copies of its arguments (shapes
only, no memory), so an operation that would create a tensor above ``limit`` elements raises
``AssertionError`` before its memory is touched (a ``torch.eye(50257)`` is refused, not allocated). Operations
whose output shape depends on data (``nonzero``, boolean indexing) have no meta kernel; they are checked right
after they run. ``largest`` records the largest tensor seen.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


class LargestTensor(TorchDispatchMode):
    """Context manager: refuse any tensor of more than ``limit`` elements; record the largest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.largest = 0
        self.largest_op = ""

    def _check(self, func, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if t.numel() > self.largest:
                    self.largest, self.largest_op = t.numel(), str(func)
                assert t.numel() <= self.limit, (
                    f"{func} would create a tensor of shape {tuple(t.shape)} ({t.numel():,} elements, "
                    f"limit {self.limit:,})"
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            shapes = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except Exception:  # no meta kernel (data-dependent shapes): checked after the real call
            shapes = None
        if shapes is not None:
            self._check(func, shapes)
        out = func(*args, **kwargs)
        self._check(func, out)
        return out
