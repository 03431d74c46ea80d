"""Validation of `collect_swag`'s hyper-parameters (bools, NaN and inf refused, each named)."""

from __future__ import annotations

import math


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_collect_options(
    lr: object, n_steps: object, snapshot_every: object, momentum: object, weight_decay: object
) -> None:
    """Raise a ``ValueError`` / ``TypeError`` naming the first bad hyper-parameter of `collect_swag`.

    Args:
        lr: Learning rate, finite and > 0.
        n_steps: Positive int, at least ``snapshot_every``.
        snapshot_every: Positive int.
        momentum: In ``[0, 1)``.
        weight_decay: Finite and ``>= 0``.
    """
    if not _number("lr", lr) > 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    every = _count("snapshot_every", snapshot_every)
    steps = _count("n_steps", n_steps)
    if steps < every:
        raise ValueError(f"n_steps={steps} < snapshot_every={every}: no snapshot would be taken")
    if not 0 <= _number("momentum", momentum) < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if _number("weight_decay", weight_decay) < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
