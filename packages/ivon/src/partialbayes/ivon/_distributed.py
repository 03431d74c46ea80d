"""torch.distributed helpers: per-rank noise seeds and the weighted average of gradient samples across ranks."""

from __future__ import annotations

import torch
from torch import Tensor


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and a process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_seed(base: int) -> int:
    """A noise seed that differs between ranks: ``base + 7919·rank`` (mod 2⁶³)."""
    rank = torch.distributed.get_rank() if is_distributed() else 0
    return (base + 7919 * rank) % (2**63)


def all_reduce_weighted_mean_(tensors: list[Tensor], weight: float) -> None:
    """In place, with one all-reduce: each tensor becomes ``Σ_r w_r·t_r / Σ_r w_r`` (``weight``: this rank's ``w_r``)."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors).mul_(weight)
    flat = torch.cat([flat, flat.new_full((1,), weight)])
    torch.distributed.all_reduce(flat)
    values = flat[:-1].div_(flat[-1])
    for t, reduced in zip(
        tensors, torch._utils._unflatten_dense_tensors(values, tensors), strict=True
    ):
        t.copy_(reduced)
