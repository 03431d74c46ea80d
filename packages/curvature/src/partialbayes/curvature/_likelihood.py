"""A batch's outputs and their likelihood: which outputs count, their labels, each `Fisher`'s output vectors.

Outputs: one per example (``[B, C]`` logits) or per kept position (``[B, T, C]``, row-major). The output
vectors ``v_s`` give the curvature ``Σ_n Σ_s J_nᵀ v_s v_sᵀ J_n``; `CurvatureOptions` are a pass's settings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive import answer_positions, is_causal_lm, kept_positions
from partialbayes.predictive.internal import (
    IGNORE_INDEX,
    LIKELIHOODS,
    batch_size,
    check_choice,
    check_dtype,
    check_finite,
    check_int,
    check_number,
    check_type,
    split_batch,
    take_inputs,
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

    @property
    def positions(self) -> str:
        """``"joint"`` (one pass serves every kept position) or ``"each"``."""
        return "joint" if self.sampled else "each"


#: Sketch columns beyond the rank kept (``q = max_rank + OVERSAMPLE``) of a factor side above ``max_rank``.
OVERSAMPLE = 10

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


def resolve_shift_labels(model: nn.Module, shift_labels: bool | None) -> bool:
    """``shift_labels`` as given (checked by `CurvatureOptions`), or (``None``) whether ``model`` is a causal LM."""
    return is_causal_lm(model) if shift_labels is None else shift_labels


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (cpu for a parameterless model)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def minus_one_hot(p: Tensor, labels: Tensor) -> Tensor:
    """``p - e_y`` ``[S, B, C]`` for ``p [B, C]`` and ``labels [S, B]``, by a scatter."""
    out = p.expand(labels.shape[0], *p.shape).clone()
    return out.scatter_add_(-1, labels[..., None], out.new_full((*labels.shape, 1), -1.0))


def _shifted(t: Tensor, fill: int) -> Tensor:
    """``t[:, 1:]`` then a column of ``fill``: position ``t + 1``'s value at ``t``."""
    return torch.cat([t[:, 1:], torch.full_like(t[:, :1], fill)], dim=1)


@dataclass(frozen=True)
class Outputs:
    """How one batch's outputs are counted and labelled (``target_ids``: answer-only, the ``K`` checked ids)."""

    attention_mask: Tensor | None
    labels: Tensor | None
    shift: bool
    likelihood: str
    target_ids: Tensor | None = None
    #: Whether the batch (as read) has classification labels and none but -100: no labelled output.
    unlabelled: bool = False

    def keep(self, logits: Tensor) -> Tensor | None:
        """``[B, T]`` kept positions of token-level logits (``None`` for ``[B, C]``)."""
        if self.shift and (logits.ndim == 2 or self.likelihood == "regression"):
            raise ValueError(
                "shift_labels=True is for token-level logits [B, T, C] (causal language models) and "
                f"needs likelihood='classification'; the model returns logits of shape "
                f"{tuple(logits.shape)}, likelihood={self.likelihood!r}: pass shift_labels=False"
            )
        if logits.ndim == 2:
            return None
        if logits.ndim != 3:
            raise ValueError(
                "model output must be logits of shape [B, C] (one output per example) or [B, T, C] "
                f"(one per token position), got {tuple(logits.shape)}"
            )
        if self.likelihood == "regression":
            if self.attention_mask is None:
                raise ValueError(
                    f"token-level regression outputs of shape {tuple(logits.shape)} need an "
                    "attention_mask to tell which positions count (regression targets cannot mark "
                    "ignored positions)"
                )
            return kept_positions(logits, attention_mask=self.attention_mask)
        mask, labels = self.attention_mask, self.labels
        if self.target_ids is not None:
            return answer_positions(
                logits, labels=labels, attention_mask=mask, causal_lm=self.shift
            )
        keep = kept_positions(logits, attention_mask=mask, labels=labels, shift=self.shift)
        assert keep is not None
        return keep

    def rows(
        self, logits: Tensor, keep: Tensor | None, num_classes: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The kept outputs ``[N, C]`` (row-major) and their labels (shifted with ``shift``), checked if ``N > 0``.

        The logits finite (``C = num_classes`` when given); the labels ``int64 [N]`` (classification) or
        ``[N, C]`` (regression), ``None`` without labels. Errors name no batch: the callers prefix it.
        """
        rows, labels = logits if keep is None else logits[keep], self.labels
        if labels is not None and keep is not None:
            if self.likelihood == "regression":
                if tuple(labels.shape[:2]) != tuple(keep.shape) or labels.ndim not in (2, 3):
                    raise ValueError(
                        f"regression targets of token-level outputs {tuple(logits.shape)} must have "
                        f"shape [B, T, C] or [B, T], got {tuple(labels.shape)}"
                    )
                labels = labels[keep]
            else:
                labels = (_shifted(labels, IGNORE_INDEX) if self.shift else labels)[keep]
        n, c = rows.shape
        if n == 0:  # nothing to check: the callers skip the batch
            return rows, labels
        if num_classes is not None and c != num_classes:
            raise ValueError(f"model outputs {c} logits but num_classes={num_classes}")
        check_finite(rows, "the model's logits are not finite")
        if labels is None:
            return rows, None
        check_type("labels", labels, Tensor, "a tensor")
        if self.likelihood == "classification":
            return rows, check_class_labels("labels", labels, n, c).long()
        if labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"regression targets must be real numbers, got dtype {labels.dtype}")
        y = labels[:, None] if labels.ndim == 1 and c == 1 else labels
        if tuple(y.shape) != (n, c):
            expected = f"[{n}, {c}]" + (f" or [{n}]" if c == 1 else "")
            raise ValueError(
                f"regression targets of shape {tuple(labels.shape)} do not match the model outputs: "
                f"expected {expected}"
            )
        check_finite(y, "regression targets are not finite")
        return rows, y


def read_batch(
    batch: Any,
    device: torch.device,
    *,
    likelihood: str,
    shift: bool,
    labels: bool = True,
    target_ids: Tensor | None = None,
) -> tuple[Tensor | dict[str, Any], Outputs]:
    """Model inputs on ``device`` and `Outputs` of a batch (examples labelled -100 dropped)."""
    b = split_batch(batch, device=device)
    y = b.labels if labels else None
    classes = y if likelihood == "classification" else None  # -100 marks an output left out
    none = classes is not None and not bool((classes != IGNORE_INDEX).any())
    outputs = Outputs(b.attention_mask, y, shift, likelihood, target_ids, none)
    if classes is not None and classes.ndim == 1 and target_ids is None:
        labelled = classes != IGNORE_INDEX
        if not bool(labelled.all()):
            return take_examples(b.inputs, outputs, labelled.nonzero().squeeze(1))
    return b.inputs, outputs


def position_plan(
    keep: Tensor | None, batch: int, device: torch.device
) -> list[tuple[Tensor | None, Tensor]]:
    """Rounds ``(positions [n], examples [n])`` of at most one kept position per example."""
    if keep is None:
        return [(None, torch.arange(batch, device=device))]
    rank = keep.cumsum(1) - 1  # the index of each kept position within its example
    rounds = int(keep.sum(1).max()) if keep.numel() else 0
    return [(t, b) for b, t in ((keep & (rank == r)).nonzero(as_tuple=True) for r in range(rounds))]


def take_examples(
    inputs: Tensor | dict[str, Any], outputs: Outputs, index: slice | Tensor
) -> tuple[Tensor | dict[str, Any], Outputs]:
    """The examples ``index`` of model inputs (tensors with the batch dimension) and of their `Outputs`."""
    part = take_inputs(inputs, index, batch_size(inputs))
    mask = part.get("attention_mask") if isinstance(part, dict) else None
    labels = None if outputs.labels is None else outputs.labels[index]
    return part, replace(outputs, attention_mask=mask, labels=labels)
