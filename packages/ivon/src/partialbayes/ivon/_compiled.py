"""``torch.compile`` of IVON's in-place kernels, with a fallback to running them eagerly.

:func:`call` compiles a kernel of :mod:`partialbayes.ivon._kernels` on first use per structural key (kernel,
dtype, device type, which arguments are ``None``, the string/bool options) and runs it on flat tensors, with
the float hyperparameters passed as 0-d tensors so that a changing value (the bias correction) never
recompiles. If compiling fails (no C++ compiler on a CPU, an unsupported backend or Python) it returns
``False``, remembers that for the process, and the caller runs the kernel eagerly.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from partialbayes.ivon._math import Hyper

_STATE: dict[str, Any] = {"ok": None, "fns": {}}
_LOG = logging.getLogger("partialbayes.ivon")


def available() -> bool:
    """Whether compiled kernels may be used (``False`` after a failed compilation in this process)."""
    return _STATE["ok"] is not False


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


def _compiled(key: tuple[Any, ...], fn: Callable[..., None]) -> Callable[..., None]:
    """``torch.compile(fn)`` with a code object of its own per ``key``.

    Dynamo caches compiled graphs per code object and recompiles when a guard (flag, dtype, device) fails,
    up to a small limit; one copy of the code per key keeps each cache at one entry.
    """
    fns = _STATE["fns"]
    if key not in fns:
        name = f"{fn.__name__}_{len(fns)}"
        code = fn.__code__.replace(co_name=name)
        copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        fns[key] = torch.compile(copy, dynamic=True, fullgraph=True)
    return fns[key]


class Prepared(NamedTuple):
    """A kernel's keyword arguments for compiled calls: floats as 0-d tensors, and what selects the code."""

    kwargs: dict[str, Any]
    static: tuple[Any, ...]


def prepare(kwargs: dict[str, Any], like: Tensor) -> Prepared:
    """Convert ``kwargs`` once for every compiled call on tensors like ``like`` (one device and dtype)."""
    static = tuple(sorted((k, _static(v)) for k, v in kwargs.items()))
    return Prepared({k: _as_tensor(v, like) for k, v in kwargs.items()}, static)


def call(
    fn: Callable[..., None], args: list[Tensor | None], prepared: Prepared, *, warn: bool
) -> bool:
    """Run the compiled ``fn(*args, **kwargs)`` on flat tensors; ``False`` if compilation fails.

    Args:
        fn: A kernel of :mod:`partialbayes.ivon._kernels`.
        args: Flat contiguous tensors of one length, or ``None``.
        prepared: Its keyword arguments, from :func:`prepare`.
        warn: Warn (once per process) when compilation fails; otherwise fall back silently.

    Returns:
        Whether the compiled kernel ran (if not, nothing was written).
    """
    if _STATE["ok"] is False:
        return False
    like = next(a for a in args if a is not None)
    key = (
        fn.__name__,
        like.dtype,
        like.device.type,
        tuple(a is None for a in args),
        prepared.static,
    )
    try:
        _compiled(key, fn)(*args, **prepared.kwargs)
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
