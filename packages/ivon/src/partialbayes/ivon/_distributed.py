"""torch.distributed helpers: per-rank noise seeds and averaging of gradient samples across ranks."""

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


def all_reduce_mean_(tensors: list[Tensor]) -> None:
    """Average a list of same-device, same-dtype tensors over all ranks, in place, with one all-reduce.

    Args:
        tensors: Tensors to average; flattened into one buffer for the collective.
    """
    if not tensors:
        return
    world = torch.distributed.get_world_size()
    flat = torch._utils._flatten_dense_tensors(tensors)
    torch.distributed.all_reduce(flat)
    flat.div_(world)
    for t, reduced in zip(
        tensors, torch._utils._unflatten_dense_tensors(flat, tensors), strict=True
    ):
        t.copy_(reduced)
