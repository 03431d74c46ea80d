"""Input validation shared by the strategies."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

import torch


def check_type(name: str, value: object, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is a ``kind``, else a ``TypeError``: ``{name} must be {what}, got {its type}``."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def check_finite(what: str, tensor: torch.Tensor) -> None:
    """A ``ValueError`` naming ``what`` unless every entry of ``tensor`` is finite."""
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} has non-finite entries")


def check_percent(percent: float, name: str = "percent", high: float = 100.0) -> float:
    """Return ``percent`` as a float in (0, ``high``], else raise ``ValueError`` / ``TypeError`` naming it."""
    if isinstance(percent, bool) or not isinstance(percent, (int, float)):
        raise TypeError(f"{name} must be a number in (0, {high:g}], got {type(percent).__name__}")
    if not 0.0 < percent <= high:  # NaN too
        raise ValueError(f"{name} must be in (0, {high:g}], got {percent!r}")
    return float(percent)


def check_count(k: int, available: int, what: str) -> int:
    """Validate a module count ``0 <= k <= available``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 0 <= k <= available:
        over = f"k={k} is larger than the number of {what} ({available})"
        raise ValueError(f"k must be >= 0, got {k}" if k < 0 else over)
    return k


def as_generator(seed: int | torch.Generator) -> torch.Generator:
    """A cpu ``torch.Generator`` from an int seed (or the generator itself)."""
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or torch.Generator, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def check_names(names: Iterable[str], known: Iterable[str], what: str) -> list[str]:
    """Check every name is known; raise ``ValueError`` listing close matches otherwise."""
    if isinstance(names, str):
        raise TypeError(f"{what} names must be a list of strings, got the single string {names!r}")
    known = list(known)
    known_set = set(known)
    out = []
    for n in names:
        check_type(f"{what} names", n, str, "strings")
        if n not in known_set:
            close = difflib.get_close_matches(n, known, n=3, cutoff=0.5)
            hint = f"; close matches: {close}" if close else f"; {len(known)} {what}s exist"
            raise ValueError(f"unknown {what} {n!r}{hint}")
        out.append(n)
    if len(set(out)) != len(out):
        dup = next(n for n in out if out.count(n) > 1)
        raise ValueError(f"{what} {dup!r} is given twice")
    return out


def ceil_fraction(percent: float, n: int) -> int:
    """ceil(percent * n / 100), robust to float round-off (e.g. 29.000000000000004 -> 29)."""
    return min(n, max(1, math.ceil(percent * n / 100.0 - 1e-9)))
