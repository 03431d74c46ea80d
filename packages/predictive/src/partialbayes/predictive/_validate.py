"""The argument checks of every package: a wrong type is a ``TypeError``, a value out of range a ``ValueError``.

Messages name the argument; intervals use the usual notation (``"(0, inf)"``; NaN lies in none); an ``int``
never accepts a ``bool``. Dataclasses declare ranges with `ranged` and check them with `check_fields`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import Tensor

#: Absolute tolerance on ``sum(p) == 1`` and ``p >= 0`` for probability inputs (any dtype).
PROB_ATOL = 1e-4


@functools.cache
def _interval(spec: str) -> tuple[float, float, bool, bool]:
    low, high = spec[1:-1].split(",")
    return float(low), float(high), spec[0] == "(", spec[-1] == ")"


# check_number checks its type inline (it runs on every hot path); check_int reuses it for the interval.
def check_int(name: str, value: object, interval: str = "[1, inf)") -> int:
    """An integer (``int``, NumPy's; not a ``bool``) in ``interval``, as an ``int``: else ``TypeError`` / ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    check_number(name, int(value), interval)
    return int(value)


def check_number(name: str, value: object, interval: str = "(0, inf)") -> float:
    """A real number (``int``, ``float``, NumPy's; not ``bool``) in ``interval`` (NaN lies in none), as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    low, high, low_open, high_open = _interval(interval)
    x = float(value)
    if (low < x if low_open else low <= x) and (x < high if high_open else x <= high):
        return x
    if high < float("inf"):
        rule = f"lie in {interval}"
    elif interval == "[1, inf)" and isinstance(value, int):
        rule = "be a positive int"
    else:
        kind = "an int" if isinstance(value, int) else "a finite number"
        rule = f"be {kind} {'>' if low_open else '>='} {low:g}"
    raise ValueError(f"{name} must {rule}, got {value!r}")


def check_bool(name: str, value: object) -> bool:
    """A ``bool``, else a ``TypeError`` naming ``name``."""
    return check_type(name, value, bool, "a bool")


@contextlib.contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Re-raise a ``TypeError`` / ``ValueError`` of the body as one of that kind saying ``{prefix}: {message}``."""
    try:
        yield
    except (TypeError, ValueError) as err:
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"{prefix}: {err}") from err


def check_finite(x: Tensor | float, message: str) -> None:
    """A ``ValueError`` saying ``message`` unless every entry of ``x`` (a tensor or a number) is finite."""
    if not bool(torch.isfinite(x).all() if isinstance(x, Tensor) else math.isfinite(x)):
        raise ValueError(message)


def check_choice(name: str, value: object, options: Collection[Any]) -> Any:
    """One of ``options``, else a ``ValueError`` listing them."""
    if value not in options:
        raise ValueError(f"{name} must be one of {sorted(options, key=str)}, got {value!r}")
    return value


#: The likelihoods every posterior family supports.
LIKELIHOODS = ("classification", "regression")


def check_likelihood(likelihood: object, sigma_noise: object = 1.0) -> float:
    """Check ``likelihood`` (one of `LIKELIHOODS`) and ``sigma_noise`` (finite > 0); return the latter as a float."""
    check_choice("likelihood", likelihood, LIKELIHOODS)
    return check_number("sigma_noise", sigma_noise)


def answer_only(target_ids: object, regression: bool) -> bool:
    """Whether ``target_ids`` asks for answer-only outputs (a ``ValueError`` for a regression model)."""
    if target_ids is not None and regression:
        raise ValueError("target_ids selects answer tokens of a classifier; not for regression")
    return target_ids is not None


def check_keys(
    where: str,
    mapping: Any,
    required: Collection = (),
    allowed: Collection | None = None,
    what: str = "entries",
) -> None:
    """A ``ValueError`` naming the ``required`` keys ``mapping`` lacks and those (``what``) outside ``allowed``."""
    missing = [k for k in required if k not in mapping]
    unknown = [] if allowed is None else sorted(map(str, set(mapping) - {*allowed, *required}))
    if missing or unknown:
        lacks = [f"has no {', '.join(map(repr, missing))}"] if missing else []
        extra = [f"has unknown {what} {unknown}"] if unknown else []
        raise ValueError(f"{where} {' and '.join(lacks + extra)}")


def check_shapes(who: str, params: Any, shapes: Any, here: str, there: str) -> None:
    """A ``ValueError`` naming the first of ``shapes`` (in ``there``) missing from ``params`` or shaped otherwise."""
    for name, shape in shapes.items():
        got = params.get(name)
        if got is None or got.shape != shape:
            what = "is missing from" if got is None else f"has shape {tuple(got.shape)} in"
            raise ValueError(f"{who}parameter {name!r} {what} {here}, {tuple(shape)} in {there}")


def check_known(kind: str, names: Any, valid: Collection[str], heading: str = "") -> None:
    """``unknown {kind} {names}; {heading or valid {kind}s}: ...`` unless each of ``names`` (str or several) is valid."""
    one = isinstance(names, str)
    bad = [n for n in ([names] if one else names) if n not in valid]
    if bad:
        shown = repr(bad[0]) if one else str(bad)
        raise ValueError(
            f"unknown {kind} {shown}; {heading or f'valid {kind}s'}: {', '.join(valid)}"
        )


def check_type(name: str, value: object, kind: type | tuple[type, ...], what: str = "") -> Any:
    """An instance of ``kind``, else a ``TypeError`` naming ``name`` (``what``: the expected type in words)."""
    if not isinstance(value, kind):
        expected = what or f"a {getattr(kind, '__name__', kind)}"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def ranged(default: Any, interval: str, kind: type = float, *, optional: bool = False) -> Any:
    """A dataclass field `check_fields` checks: a ``kind`` (``int`` / ``float``) in ``interval`` (or ``None`` if ``optional``)."""
    return dataclasses.field(
        default=default, metadata={"interval": interval, "kind": kind, "optional": optional}
    )


def check_fields(obj: Any, owner: str | None = None) -> None:
    """Check every field of the dataclass ``obj`` declared with `ranged` (names read ``owner.field``)."""
    owner = owner or type(obj).__name__
    for field in dataclasses.fields(obj):
        meta = field.metadata
        value = getattr(obj, field.name)
        if "interval" not in meta or (meta["optional"] and value is None):
            continue
        check = check_int if meta["kind"] is int else check_number
        check(f"{owner}.{field.name}", value, meta["interval"])


def check_tensor(
    name: str, x: object, *, floating: bool = True, finite: bool = True, what: str = ""
) -> Tensor:
    """Check that ``x`` is a tensor (floating point, finite when asked); ``what``: the expected kind in words."""
    if not isinstance(x, Tensor) or (floating and not x.is_floating_point()):
        got = f"dtype {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        kind = what or ("a floating-point tensor" if isinstance(x, Tensor) else "a torch.Tensor")
        raise TypeError(f"{name} must be {kind}, got {got}")
    # Fast path: a NaN or inf anywhere makes the total non-finite (inf - inf is NaN). Only when
    # the total is non-finite (possibly a harmless overflow) are the entries checked one by one.
    if finite and x.is_floating_point() and not bool(torch.isfinite(x.sum())):
        n_bad = int((~torch.isfinite(x)).sum())
        if n_bad:
            raise ValueError(f"{name} contains {n_bad} NaN or infinite value(s)")
    return x


def check_generator(generator: object, name: str = "generator") -> torch.Generator | None:
    """``None`` or a ``torch.Generator``, else a ``TypeError`` naming ``name`` (a seed is not a generator)."""
    hint = "a torch.Generator or None (for a seed s pass torch.Generator().manual_seed(s))"
    return check_type(name, generator, (torch.Generator, type(None)), hint)


def check_dtype(name: str, dtype: object, why: str = "") -> torch.dtype:
    """``torch.float32`` or ``torch.float64`` (what curvature and moments are kept in), else a ``TypeError``."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be torch.float32 or torch.float64{why}, got {dtype!r}")
    return dtype  # type: ignore[return-value]


def check_same_device(**tensors: Tensor) -> None:
    """Check that every tensor lives on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_probs(name: str, probs: object) -> Tensor:
    """Check categorical probabilities ``[..., C]``: finite, non-negative, rows sum to one (two passes)."""
    p = check_tensor(name, probs, finite=False)  # finiteness: through the row sums below
    if p.ndim < 1 or p.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., C] with C >= 1, got {tuple(p.shape)}")
    if p.numel() == 0:
        return p
    sums = p.sum(-1)
    if not bool(torch.isfinite(sums).all()):
        check_tensor(name, p)  # names the count of NaN / inf entries
    if float(p.amin()) < -PROB_ATOL:
        raise ValueError(f"{name} has negative probabilities (min {float(p.min()):.3g})")
    err = float((sums - 1).abs().amax())
    if err > PROB_ATOL:
        raise ValueError(
            f"{name} rows must sum to 1 over the last dimension "
            f"(largest deviation {err:.3g}); pass probabilities, not logits"
        )
    return p


def check_nonneg(name: str, x: object) -> Tensor:
    """Check a variance-like tensor: finite and non-negative."""
    v = check_tensor(name, x)
    if bool((v < 0).any()):
        raise ValueError(f"{name} must be non-negative (min {float(v.min()):.3g})")
    return v


def check_broadcasts(name: str, x: Tensor, target: str, to: Tensor) -> None:
    """Refuse ``x`` unless it broadcasts to the shape of ``to`` (named ``target``) without enlarging it."""
    try:
        ok = torch.broadcast_shapes(to.shape, x.shape) == to.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to {target} {tuple(to.shape)}"
        )


def check_labels(name: str, labels: object, n: int, n_classes: int | None) -> Tensor:
    """Check integer labels ``[N]`` with values in ``[0, n_classes)``."""
    check_type(name, labels, Tensor, "a torch.Tensor")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(labels.shape)}")
    if n_classes is not None and n > 0:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(f"{name} must lie in [0, {n_classes}); got values in [{lo}, {hi}]")
    return labels


def gaussian_logits(
    mean: object, cov: object, *, full: bool = True, symmetrize: bool = True
) -> tuple[Tensor, Tensor, bool]:
    """Validate ``N(mean [..., C], cov [..., C] or [..., C, C])``; return ``(mean, cov, is_full)``.

    ``full=False`` reads and returns only the diagonal; ``symmetrize`` checks a full ``cov`` is symmetric up to
    round-off and returns ``(cov + covᵀ)/2`` (``False``: unchecked, as given).
    """
    mu = check_tensor("mean", mean)
    check_type("cov", cov, Tensor, "a torch.Tensor")
    check_same_device(mean=mu, cov=cov)
    if mu.ndim < 1:
        raise ValueError(f"mean must have shape [..., C], got {tuple(mu.shape)}")
    if cov.dtype != mu.dtype:
        raise TypeError(f"mean and cov must share a dtype, got {mu.dtype} and {cov.dtype}")
    if cov.shape == mu.shape:
        return mu, check_nonneg("cov", cov), False
    c = mu.shape[-1]
    if cov.shape != (*mu.shape, c):
        raise ValueError(
            f"cov must have shape {tuple(mu.shape)} (variances) or {(*mu.shape, c)} "
            f"(covariances) to match mean {tuple(mu.shape)}, got {tuple(cov.shape)}"
        )
    var = check_tensor("cov", cov if full else cov.diagonal(dim1=-2, dim2=-1))
    diag = var.diagonal(dim1=-2, dim2=-1) if full else var
    if bool((diag < 0).any()):
        raise ValueError(
            f"cov is not positive semi-definite: negative variance {float(diag.min()):.3g} "
            "on its diagonal"
        )
    if not full or not symmetrize:
        return mu, var, full
    scale = diag.amax(-1, keepdim=True).unsqueeze(-1)
    tol = 1e3 * torch.finfo(var.dtype).eps * scale.clamp_min(torch.finfo(var.dtype).tiny)
    asym = (var - var.mT).abs()
    if bool((asym > tol).any()):
        raise ValueError(
            f"cov must be symmetric (largest asymmetry {float(asym.max()):.3g}, tolerance "
            f"{float(tol.max()):.3g} for {var.dtype}); if the asymmetry is round-off from a lower "
            "precision, pass 0.5 * (cov + cov.mT)"
        )
    return mu, 0.5 * (var + var.mT), True
