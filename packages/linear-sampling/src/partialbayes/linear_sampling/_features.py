"""Features Φ of a linear model as minibatched operators (JVP ``Φ z`` and VJP ``Φᵀ v``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from partialbayes.predictive.internal import check_int, check_tensor, check_type

WORKING_BYTES = 1 << 28
"""Bytes of one observation-space block (``[b, m, k]``, or a model's output tangents) per operator call."""

JvpFn = Callable[[Tensor, Tensor], Tensor]
"""``(idx [b] int64, z [d, k]) -> Φ_idx z [b, m, k]``."""
VjpFn = Callable[[Tensor, Tensor], Tensor]
"""``(idx [b] int64, v [b, m, k]) -> Φ_idxᵀ v [d, k]``."""


def _shape(x: Tensor | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, Tensor) else tuple(x)


@dataclass(frozen=True)
class Features:
    """Features ``Φ`` of ``n`` observations with ``m`` outputs each over ``d`` parameters, as operators.

    The linear model is ``y_n = Φ_n θ + η_n`` with ``Φ_n`` ``[m, d]``, used only through minibatched
    ``jvp(idx [b], z [d, k]) -> [b, m, k]`` (``Φ_idx z``) and ``vjp(idx [b], v [b, m, k]) -> [d, k]``
    (``Φ_idxᵀ v``). Build it with [`Features.dense`][partialbayes.linear_sampling.Features.dense] from a
    matrix (then kept as ``matrix``, ``[n, m, d]``) or
    [`network_features`][partialbayes.linear_sampling.network_features] for a network's Jacobian.
    ``check_finite`` raises when an operator returns NaN or inf (one device sync per call).
    """

    jvp: JvpFn
    vjp: VjpFn
    n: int
    m: int
    d: int
    dtype: torch.dtype
    device: torch.device
    matrix: Tensor | None = None
    check_finite: bool = True

    def __post_init__(self) -> None:
        for name in ("n", "m", "d"):
            check_int(f"Features.{name}", getattr(self, name))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"Features.dtype must be floating point, got {self.dtype}")
        for name in ("jvp", "vjp"):
            check_type(f"Features.{name}", getattr(self, name), Callable, "callable")

    @classmethod
    def dense(cls, phi: Tensor, *, check_finite: bool = True) -> Features:
        """Features from an explicit ``[n, d]`` (one output per observation) or ``[n, m, d]`` matrix ``phi``.

        Raises:
            TypeError: If ``phi`` is not a floating tensor.
            ValueError: If ``phi`` has the wrong rank or non-finite entries.
        """
        check_tensor("phi", phi, finite=False, what="a floating-point tensor")
        if phi.ndim == 2:
            phi = phi.unsqueeze(1)
        if phi.ndim != 3:
            raise ValueError(f"phi must have shape [n, d] or [n, m, d], got {_shape(phi)}")
        if not bool(torch.isfinite(phi).all()):
            bad = (~torch.isfinite(phi)).flatten(1).any(1).nonzero().flatten()[:5].tolist()
            raise ValueError(f"phi has non-finite entries (observations {bad})")
        n, m, d = phi.shape

        def jvp(idx: Tensor, z: Tensor) -> Tensor:
            return torch.einsum("bmd,dk->bmk", phi[idx], z)

        def vjp(idx: Tensor, v: Tensor) -> Tensor:
            return torch.einsum("bmd,bmk->dk", phi[idx], v)

        return cls(jvp, vjp, n, m, d, phi.dtype, phi.device, matrix=phi, check_finite=check_finite)

    def apply(self, idx: Tensor, z: Tensor) -> Tensor:
        """``Φ_idx z`` ``[b, m, k]`` for ``[b]`` int64 observation indices ``idx`` and ``z`` ``[d, k]``, validated.

        Raises:
            ValueError: On a shape mismatch (both shapes named) or non-finite output.
        """
        if z.ndim != 2 or z.shape[0] != self.d:
            raise ValueError(
                f"parameter-space input has shape {_shape(z)} but the features expect (d={self.d}, k)"
            )
        out = self.jvp(idx, z)
        expected = (idx.shape[0], self.m, z.shape[1])
        if _shape(out) != expected:
            raise ValueError(
                f"features jvp returned shape {_shape(out)}, expected (b, m, k) = {expected}"
            )
        self._finite(out, "jvp (Φ z)", idx)
        return out

    def apply_t(self, idx: Tensor, v: Tensor) -> Tensor:
        """``Φ_idxᵀ v`` ``[d, k]`` for ``[b]`` int64 observation indices ``idx`` and ``v`` ``[b, m, k]``, validated.

        Raises:
            ValueError: On a shape mismatch (both shapes named) or non-finite output.
        """
        if v.ndim != 3 or v.shape[:2] != (idx.shape[0], self.m):
            raise ValueError(
                f"observation-space input has shape {_shape(v)} but the features expect "
                f"(b={idx.shape[0]}, m={self.m}, k)"
            )
        out = self.vjp(idx, v)
        expected = (self.d, v.shape[2])
        if _shape(out) != expected:
            raise ValueError(
                f"features vjp returned shape {_shape(out)}, expected (d, k) = {expected}"
            )
        self._finite(out, "vjp (Φᵀ v)", idx)
        return out

    def _finite(self, out: Tensor, what: str, idx: Tensor) -> None:
        if self.check_finite and not bool(torch.isfinite(out).all()):
            raise ValueError(
                f"non-finite features: {what} returned NaN or inf on a batch of observations "
                f"{idx[:8].tolist()}{'...' if idx.shape[0] > 8 else ''}"
            )


def scale_features(features: Features, scale: Tensor) -> Features:
    """Features ``Φ' = Φ diag(1/s)`` of the reparametrised model ``θ = θ' / s`` (the g-prior's)."""
    if scale.shape != (features.d,):
        raise ValueError(f"scale has shape {_shape(scale)} but the features have d={features.d}")
    if not bool((scale > 0).all() & torch.isfinite(scale).all()):
        raise ValueError("scale must be positive and finite")
    inv = (1.0 / scale).unsqueeze(1)

    def jvp(idx: Tensor, z: Tensor) -> Tensor:
        return features.jvp(idx, z * inv)

    def vjp(idx: Tensor, v: Tensor) -> Tensor:
        return features.vjp(idx, v) * inv

    matrix = None if features.matrix is None else features.matrix * inv.T
    return replace(features, jvp=jvp, vjp=vjp, matrix=matrix)


def batches(n: int, batch_size: int, device: torch.device) -> Iterator[Tensor]:
    """``[b]`` int64 index batches covering ``0..n-1`` once, in order (the last one may be smaller)."""
    yield from torch.arange(n, device=device).split(batch_size)
