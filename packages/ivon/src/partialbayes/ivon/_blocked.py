"""Apply an in-place kernel to every parameter: large ones directly, the others packed into one call.

Run eagerly, a kernel of :mod:`partialbayes.ivon._kernels` makes one pass (and, on a GPU, one kernel launch)
per torch operation, with a temporary per operation. So:

* a large contiguous parameter (more than :data:`SMALL` entries) goes directly, eagerly in chunks: of
  :data:`CHUNK` entries on a CPU, so that the intermediates stay in the caches between the passes, and of
  :data:`GPU_CHUNK` entries on a GPU, which bounds the temporaries; compiled, it goes whole;
* every other parameter (small ones, strided ones) is concatenated with the others into one flat tensor per
  argument, the kernel runs once on those, and the results are copied back: one call instead of one per
  tensor.

Every entry gets the same arithmetic whichever way it is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from partialbayes.ivon import _compiled

#: Entries per eager chunk on a CPU.
CHUNK = 1 << 18

#: Entries per eager chunk on a GPU.
GPU_CHUNK = 1 << 24

#: Parameters of at most this many entries are packed together.
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
    """Call ``kernel(*item, **kwargs)`` for every item, directly or packed (see the module docstring).

    Args:
        kernel: Element-wise in-place kernel; its first ``writes`` arguments are written.
        items: Per parameter, the kernel's tensor arguments (same number of entries each, or ``None``), all
            on one device.
        writes: How many leading arguments the kernel writes.
        compiled: Run the compiled kernel (falls back to eager where it is unavailable).
        warn: Warn when compilation fails (see :func:`partialbayes.ivon._compiled.call`).
        **kwargs: The kernel's keyword arguments.
    """
    if not items:
        return
    prepared = _compiled.prepare(kwargs, _first(items[0])) if compiled else None
    by_pattern: dict[tuple[bool, ...], list[Item]] = {}
    for item in items:
        by_pattern.setdefault(tuple(t is None for t in item), []).append(item)
    for group in by_pattern.values():
        packed = []
        for item in group:
            if _direct(item):
                flat = [None if t is None else t.view(-1) for t in item]
                _flat(kernel, flat, prepared, warn, kwargs)
            else:
                packed.append(item)
        if packed:
            _packed(kernel, packed, writes, prepared, warn, kwargs)


def _first(item: Item) -> Tensor:
    return next(t for t in item if t is not None)


def _direct(item: Item) -> bool:
    present = [t for t in item if t is not None]
    return present[0].numel() > SMALL and all(t.is_contiguous() for t in present)


def _packed(
    kernel: Callable[..., None],
    items: list[Item],
    writes: int,
    prepared: _compiled.Prepared | None,
    warn: bool,
    kwargs: dict[str, Any],
) -> None:
    """One call on the concatenation of the items, written back into each."""
    if len(items) == 1 and all(t is None or t.is_contiguous() for t in items[0]):
        _flat(kernel, [None if t is None else t.view(-1) for t in items[0]], prepared, warn, kwargs)
        return
    columns = list(zip(*items, strict=True))
    flat = [None if col[0] is None else torch.cat([t.reshape(-1) for t in col]) for col in columns]
    _flat(kernel, flat, prepared, warn, kwargs)
    sizes = [_first(it).numel() for it in items]
    for col, packed in zip(columns[:writes], flat[:writes], strict=True):
        assert packed is not None
        dst = [t for t in col if t is not None]
        torch._foreach_copy_(
            dst, [s.view(t.shape) for s, t in zip(packed.split(sizes), dst, strict=True)]
        )


def _flat(
    kernel: Callable[..., None],
    flat: list[Tensor | None],
    prepared: _compiled.Prepared | None,
    warn: bool,
    kwargs: dict[str, Any],
) -> None:
    """The kernel on flat tensors: compiled whole, or eagerly (in chunks on a CPU)."""
    first = _first(flat)
    n = first.numel()
    if n == 0:
        return
    if prepared is not None and _compiled.call(kernel, flat, prepared, warn=warn):
        return
    step = CHUNK if first.device.type == "cpu" else GPU_CHUNK
    for start in range(0, n, step):
        kernel(*[None if t is None else t[start : start + step] for t in flat], **kwargs)
