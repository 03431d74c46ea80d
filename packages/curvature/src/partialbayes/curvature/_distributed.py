"""Reduction of running sums across ranks when ``torch.distributed`` is initialised.

Factors are accumulated as sums (``Σ δδᵀ``, ``Σ xxᵀ``, ``Σ x``, counts), so one ``SUM`` all-reduce of each
gives exactly the single-process factors: ``G`` summed over all examples, ``A`` averaged by the total count.

A rank that raises while streaming its shard would leave the others waiting forever in the next all-reduce;
`fail_together` wraps the local part so that every rank takes part in one extra all-reduce of a failure flag
and all of them raise.
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
    """Run local (collective-free) work so that an error on one rank fails every rank instead of hanging.

    On exit every rank all-reduces one failure flag on ``device`` (the model's: CUDA for NCCL, the CPU for
    gloo). A rank whose body raised re-raises its own error; the others raise a ``RuntimeError``.

    Raises:
        RuntimeError: On a rank whose body succeeded when the body raised on another rank.
    """
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
