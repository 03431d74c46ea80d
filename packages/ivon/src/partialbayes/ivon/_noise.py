"""IVON's noise: float32 standard normals (whatever the target dtype), on CPUs drawn in parallel pieces."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

#: Entries per piece of a large CPU tensor (its own generator each).
PIECE = 1 << 18

_POOL: dict[str, ThreadPoolExecutor | int | None] = {"pool": None, "workers": 0}


def normal_(tensors: list[Tensor], generator: torch.Generator | None) -> None:
    """Fill tensors (one device) with float32-drawn standard normals (``generator=None``: the global RNG)."""
    pending: list[Future[None]] = []
    try:
        for z in tensors:
            on_cpu = generator is None or torch.device(generator.device).type == "cpu"
            if z.device.type != "cpu" or not on_cpu or z.numel() <= PIECE or not z.is_contiguous():
                _draw(z, generator)
            else:
                pending += _pieces(z.view(-1), generator)
    finally:
        for f in pending:
            f.result()


def piece_seeds(n: int, generator: torch.Generator | None) -> list[int]:
    """``n`` distinct 32-bit seeds (torch's CPU generator keeps 32 bits of a seed) drawn from ``generator``."""
    seeds: list[int] = []
    while len(seeds) < n:
        new = torch.randint(
            0, 2**32, (n - len(seeds),), generator=generator, dtype=torch.int64
        ).tolist()
        seeds = list(dict.fromkeys(seeds + new))  # drop repeats, keep the order
    return seeds


def _pieces(flat: Tensor, generator: torch.Generator | None) -> list[Future[None]]:
    starts = range(0, flat.numel(), PIECE)
    seeds = piece_seeds(len(starts), generator)
    pool = _pool()
    jobs = []
    for start, seed in zip(starts, seeds, strict=True):
        piece = flat[start : start + PIECE]
        if pool is None:
            _draw_seeded(piece, seed)
        else:
            jobs.append(pool.submit(_draw_seeded, piece, seed))
    return jobs


def _draw_seeded(piece: Tensor, seed: int) -> None:
    _draw(piece, torch.Generator().manual_seed(seed))


def _draw(t: Tensor, generator: torch.Generator | None) -> None:
    """``t ← N(0, 1)`` drawn as float32 on the generator's device (the global RNG's: ``t``'s device)."""
    device = t.device if generator is None else generator.device
    t.copy_(torch.empty(t.shape, dtype=torch.float32, device=device).normal_(generator=generator))


def _pool() -> ThreadPoolExecutor | None:
    """A pool of ``torch.get_num_threads()`` threads (``None`` for one thread), rebuilt when that changes."""
    workers = torch.get_num_threads()
    if workers != _POOL["workers"]:
        old = _POOL["pool"]
        if isinstance(old, ThreadPoolExecutor):
            old.shutdown(wait=False)
        _POOL["pool"] = ThreadPoolExecutor(workers, "ivon-noise") if workers > 1 else None
        _POOL["workers"] = workers
    pool = _POOL["pool"]
    return pool if isinstance(pool, ThreadPoolExecutor) else None


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    _POOL["pool"], _POOL["workers"] = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
