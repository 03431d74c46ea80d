"""Apply an in-place kernel to every parameter: small ones packed into one call, large ones in chunks.

Run eagerly, a kernel of :mod:`partialbayes.ivon._kernels` makes one pass per torch operation. On chunks of
:data:`CHUNK` entries the intermediates stay in the CPU's caches between those passes (and the temporaries are
small); on a GPU a chunk is one kernel launch per operation. Parameters of at most :data:`SMALL` entries
(biases, LayerNorm) are concatenated into one call and copied back, which removes the per-tensor overhead.
Large contiguous parameters can instead go to the compiled kernel whole (see
:mod:`partialbayes.ivon._compiled`). Every entry gets the same arithmetic whichever way it is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from partialbayes.ivon import _compiled

#: Entries per eager chunk.
CHUNK = 1 << 18

#: Tensors of at most this many entries are packed into one call (never compiled).
SMALL = 1 << 16

Item = Sequence[Tensor | None]  # one parameter's tensors, in the kernel's argument order


def apply(
    kernel: Callable[..., None],
    items: Sequence[Item],
    *,
    writes: int,
    compiled: bool = False,
    warn: bool = False,
    **kwargs: Any,
) -> None:
    """Call ``kernel(*item, **kwargs)`` for every item, packed (small), chunked (eager) or whole (compiled).

    Args:
        kernel: Element-wise in-place kernel; its first ``writes`` arguments are written.
        items: Per parameter, the kernel's tensor arguments (same number of entries each, or ``None``).
        writes: How many leading arguments the kernel writes.
        compiled: Run the compiled kernel on large contiguous items (falls back to eager if unavailable).
        warn: Warn when compilation fails (see :func:`partialbayes.ivon._compiled.call`).
        **kwargs: The kernel's keyword arguments.
    """
    by_pattern: dict[tuple[bool, ...], list[Item]] = {}
    for item in items:
        by_pattern.setdefault(tuple(t is None for t in item), []).append(item)
    for group in by_pattern.values():
        small = [it for it in group if _numel(it) <= SMALL]
        if small:
            _packed(kernel, small, writes, kwargs)
        for item in group:
            if _numel(item) > SMALL:
                _large(kernel, item, compiled, warn, kwargs)


def _numel(item: Item) -> int:
    return next(t for t in item if t is not None).numel()


def _packed(
    kernel: Callable[..., None], items: list[Item], writes: int, kwargs: dict[str, Any]
) -> None:
    """One call on the concatenation of the items, written back into each."""
    if len(items) == 1:
        kernel(*items[0], **kwargs)
        return
    columns = list(zip(*items, strict=True))
    flat = [None if col[0] is None else torch.cat([t.reshape(-1) for t in col]) for col in columns]
    kernel(*flat, **kwargs)
    sizes = [_numel(it) for it in items]
    for col, packed in zip(columns[:writes], flat[:writes], strict=True):
        assert packed is not None
        dst = [t for t in col if t is not None]
        torch._foreach_copy_(
            dst, [s.view(t.shape) for s, t in zip(packed.split(sizes), dst, strict=True)]
        )


def _large(
    kernel: Callable[..., None], item: Item, compiled: bool, warn: bool, kwargs: dict[str, Any]
) -> None:
    if not all(t is None or t.is_contiguous() for t in item):
        kernel(*item, **kwargs)  # rare (a strided parameter): one whole-tensor call
        return
    flat = [None if t is None else t.view(-1) for t in item]
    if compiled and _compiled.call(kernel, flat, kwargs, warn=warn):
        return
    n = _numel(item)
    for start in range(0, n, CHUNK):
        kernel(*[None if t is None else t[start : start + CHUNK] for t in flat], **kwargs)
