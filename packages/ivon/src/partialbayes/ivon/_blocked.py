"""Run list functions either once over whole lists (foreach) or parameter by parameter (the CPU).

IVON does about three times as many element-wise passes per step as AdamW. On a GPU they are cheap
multi-tensor kernels over whole lists. On a CPU a foreach call is a loop over the tensors, so each pass over a
large model streams every buffer through main memory; running *all* passes of a phase on one parameter (or
one chunk of a very large parameter) before the next keeps more of the intermediates in cache, as torch's
single-tensor AdamW does on the CPU. Measured here (one thread, 17.7M entries): per-parameter passes took
0.8–1.3 s per step against 1.5 s for whole-list foreach passes; 64K-entry chunks were slower again (the
per-call overhead of ~10 small kernels per chunk dominates), so chunks are large.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: Entries per chunk: only very large tensors (embedding matrices) are cut.
CHUNK = 1 << 22

#: The shortest last chunk: torch's CPU ``normal_`` fills blocks of 16 entries (a shorter tensor takes
#: another code path and draws other numbers).
TAIL = 16


N_SCRATCH = 2  # temporaries a phase needs at once


class Workspace:
    """Reusable flat scratch buffers per (device, dtype), so per-parameter temporaries are never allocated.

    Allocating a temporary of a few MiB per parameter and pass costs page faults on every step on the CPU
    (such blocks are mapped and unmapped by the C allocator); one buffer of ``N_SCRATCH × CHUNK`` entries at
    most is reused instead.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, object], Tensor] = {}

    def views(self, like: Tensor) -> list[list[Tensor]]:
        """``N_SCRATCH`` one-element lists of scratch tensors shaped like ``like``."""
        key = (like.device, like.dtype)
        n = like.numel()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < N_SCRATCH * n:
            buf = torch.empty(N_SCRATCH * n, device=like.device, dtype=like.dtype)
            self._buffers[key] = buf
        return [[buf[i * n : (i + 1) * n].view(like.shape)] for i in range(N_SCRATCH)]


def apply(
    fn: Callable[..., None],
    lists: Sequence[Sequence[Tensor] | None],
    *,
    blocked: bool,
    chunk: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Call ``fn(*lists)``, or, if ``blocked``, ``fn`` on one-element lists of flat chunks of each item.

    Args:
        fn: In-place list function; positional arguments are the lists (``None`` passes through); it takes a
            keyword ``scratch`` (see :class:`Workspace`) when ``workspace`` is given.
        lists: Aligned lists of tensors (same length, item ``i`` of every list has the same number of
            entries), or ``None``. The first list's items decide the scratch dtype.
        blocked: Chunk the work (CPU) or not (GPU: one foreach call).
        chunk: Entries per chunk (default :data:`CHUNK`).
        workspace: Scratch buffers for the blocked path.
    """
    if not blocked:
        fn(*lists)
        return
    chunk = CHUNK if chunk is None else chunk
    present = [lst for lst in lists if lst is not None]
    if not present:
        return

    def call(items: list[Tensor | None]) -> None:
        args = [None if t is None else [t] for t in items]
        if workspace is None:
            fn(*args)
        else:
            fn(*args, scratch=workspace.views(present_item(items)))

    def present_item(items: list[Tensor | None]) -> Tensor:
        return next(t for t in items if t is not None)

    for i in range(len(present[0])):
        items = [None if lst is None else lst[i] for lst in lists]
        numel = present[0][i].numel()
        if numel <= chunk or not all(t is None or t.is_contiguous() for t in items):
            call(items)
            continue
        flats = [None if t is None else t.view(-1) for t in items]
        start = 0
        while start < numel:
            # the last chunk takes a short tail along (>= TAIL entries), so that ``normal_`` chunk by chunk
            # draws exactly what one call on the whole tensor draws when ``chunk`` is a multiple of 16
            stop = numel if numel - (start + chunk) < TAIL else start + chunk
            call([None if f is None else f[start:stop] for f in flats])
            start = stop
