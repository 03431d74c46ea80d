"""Options, logits and labels checks, and the output vectors of each `Fisher` (``Σ_n Σ_s J_nᵀ v_s v_sᵀ J_n``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive.internal import (
    LIKELIHOODS,
    check_choice,
    check_dtype,
    check_finite,
    check_int,
    check_number,
    check_type,
)
from partialbayes.predictive.internal import check_labels as check_class_labels


def _exact(f: Tensor, p: Tensor | None, labels: Tensor | None, k: int, s: float, g: Any) -> Tensor:
    c = f.shape[-1]
    eye = torch.eye(c, dtype=f.dtype, device=f.device)
    if p is None:
        return eye[:, None, :].expand(c, f.shape[0], c) / s
    return p.sqrt().T[:, :, None] * (eye[:, None, :] - p[None])  # m_c = √p_c (e_c - p): [C, B, C]


def _empirical(f: Tensor, p: Tensor | None, labels: Tensor, k: int, s: float, g: Any) -> Tensor:
    return (
        minus_one_hot(p, labels[None]) if p is not None else ((f - labels.to(f.dtype)) / s**2)[None]
    )


def _mc(f: Tensor, p: Tensor | None, labels: Tensor | None, k: int, s: float, g: Any) -> Tensor:
    dev = g.device if g is not None else f.device
    if p is not None:
        ys = torch.multinomial(p.to(dev), k, replacement=True, generator=g)
        return minus_one_hot(p, ys.to(p.device).T) / math.sqrt(k)
    eps = torch.randn((k, *f.shape), generator=g, dtype=f.dtype, device=dev)
    return eps.to(f.device) / (s * math.sqrt(k))


@dataclass(frozen=True)
class Fisher:
    """One Fisher type: passes ``S`` (``per_class``, ``sampled``), ``labels`` read, ``vectors [S, B, C]``."""

    name: str
    per_class: bool
    sampled: bool
    labels: bool
    vectors: Callable[..., Tensor]

    def passes(self, n_outputs: int, mc_samples: int) -> int:
        """Backward passes ``S`` per batch (per round of positions) for ``n_outputs`` logits."""
        return n_outputs if self.per_class else mc_samples if self.sampled else 1

    @property
    def positions(self) -> str:
        """``"joint"`` (one pass serves every kept position) or ``"each"``."""
        return "joint" if self.sampled else "each"


#: The Fisher types by name.
FISHERS: dict[str, Fisher] = {
    "exact": Fisher("exact", per_class=True, sampled=False, labels=False, vectors=_exact),
    "mc": Fisher("mc", per_class=False, sampled=True, labels=False, vectors=_mc),
    "empirical": Fisher(
        "empirical", per_class=False, sampled=False, labels=True, vectors=_empirical
    ),
}


@dataclass(frozen=True)
class CurvatureOptions:
    """The settings of one curvature computation (documented on the public callers), checked once here."""

    likelihood: str = "classification"
    fisher: str = "exact"
    mc_samples: int = 1
    sigma_noise: float = 1.0
    dtype: torch.dtype = torch.float64
    num_classes: int | None = None
    shift_labels: bool = False
    sharing: str | None = None
    bias: str = "fold"
    max_rank: int | None = None

    def output_vectors(
        self, logits: Tensor, labels: Tensor | None, generator: Any, batch_index: int
    ) -> Tensor:
        """Cotangents ``[S, B, C]`` of one batch from its output rows and checked labels."""
        fisher, f = FISHERS[self.fisher], logits.detach()
        if fisher.labels and labels is None:
            raise ValueError(
                f"batch {batch_index}: fisher={fisher.name!r} needs labels, the batch has none"
            )
        p = torch.softmax(f, dim=-1) if self.likelihood == "classification" else None
        return fisher.vectors(f, p, labels, self.mc_samples, float(self.sigma_noise), generator)

    def __post_init__(self) -> None:
        check_choice("likelihood", self.likelihood, LIKELIHOODS)
        object.__setattr__(self, "sigma_noise", check_number("sigma_noise", self.sigma_noise))
        check_choice("fisher", self.fisher, FISHERS)
        check_int("mc_samples", self.mc_samples)
        check_dtype("dtype", self.dtype)
        if self.num_classes is not None:
            check_int("num_classes", self.num_classes)
        check_type("shift_labels", self.shift_labels, bool, "a bool")
        check_choice("sharing", self.sharing, (None, "reduce", "expand"))
        check_choice("bias", self.bias, ("fold", "separate"))
        if self.max_rank is not None:
            check_int("max_rank", self.max_rank)


def check_list(items: Any, what: str, kind: type) -> list[Any]:
    """``items`` as a non-empty list of ``kind`` (subsets or posteriors), or an error naming ``what``."""
    if isinstance(items, (str, bytes, kind)) or not isinstance(items, Sequence):
        raise TypeError(f"{what} must be a list of {kind.__name__}, got {type(items).__name__}")
    if not items:
        raise ValueError(f"{what} is an empty list: pass at least one {kind.__name__}")
    for i, item in enumerate(items):
        check_type(f"{what}[{i}]", item, kind, f"a {kind.__name__}")
        if getattr(item, "names", True) == ():  # an empty Subset: say which
            raise ValueError(f"{what}[{i}] is empty: select at least one parameter")
    return list(items)


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (cpu for a parameterless model)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def check_logits(logits: Tensor, num_classes: int | None, index: int) -> None:
    """Refuse output rows ``[N, C]`` (`Outputs.keep` checked the rank) not finite, or ``C != num_classes``."""
    if num_classes is not None and logits.shape[1] != num_classes:
        raise ValueError(
            f"batch {index}: model outputs {logits.shape[1]} logits but num_classes={num_classes}"
        )
    check_finite(logits, f"batch {index}: the model's logits are not finite")


def check_labels(labels: Tensor, logits: Tensor, likelihood: str, index: int) -> Tensor:
    """One batch's labels checked against its output rows ``[B, C]``: ``int64 [B]`` or regression ``[B, C]``."""
    check_type(f"batch {index}: labels", labels, Tensor, "a tensor")
    b, c = logits.shape
    if likelihood == "classification":
        return check_class_labels(f"batch {index}: labels", labels, b, c).long()
    if labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"batch {index}: regression targets must be real numbers, got dtype {labels.dtype}"
        )
    y = labels[:, None] if labels.ndim == 1 and c == 1 else labels
    if tuple(y.shape) != (b, c):
        expected = f"[{b}, {c}]" + (f" or [{b}]" if c == 1 else "")
        raise ValueError(
            f"batch {index}: regression targets of shape {tuple(labels.shape)} do not match the "
            f"model outputs: expected {expected}"
        )
    check_finite(y, f"batch {index}: regression targets are not finite")
    return y


def minus_one_hot(p: Tensor, labels: Tensor) -> Tensor:
    """``p - e_y`` ``[S, B, C]`` for ``p [B, C]`` and ``labels [S, B]``, by a scatter."""
    out = p.expand(labels.shape[0], *p.shape).clone()
    return out.scatter_add_(-1, labels[..., None], out.new_full((*labels.shape, 1), -1.0))
