"""Reduction of running sums across ranks when ``torch.distributed`` is initialised.

One ``SUM`` all-reduce of each sum gives the single-process factors; `fail_together` makes an error on one
rank fail every rank instead of leaving them waiting in the next all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """In-place ``"sum"`` / ``"max"`` all-reduce of ``t`` across ranks; a no-op without a process group of 2+."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


@contextmanager
def fail_together(device: torch.device) -> Iterator[None]:
    """Run collective-free work; on exit every rank all-reduces a failure flag and raises if any rank did."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    try:
        yield
    except Exception:
        dist.all_reduce(torch.ones((), device=device), op=dist.ReduceOp.SUM)
        raise
    failed = torch.zeros((), device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    if int(failed) > 0:
        raise RuntimeError(
            f"{int(failed)} other rank(s) raised while computing the curvature on their shard; "
            "see their error"
        )
