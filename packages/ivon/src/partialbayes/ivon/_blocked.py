"""Run an in-place kernel of :mod:`partialbayes.ivon._math` on every parameter: compiled or eager, direct or packed."""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from partialbayes.ivon._math import Hyper

#: Entries per eager chunk on a CPU.
CHUNK = 1 << 18

#: Entries per eager chunk on a GPU.
GPU_CHUNK = 1 << 24

#: Parameters of at most this many entries are packed together: eagerly (where each call costs one
#: dispatch per operation) and compiled (one dispatch per call).
SMALL = {False: 1 << 16, True: 1 << 14}

_STATE: dict[str, Any] = {"ok": None, "fns": {}}
_LOG = logging.getLogger("partialbayes.ivon")


def apply(kernel: Callable[..., None], items: Sequence[Any], **kwargs: Any) -> None:
    """:func:`run` on a list of named tuples (items with the same absent fields are run together)."""
    by_pattern: dict[tuple[bool, ...], list[Any]] = {}
    for item in items:
        by_pattern.setdefault(tuple(t is None for t in item), []).append(item)
    for group in by_pattern.values():
        run(
            kernel,
            [None if c[0] is None else list(c) for c in zip(*group, strict=True)],
            type(group[0]),
            **kwargs,
        )


def run(
    kernel: Callable[..., None],
    columns: list[list[Tensor] | None],
    kind: type,
    *,
    compiled: bool = False,
    warn: bool = False,
    **kwargs: Any,
) -> None:
    """``kernel(kind(*fields), **kwargs)`` per parameter, direct or packed; ``compiled`` falls back to eager.

    ``columns`` hold one field each (``None``: absent) of the parameters of one device and dtype.
    """
    present = [c for c in columns if c is not None]
    if not present[0]:
        return
    prepared = _prepare(kwargs, present[0][0]) if compiled and _STATE["ok"] is not False else None
    small, packed = SMALL[prepared is not None], []
    for i, t in enumerate(present[0]):
        if t.numel() > small and all(c[i].is_contiguous() for c in present):
            _flat(kernel, kind(*(c and c[i].view(-1) for c in columns)), prepared, warn, kwargs)
        else:
            packed.append(i)
    if len(packed) < len(present[0]):
        columns = [c and [c[i] for i in packed] for c in columns]
    if packed:  # one call on the concatenation, its written fields copied back
        flat = kind(*(c and torch._C._nn.flatten_dense_tensors(c) for c in columns))
        _flat(kernel, flat, prepared, warn, kwargs)
        for src, dst in zip(flat.written, kind(*columns).written, strict=True):
            torch._foreach_copy_(dst, torch._C._nn.unflatten_dense_tensors(src, dst))


def available() -> bool:
    """Whether compiled kernels may be used (``False`` after a failed compilation in this process)."""
    return _STATE["ok"] is not False


def _flat(
    kernel: Callable[..., None],
    item: Any,
    prepared: _Prepared | None,
    warn: bool,
    kwargs: dict[str, Any],
) -> None:
    """The kernel on an item of flat tensors: compiled whole, or eagerly (in chunks on a CPU)."""
    first = item[0]
    n = first.numel()
    if n == 0:
        return
    if prepared is not None and call(kernel, item, prepared, warn=warn):
        return
    step = CHUNK if first.device.type == "cpu" else GPU_CHUNK
    for start in range(0, n, step):
        kernel(
            type(item)(*(None if t is None else t[start : start + step] for t in item)), **kwargs
        )


# ------------------------------------------------------------------------------------------ torch.compile
class _Prepared(NamedTuple):
    """A kernel's keyword arguments for compiled calls: floats as 0-d tensors, and what selects the code."""

    kwargs: dict[str, Any]
    static: tuple[Any, ...]


def _as_tensor(value: Any, like: Tensor) -> Any:
    """Floats as 0-d tensors on ``like``'s device (float32 for half types); other values unchanged."""
    if isinstance(value, Hyper):
        return Hyper(*(_as_tensor(v, like) for v in value))
    if isinstance(value, float):
        dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
        return torch.tensor(value, dtype=dtype, device=like.device)
    return value


def _static(value: Any) -> Any:
    """The part of a keyword argument that decides the compiled code (not the float values)."""
    if isinstance(value, Hyper):
        return value.clip_radius is None
    return None if isinstance(value, float) else value


def _prepare(kwargs: dict[str, Any], like: Tensor) -> _Prepared:
    """Convert ``kwargs`` once for every compiled call on tensors like ``like`` (one device and dtype)."""
    static = tuple(sorted((k, _static(v)) for k, v in kwargs.items()))
    return _Prepared({k: _as_tensor(v, like) for k, v in kwargs.items()}, static)


def _compiled(key: tuple[Any, ...], fn: Callable[..., None]) -> Callable[..., None]:
    """``torch.compile(fn)`` on a code object of its own per ``key``, so that each Dynamo cache holds one entry."""
    fns = _STATE["fns"]
    if key not in fns:
        name = f"{fn.__name__}_{len(fns)}"
        code = fn.__code__.replace(co_name=name)
        copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        fns[key] = torch.compile(copy, dynamic=True, fullgraph=True)
    return fns[key]


def call(fn: Callable[..., None], item: Any, prepared: _Prepared, *, warn: bool) -> bool:
    """Run the compiled ``fn(item, **kwargs)`` on flat tensors; ``False`` (nothing written) if compiling fails."""
    if _STATE["ok"] is False:
        return False
    like = item[0]
    absent = tuple(t is None for t in item)
    key = (fn.__name__, type(item).__name__, like.dtype, like.device.type, absent, prepared.static)
    try:
        _compiled(key, fn)(item, **prepared.kwargs)
    except Exception as err:  # any compiler or backend failure means: run eagerly
        _STATE["ok"] = False
        _LOG.info(
            "torch.compile failed (%s: %s); IVON uses the eager kernels", type(err).__name__, err
        )
        if warn:
            warnings.warn(
                f"IVON(compiled=True): torch.compile failed ({type(err).__name__}: {err}); "
                "using the eager kernels",
                RuntimeWarning,
                stacklevel=5,
            )
        return False
    _STATE["ok"] = True
    return True
