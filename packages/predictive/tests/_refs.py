"""Dense float64 references shared by the tests (numpy / scipy, independent of the package)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.polynomial.hermite import hermgauss
from scipy.special import expit, ndtr, softmax


class BiasSubset:
    """Every entry of one bias ``name`` (the part of ``selection.Subset`` the predictive helpers use)."""

    def __init__(self, n: int, name: str = "bias") -> None:
        self.n, self.names = n, (name,)

    def num_entries(self, name: str | None = None) -> int:
        return self.n

    def gather(self, name: str, tensor):
        return tensor.reshape(-1)

    def mask(self, name: str):
        import torch

        return torch.ones(self.n, dtype=torch.bool)

    def check_values(self, values):
        (name,) = self.names
        if not isinstance(values, dict) or set(values) != {name}:
            raise ValueError("sample must cover the subset exactly")
        v = values[name].reshape(-1)
        if v.numel() != self.n or not bool(v.isfinite().all()):
            raise ValueError(f"sample[{name!r}] must hold {self.n} finite entries")
        return {name: v}


@lru_cache
def probit_sup_error() -> float:
    """sup_x |sigmoid(x) - Phi(sqrt(pi/8) x)| on a fine grid (about 0.0177)."""
    x = np.linspace(-12, 12, 200_001)
    return float(np.max(np.abs(expit(x) - ndtr(np.sqrt(np.pi / 8) * x))))


@lru_cache
def _nodes(n: int) -> tuple[np.ndarray, np.ndarray]:
    return hermgauss(n)


def gh_sigmoid(mu: float, var: float, n: int = 200) -> float:
    """E[sigmoid(f)], f ~ N(mu, var), by Gauss-Hermite quadrature with n nodes."""
    x, w = _nodes(n)
    return float(np.sum(w * expit(mu + np.sqrt(2 * var) * x)) / np.sqrt(np.pi))


def gh_softmax(mu: np.ndarray, cov: np.ndarray, n: int = 40) -> np.ndarray:
    """E[softmax(f)], f ~ N(mu, cov) in C <= 3 dimensions, by tensor-product Gauss-Hermite."""
    c = mu.shape[0]
    x, w = _nodes(n)
    grids = np.meshgrid(*([x] * c), indexing="ij")
    pts = np.stack([g.ravel() for g in grids], axis=1)  # [n^c, c]
    wts = np.prod(np.stack(np.meshgrid(*([w] * c), indexing="ij"), 0).reshape(c, -1), 0)
    evals, evecs = np.linalg.eigh(cov)
    root = evecs * np.sqrt(np.clip(evals, 0, None))
    f = mu + np.sqrt(2) * pts @ root.T
    return (wts[:, None] * softmax(f, axis=1)).sum(0) / np.pi ** (c / 2)
