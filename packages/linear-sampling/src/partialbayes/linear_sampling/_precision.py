"""Noise precision ``B`` (a scalar, one per observation, or the softmax Hessian) and prior ``A``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from partialbayes.predictive.internal import check_finite, check_labels, check_number, check_tensor


@dataclass(frozen=True)
class NoisePrecision:
    """Observation-noise precision ``B_n`` of ``η_n ~ N(0, B_n⁻¹)``.

    Attributes:
        value: ``[]`` one scalar for every output (regression), ``[n]`` one scalar per observation, or
            ``[n, m]`` softmax probabilities ``p_n`` with ``jitter``: ``B_n = diag(p_n) − p_n p_nᵀ +
            jitter·I`` (linearised classification, see
            [`softmax_hessian`][partialbayes.linear_sampling.softmax_hessian]), never formed: every
            product costs ``O(m)``. Probabilities are kept in float64 with rows normalised to sum to one,
            and ``1 − pᵀ(diag(p) + jitter·I)⁻¹p`` is computed there once (the eigenvalue near ``jitter``
            is below float32 resolution); products run in the operand's dtype.
        jitter: For ``[n, m]`` probabilities, the positive value added to the diagonal; else ``None``.
    """

    value: Tensor
    jitter: float | None = None
    _rest: Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        v = self.value
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = torch.tensor(float(v))
            object.__setattr__(self, "value", v)
        check_tensor("noise precision", v, finite=False, what="a float or a floating tensor")
        if v.ndim > 2:
            raise ValueError(
                f"noise precision must have shape [], [n] or [n, m] (softmax probabilities, with "
                f"jitter), got {tuple(v.shape)}; for other [m, m] precisions B_n = L_n L_nᵀ use "
                "the features L_nᵀ Φ_n with NoisePrecision(1.0)"
            )
        if (v.ndim == 2) != (self.jitter is not None):
            raise ValueError("give jitter exactly when the noise precision is [n, m] probabilities")
        check_finite(v, "noise precision has non-finite entries")
        if v.ndim < 2:
            if not bool((v > 0).all()):
                raise ValueError(f"noise precision must be positive, got {v.min().item():.3g}")
            return
        j = check_number("jitter", self.jitter)
        sums = v.sum(-1, dtype=torch.float64)
        if bool((v < 0).any()) or not bool(((sums - 1).abs() <= 1e-3).all()):
            raise ValueError("softmax probabilities [n, m] must be >= 0 with rows summing to one")
        p = v.to(torch.float64) / sums.unsqueeze(1)
        object.__setattr__(self, "value", p)
        # 1 − ‖w‖² for w = p / √(p + j): Σ p − Σ p²/(p + j) = j Σ p/(p + j), with no cancellation
        object.__setattr__(self, "_rest", j * (p / (p + j)).sum(-1))

    def check(self, n: int, m: int) -> None:
        """Raise a ``ValueError`` naming both shapes if this precision does not fit ``n`` observations of ``m`` outputs."""
        v = self.value
        if (v.ndim == 1 and v.shape[0] != n) or (v.ndim == 2 and tuple(v.shape) != (n, m)):
            raise ValueError(
                f"noise precision has shape {tuple(v.shape)} but the features have n={n}, m={m} "
                f"(expected [], [{n}] or [{n}, {m}])"
            )

    def to(self, dtype: torch.dtype, device: torch.device) -> NoisePrecision:
        """Copy to ``dtype`` and ``device`` (``self`` when already there; probabilities stay float64)."""
        v = self.value
        if v.device == device and (v.dtype == dtype or v.ndim == 2):
            return self
        return NoisePrecision(v.to(device, torch.float64 if v.ndim == 2 else dtype), self.jitter)

    def _scale(self, idx: Tensor) -> Tensor:
        """Scalar kinds: ``B_idx`` as ``[b, 1, 1]`` (or ``[]``)."""
        return self.value if self.value.ndim == 0 else self.value[idx].reshape(-1, 1, 1)

    def _terms(self, idx: Tensor, like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Softmax kind, in ``like``'s dtype: ``p``, ``p + jitter``, ``w`` ``[b, m, 1]``; ``1 − ‖w‖²``."""
        assert self._rest is not None
        assert self.jitter is not None
        p = self.value[idx].unsqueeze(2)
        e = p + self.jitter
        rest = self._rest[idx].reshape(-1, 1, 1)
        return tuple(t.to(like.dtype) for t in (p, e, p / e.sqrt(), rest))  # type: ignore[return-value]

    def apply(self, idx: Tensor, v: Tensor) -> Tensor:
        """``B_idx v`` for ``v`` of shape ``[b, m, k]``."""
        if self.value.ndim < 2:
            return self._scale(idx) * v
        p, diag, _, _ = self._terms(idx, v)
        return diag * v - p * (p * v).sum(1, keepdim=True)

    def apply_sqrt(self, idx: Tensor, e: Tensor) -> Tensor:
        """``S_idx e`` for ``e`` of shape ``[b, m, k]``, a square root ``S Sᵀ = B``.

        Softmax: with ``E = diag(p + jitter)``, ``B = E^½ (I − w wᵀ) E^½`` for ``w = E^{-½} p``
        (``‖w‖ < 1``), and ``S = E^½ (I − c w wᵀ)`` with ``c = 1 / (1 + √(1 − ‖w‖²))``, since
        ``(I − c w wᵀ)² = I − w wᵀ``.
        """
        if self.value.ndim < 2:
            return self._scale(idx).sqrt() * e
        _, diag, w, rest = self._terms(idx, e)
        c = 1 / (1 + rest.sqrt())
        return diag.sqrt() * (e - c * w * (w * e).sum(1, keepdim=True))

    def apply_inv_sqrt_t(self, idx: Tensor, e: Tensor) -> Tensor:
        """``S_idx⁻ᵀ e`` for ``e`` of shape ``[b, m, k]``: maps ``N(0, I)`` to ``N(0, B⁻¹)``.

        Softmax: ``S⁻ᵀ = E^{-½} (I + c' w wᵀ)`` with ``c' = 1 / (√(1 − ‖w‖²) (1 + √(1 − ‖w‖²)))``.
        """
        if self.value.ndim < 2:
            return e / self._scale(idx).sqrt()
        _, diag, w, rest = self._terms(idx, e)
        c = 1 / (rest.sqrt() * (1 + rest.sqrt()))
        return (e + c * w * (w * e).sum(1, keepdim=True)) / diag.sqrt()

    def solve(self, idx: Tensor, g: Tensor) -> Tensor:
        """``B_idx⁻¹ g`` for ``g`` of shape ``[b, m, k]`` (softmax: by Sherman–Morrison, ``O(m)``)."""
        if self.value.ndim < 2:
            return g / self._scale(idx)
        p, diag, _, rest = self._terms(idx, g)
        u = p / diag  # E⁻¹ p
        return g / diag + u * (u * g).sum(1, keepdim=True) / rest

    def logdet(self, n: int, m: int) -> Tensor:
        """``Σ_n log det B_n`` over ``n`` observations with ``m`` outputs."""
        v = self.value
        if v.ndim < 2:
            return (n * m if v.ndim == 0 else m) * v.log().sum()
        _, diag, _, rest = self._terms(torch.arange(n, device=v.device), v)
        return diag.log().sum() + rest.log().sum()


def softmax_hessian(logits: Tensor, jitter: float = 1e-6) -> NoisePrecision:
    """Hessian ``diag(p) − ppᵀ + jitter·I`` of the categorical NLL in the ``[n, m]`` logits: the ``B_n`` of classification.

    Singular along the all-ones direction, hence the positive ``jitter``. Kept as the probabilities (float64):
    every product costs ``O(m)``, so a 50,257-token vocabulary needs no ``[n, m, m]`` block.

    Raises:
        ValueError: If ``logits`` is not ``[n, m]``, has non-finite entries, or ``jitter`` is not positive.
    """
    check_tensor("logits", logits, finite=False, what="a floating tensor")
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [n, m], got {tuple(logits.shape)}")
    return NoisePrecision(logits.to(torch.float64).softmax(-1), jitter)


@dataclass(frozen=True)
class Prior:
    """Gaussian prior ``θ ~ N(0, A⁻¹)`` with diagonal ``A``: one precision, or one per parameter group.

    Attributes:
        alpha: ``[]`` scalar precision or ``[G]`` one precision per group.
        groups: ``[d]`` int64 group of every parameter (values in ``0..G-1``), or ``None`` for one group.
    """

    alpha: Tensor
    groups: Tensor | None = None

    def __post_init__(self) -> None:
        a = self.alpha
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = torch.tensor(float(a))
            object.__setattr__(self, "alpha", a)
        if not isinstance(a, Tensor) or not a.dtype.is_floating_point or a.ndim > 1:
            raise TypeError(f"prior precision alpha must be a float or [G] float tensor, got {a!r}")
        if not bool(torch.isfinite(a).all() & (a > 0).all()):
            raise ValueError(f"prior precision alpha must be positive and finite, got {a.tolist()}")
        g = self.groups
        if g is None:
            if a.ndim == 1 and a.shape[0] != 1:
                raise ValueError(f"alpha has {a.shape[0]} groups but no groups tensor was given")
            return
        n_groups = 1 if a.ndim == 0 else a.shape[0]  # groups index alpha: [d] ints in [0, G)
        d = g.numel() if isinstance(g, Tensor) else 0
        object.__setattr__(self, "groups", check_labels("groups", g, d, n_groups).long())

    @property
    def n_groups(self) -> int:
        """Number of groups ``G``."""
        return 1 if self.alpha.ndim == 0 else self.alpha.shape[0]

    def diag(self, d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The diagonal of ``A``, ``[d]``.

        Raises:
            ValueError: If ``groups`` does not have ``d`` entries.
        """
        a = self.alpha.to(device=device, dtype=dtype)
        if self.groups is None:
            return a.reshape(-1)[0].expand(d).clone()
        if self.groups.shape[0] != d:
            raise ValueError(f"prior groups has {self.groups.shape[0]} entries but d={d}")
        return a.reshape(-1)[self.groups.to(device)]

    def group_index(self, d: int, device: torch.device) -> Tensor:
        """``[d]`` group of every parameter (all zeros without groups)."""
        if self.groups is None:
            return torch.zeros(d, dtype=torch.int64, device=device)
        return self.groups.to(device=device, dtype=torch.int64)
