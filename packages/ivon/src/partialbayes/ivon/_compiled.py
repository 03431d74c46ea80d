"""Optional ``torch.compile``'d kernels of the IVON arithmetic: the sample and the whole update in one pass each.

The eager path (:mod:`partialbayes.ivon._math`) needs three passes to turn the noise into a sample and twelve
for the update; each kernel here reads every input once and writes every output once. The noise itself is
still drawn eagerly with ``normal_`` (same generator, same numbers), so both paths agree up to rounding.

Compilation happens on first use per (kind, dtype); if it fails (no C++ compiler, an unsupported backend)
:func:`available` turns ``False`` with a warning and the caller falls back to the eager kernels.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_STATE: dict[str, Any] = {"ok": None, "fns": {}}


def _draw_kernel(w: Tensor, m: Tensor, h: Tensor, mask: Tensor | None, c: Tensor) -> None:
    """``w ← m + z·(h+δ)^(−1/2)`` (``z`` in ``w``; times ``mask``), ``c = [δ]``. Flat tensors of one size."""
    z = w if mask is None else w * mask
    w.copy_(m + z * torch.rsqrt(h + c[0]))


def _needs_est(est: Tensor | None, est_kind: str) -> Tensor:
    """``est``, which ``est_kind`` needs (resolved when tracing: ``est is None`` is fixed per compiled key)."""
    if est is None:
        raise ValueError(f"update kernel: est_kind {est_kind!r} needs est")
    return est


def _update_kernel(
    m: Tensor,
    mu: Tensor,
    h: Tensor,
    g: Tensor,
    est: Tensor | None,
    mask: Tensor | None,
    c: Tensor,
    est_kind: str | None,
    clip: bool,
) -> None:
    """The whole update of :func:`partialbayes.ivon._math.update_` for one flat tensor, in one pass.

    ``c = [1−β1, δ, λ, 1−β2, ½(1−β2)², debias·δ, −lr/debias, debias·clip_radius]``.
    """
    mu_new = torch.lerp(mu, g, c[0])
    h_new = h
    if est_kind is not None:
        s = h + c[1]
        if est_kind == "sample":
            d = h - c[2] * ((_needs_est(est, est_kind) - m) * g * s)
        elif est_kind == "price":
            d = h - c[2] * (_needs_est(est, est_kind) * s)
        elif est_kind == "gradsq":
            d = h - _needs_est(est, est_kind)
        else:  # "grad"
            d = h - g * g
        if mask is not None:
            d = d * mask
        h_new = h - c[3] * d + c[4] * (d * d / s)
        h.copy_(h_new)
    direction = (mu_new + c[5] * m) / (h_new + c[1])
    if clip:
        direction = direction.clamp(-c[7], c[7])
    m.copy_(m + c[6] * direction)
    mu.copy_(mu_new)


def available() -> bool:
    """Whether compiled kernels may be used (``False`` after a failed compilation)."""
    return _STATE["ok"] is not False


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
        fns[key] = torch.compile(copy, dynamic=True, fullgraph=True)
    return fns[key]


def _call(key: tuple[Any, ...], fn: Callable[..., None], *args: Any) -> bool:
    """Run the compiled ``fn``; ``False`` (and a warning, once) if compilation fails."""
    if _STATE["ok"] is False:
        return False
    try:
        _compiled(key, fn)(*args)
    except Exception as err:  # any compiler/backend failure means: use eager
        _STATE["ok"] = False
        warnings.warn(
            f"IVON(compiled=True): torch.compile failed ({type(err).__name__}: {err}); "
            "using the eager kernels",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _STATE["ok"] = True
    return True


def scalars(values: list[float], like: Tensor) -> Tensor:
    """Hyperparameters as a tensor on ``like``'s device (float32 for half types), so that no recompiles."""
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.tensor(values, dtype=dtype, device=like.device)


def draw_one(w: Tensor, m: Tensor, h: Tensor, mask: Tensor | None, c: Tensor) -> bool:
    """:func:`_draw_kernel` on flat views; ``False`` if the compiled kernel is unavailable."""
    flat = [t.view(-1) for t in (w, m, h)]
    key = ("draw", w.dtype, w.device.type, mask is None)
    return _call(key, _draw_kernel, *flat, None if mask is None else mask.view(-1), c)


def update_one(
    m: Tensor,
    mu: Tensor,
    h: Tensor,
    g: Tensor,
    est: Tensor | None,
    mask: Tensor | None,
    c: Tensor,
    est_kind: str | None,
    clip: bool,
) -> bool:
    """:func:`_update_kernel` on flat views; ``False`` if the compiled kernel is unavailable."""
    flat = [None if t is None else t.view(-1) for t in (m, mu, h, g, est, mask)]
    key = ("update", m.dtype, m.device.type, est_kind, est is None, mask is None, clip)
    return _call(key, _update_kernel, *flat, c, est_kind, clip)


def flat_ok(*tensors: Tensor | None) -> bool:
    """Whether all given tensors are contiguous (flat views possible)."""
    return all(t is None or t.is_contiguous() for t in tensors)
