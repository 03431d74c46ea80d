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

from torch import Tensor

CHUNK = (
    1 << 16
)  # entries per chunk: a phase touches ~8 buffers, 8 x 256 KiB (float32) stays in L2/L3


def apply(
    fn: Callable[..., None],
    lists: Sequence[Sequence[Tensor] | None],
    *,
    blocked: bool,
    chunk: int | None = None,
) -> None:
    """Call ``fn(*lists)``, or, if ``blocked``, ``fn`` on one-element lists of flat chunks of each item.

    Args:
        fn: In-place list function; positional arguments are the lists (``None`` passes through).
        lists: Aligned lists of tensors (same length, item ``i`` of every list has the same number of
            entries), or ``None``.
        blocked: Chunk the work (CPU) or not (GPU: one foreach call).
        chunk: Entries per chunk (default :data:`CHUNK`).
    """
    if not blocked:
        fn(*lists)
        return
    chunk = CHUNK if chunk is None else chunk
    present = [lst for lst in lists if lst is not None]
    if not present:
        return
    for i in range(len(present[0])):
        items = [None if lst is None else lst[i] for lst in lists]
        numel = present[0][i].numel()
        if numel <= chunk or not all(t is None or t.is_contiguous() for t in items):
            fn(*[None if t is None else [t] for t in items])
            continue
        flats = [None if t is None else t.view(-1) for t in items]
        for start in range(0, numel, chunk):
            fn(*[None if f is None else [f[start : start + chunk]] for f in flats])
