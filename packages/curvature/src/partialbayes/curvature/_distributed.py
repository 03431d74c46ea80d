"""Reduction of running sums across ranks when ``torch.distributed`` is initialised.

Factors are accumulated as sums (``Σ δδᵀ``, ``Σ xxᵀ``, ``Σ x``, counts), so one ``SUM`` all-reduce of each
gives exactly the single-process factors: ``G`` summed over all examples, ``A`` averaged by the total count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: Tensor) -> Tensor:
    """In-place ``SUM`` all-reduce of ``t`` across ranks (no-op without an initialised process group)."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_int(n: int, device: torch.device) -> int:
    """Sum of an integer over ranks."""
    if not is_distributed():
        return n
    t = torch.tensor(float(n), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return round(float(t))
