"""IVON's arithmetic (Shen et al., 2024, Alg. 1), its update contract and how a kernel runs on a bucket.

Per entry: mean ``m`` (the parameter), momentum ``μ``, Hessian estimate ``h``, weight decay ``δ``,
``λ = ess``, ``σ = 1/√(λ(h+δ))``, sample ``w = m + σ·z`` with ``z ~ N(0, 1)``. A kernel (``*_``) reads a
named tuple (`Shift`, `Fold`, `Update`; ``None`` for an absent field) and overwrites its leading
``WRITES[kind]`` fields in place. :func:`run` applies a kernel to every parameter of one device and dtype:
compiled or eager, direct or packed.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

#: A hyperparameter: a float, or a 0-d tensor inside a compiled kernel.
Scalar = float | Tensor


class Hyper(NamedTuple):
    """The hyperparameters of one IVON update, by name."""

    lr: Scalar  # Step size α (``lr·(hess_init + δ)`` with ``rescale_lr``).
    beta1: Scalar  # Gradient momentum β1.
    beta2: Scalar  # Hessian momentum β2.
    weight_decay: Scalar  # δ, the prior precision divided by ``ess``.
    ess: Scalar  # Effective sample size λ.
    bias_correction: Scalar  # ``1 − β1ᵗ`` at step ``t`` (1 without debiasing).
    clip_radius: Scalar | None  # Element-wise clipping radius of the step (``None``: none).


class Shift(NamedTuple):
    """Entering or leaving a weight sample: ``param`` ← ``param ± ε`` (writes ``param``)."""

    param: Tensor  # ``m`` on entry (``w`` on exit).
    hess: Tensor  # ``h``.
    noise: Tensor  # ``z`` (float16; zero outside the variational entries).


class Fold(NamedTuple):
    """Folding one more MC sample's Hessian statistic into the running mean ``stat`` (writes ``stat``)."""

    stat: Tensor  # The weighted running mean of the statistic so far.
    grad: Tensor  # The new sample's gradient ``g``.
    noise: Tensor | None  # The new sample's ``z`` (``None`` for ``"gradsq"``).


class Update(NamedTuple):
    """One IVON step of one tensor of entries (writes ``mean``, ``momentum`` and ``hess``)."""

    mean: Tensor  # ``m``: the parameter.
    momentum: Tensor  # ``μ``.
    hess: Tensor  # ``h > 0``.
    grad: Tensor  # ``ĝ``: the gradient, averaged over the step's MC samples.
    noise: Tensor | None  # ``z`` of the one sample whose statistic is pending ("price"), or None.
    stat: Tensor | None  # The statistic averaged over the samples if folded, else None.
    mask: Tensor | None  # Entries whose ``h`` is learned (elsewhere it stays fixed); None: all.


#: How many leading fields of each item kind its kernel overwrites.
WRITES = {Shift: 1, Fold: 1, Update: 3}


def hess_statistic(grad: Tensor, noise: Tensor | None, *, hess_approx: str) -> Tensor:
    """One sample's Hessian statistic ``z·g`` (``"price"``; `ivon_update` applies ``√(λ(h+δ))``) or ``g²``."""
    if hess_approx == "gradsq":
        return grad * grad
    return noise.to(grad.dtype) * grad  # type: ignore[union-attr]


def ivon_update(
    u: Update, hyper: Hyper, *, hess_approx: str, learn_hess: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One IVON step (Alg. 1, lines 5–8) of one tensor of entries; returns the new ``(m, μ, h)``.

    With ``ĝ = u.grad`` and ``s̄`` the statistic averaged over the step's samples (:func:`hess_statistic`)::

        ĥ = √(λ(h+δ))·s̄   ("price": s̄ = mean z·g, so ĥ = mean ε·g/σ²)   or   ĥ = s̄   ("gradsq")
        μ ← β1·μ + (1−β1)·ĝ
        h ← β2·h + (1−β2)·ĥ + ½(1−β2)²·(h−ĥ)²/(h+δ)          (h stays positive even where ĥ < 0)
        m ← m − α·clip((μ/(1−β1ᵗ) + δ·m)/(h+δ), ±clip_radius)

    ``learn_hess=False`` keeps ``h`` fixed (entries that are not variational).
    """
    hess = u.hess
    momentum = hyper.beta1 * u.momentum + (1 - hyper.beta1) * u.grad
    if learn_hess:
        stat = (
            u.stat
            if u.stat is not None
            else hess_statistic(u.grad, u.noise, hess_approx=hess_approx)
        )
        h_plus_delta = hess + hyper.weight_decay
        h_hat = torch.sqrt(hyper.ess * h_plus_delta) * stat if hess_approx == "price" else stat
        one_minus_beta2 = 1 - hyper.beta2
        new_hess = (
            hyper.beta2 * hess
            + one_minus_beta2 * h_hat
            + 0.5 * one_minus_beta2**2 * (hess - h_hat) ** 2 / h_plus_delta
        )
        hess = new_hess if u.mask is None else torch.where(u.mask, new_hess, hess)
    direction = (momentum / hyper.bias_correction + hyper.weight_decay * u.mean) / (
        hess + hyper.weight_decay
    )
    if hyper.clip_radius is not None:
        direction = direction.clamp(-hyper.clip_radius, hyper.clip_radius)  # type: ignore[arg-type]
    return u.mean - hyper.lr * direction, momentum, hess


def shift_(s: Shift, *, scale: Scalar, weight_decay: Scalar) -> None:
    """``param ← param + scale·z/√(h+δ)`` in place (``scale = +1/√λ`` enters a sample, ``−1/√λ`` leaves)."""
    s.param.copy_(s.param + s.noise.to(s.hess.dtype) * torch.rsqrt(s.hess + weight_decay) * scale)


def fold_(f: Fold, *, hess_approx: str, rate: Scalar) -> None:
    """``stat ← stat + rate·(statistic − stat)`` in place (``rate = w_k / Σ_{j≤k} w_j`` for sample ``k``)."""
    new = hess_statistic(f.grad, f.noise, hess_approx=hess_approx)
    f.stat.copy_(f.stat + rate * (new - f.stat))


def update_(u: Update, *, hyper: Hyper, hess_approx: str, learn_hess: bool) -> None:
    """:func:`ivon_update` in place on ``u.mean``, ``u.momentum`` and ``u.hess``."""
    new = ivon_update(u, hyper, hess_approx=hess_approx, learn_hess=learn_hess)
    for dst, src in zip((u.mean, u.momentum, u.hess), new, strict=True):
        if src is not dst:
            dst.copy_(src)


# ------------------------------------------------------------------------------------- running a kernel
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
        n = WRITES[kind]
        for src, dst in zip(flat[:n], kind(*columns)[:n], strict=True):
            torch._foreach_copy_(dst, torch._C._nn.unflatten_dense_tensors(src, dst))


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
