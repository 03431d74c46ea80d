"""Full-data sums of minibatched feature products (``ΦᵀBΦ z``, ``ΦᵀB Y``, ``ΦᵀB^½ ε``) and sizing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.linear_sampling._features import WORKING_BYTES, Features, batches
from partialbayes.linear_sampling._precision import NoisePrecision
from partialbayes.predictive.internal import (
    available_memory,
    check_finite,
    check_int,
    check_tensor,
    check_type,
)


def default_batch_size(features: Features, batch_size: int | None, k: int = 1) -> int:
    """``batch_size`` validated; by default ``min(n, 256)``, fewer to keep ``[b, m, k]`` in `WORKING_BYTES`."""
    if batch_size is None:
        per = features.m * k * features.dtype.itemsize
        return max(1, min(features.n, 256, WORKING_BYTES // per))
    return min(check_int("batch_size", batch_size), features.n)


def check_samples(samples: Tensor, d: int) -> None:
    """Raise unless ``samples`` is a finite floating ``[d, k]`` tensor."""
    check_tensor("samples", samples, finite=False, what="a floating [d, k] tensor")
    if samples.ndim != 2 or samples.shape[0] != d:
        raise ValueError(f"samples have shape {tuple(samples.shape)}, expected (d={d}, k)")
    check_finite(samples, "samples have non-finite entries")


def targets_3d(features: Features, targets: Tensor) -> Tensor:
    """Targets ``[n]`` (``m = 1``) or ``[n, m]``, validated, as ``[n, m, 1]`` in the features' device, dtype."""
    check_type("targets", targets, torch.Tensor, "a tensor")
    y = targets.unsqueeze(1) if targets.ndim == 1 else targets
    if y.ndim != 2 or tuple(y.shape) != (features.n, features.m):
        raise ValueError(
            f"targets have shape {tuple(targets.shape)} but the features expect "
            f"(n, m) = ({features.n}, {features.m})"
        )
    check_finite(y, "targets have non-finite entries")
    return y.to(device=features.device, dtype=features.dtype).unsqueeze(2)


def curvature_matvec(
    features: Features, noise: NoisePrecision, z: Tensor, batch_size: int
) -> Tensor:
    """``ΦᵀBΦ z = Σ_n Φ_nᵀ B_n Φ_n z`` ``[d, k]`` for ``z [d, k]``, ``batch_size`` observations a call."""
    out = torch.zeros_like(z)
    for idx in batches(features.n, batch_size, features.device):
        out += features.apply_t(idx, noise.apply(idx, features.apply(idx, z)))
    return out


@dataclass(frozen=True)
class Problem:
    """``H x = c`` with ``H = ΦᵀBΦ + A`` (``a = diag(A) [d]``, ``c [d, k]``): the products solvers need."""

    features: Features
    noise: NoisePrecision
    a: Tensor
    c: Tensor
    batch_size: int

    def data_batch(self, idx: Tensor, v: Tensor) -> Tensor:
        """``(n/b) Φ_idxᵀ B Φ_idx v``: the data curvature of a minibatch, scaled to the full sum."""
        f = self.features
        return (f.n / idx.shape[0]) * f.apply_t(idx, self.noise.apply(idx, f.apply(idx, v)))

    def batch_matvec(self, v: Tensor, idx: Tensor) -> Tensor:
        """``Ĥ_idx v = (n/b) Φ_idxᵀ B Φ_idx v + A v``."""
        return self.data_batch(idx, v) + self.a[:, None] * v

    def matvec(self, v: Tensor) -> Tensor:
        """``H v`` over all observations."""
        return curvature_matvec(self.features, self.noise, v, self.batch_size) + self.a[:, None] * v

    def residual(self, x: Tensor) -> Tensor:
        """``H x − c`` over all observations."""
        return self.matvec(x) - self.c


def features_t_noise(
    features: Features, noise: NoisePrecision, y: Tensor, batch_size: int
) -> Tensor:
    """``ΦᵀB Y`` for observation-space ``y`` of shape ``[n, m, k]``; returns ``[d, k]``."""
    out = torch.zeros(features.d, y.shape[2], dtype=features.dtype, device=features.device)
    for idx in batches(features.n, batch_size, features.device):
        out += features.apply_t(idx, noise.apply(idx, y[idx]))
    return out


def features_t_noise_sqrt(
    features: Features,
    noise: NoisePrecision,
    k: int,
    batch_size: int,
    generator: torch.Generator | None,
    keep: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(Φᵀ B^½ ε [d, k], ε [n, m, k] if keep else None)`` for fresh ``ε ~ N(0, I)``: a draw of ``N(0, ΦᵀBΦ)``."""
    out = torch.zeros(features.d, k, dtype=features.dtype, device=features.device)
    eps_all = torch.empty(features.n, features.m, k, dtype=features.dtype) if keep else None
    for idx in batches(features.n, batch_size, features.device):
        eps = torch.randn(idx.shape[0], features.m, k, generator=generator, dtype=features.dtype)
        if eps_all is not None:
            eps_all[idx.cpu()] = eps
        out += features.apply_t(idx, noise.apply_sqrt(idx, eps.to(features.device)))
    return out, None if eps_all is None else eps_all.to(features.device)


def check_memory(nbytes: int, device: torch.device, what: str, instead: str) -> None:
    """Refuse, before allocating, a result of ``nbytes`` that the device's free memory cannot hold."""
    free, _ = available_memory(device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:.1f} GiB ({nbytes:,} bytes) but {free / 2**30:.1f} GiB are "
            f"free on {device}: {instead}"
        )
