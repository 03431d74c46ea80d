"""Which outputs of a batch count: one per example (``[B, C]``) or per kept position (``[B, T, C]``, row-major)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive import answer_positions, is_causal_lm, kept_positions
from partialbayes.predictive.internal import IGNORE_INDEX, batch_size, split_batch, take_inputs


def resolve_shift_labels(model: nn.Module, shift_labels: bool | None) -> bool:
    """``shift_labels`` as given (checked by `CurvatureOptions`), or (``None``) whether ``model`` is a causal LM."""
    return is_causal_lm(model) if shift_labels is None else shift_labels


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

    def ids(self, n_cls: int, device: torch.device) -> Tensor:
        """``[K]`` the logits computed: ``target_ids``, or all ``C``."""
        if self.target_ids is None:
            return torch.arange(n_cls, device=device)
        return self.target_ids.to(device)

    @property
    def unlabelled(self) -> bool:
        """Whether the batch has classification labels and none but -100 (no labelled output)."""
        return (
            self.labels is not None
            and self.likelihood == "classification"
            and not bool((self.labels != IGNORE_INDEX).any())
        )

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

    def targets(self, logits: Tensor, keep: Tensor | None) -> Tensor | None:
        """The labels of the kept outputs, row-major (shifted with ``shift``), or ``None``."""
        labels = self.labels
        if labels is None or keep is None:
            return labels
        if self.likelihood == "regression":
            if tuple(labels.shape[:2]) != tuple(keep.shape) or labels.ndim not in (2, 3):
                raise ValueError(
                    f"regression targets of token-level outputs {tuple(logits.shape)} must have shape "
                    f"[B, T, C] or [B, T], got {tuple(labels.shape)}"
                )
            return labels[keep]
        if self.shift:
            labels = _shifted(labels, IGNORE_INDEX)
        return labels[keep]


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
    outputs = Outputs(b.attention_mask, y, shift, likelihood, target_ids)
    if y is not None and likelihood == "classification" and y.ndim == 1 and target_ids is None:
        labelled = y != IGNORE_INDEX
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


def split_chunks(
    inputs: Tensor | dict[str, Any], outputs: Outputs, chunk_size: int | None
) -> list[tuple[Tensor | dict[str, Any], Outputs]]:
    """Model inputs and `Outputs` in chunks of at most ``chunk_size`` examples, in row order."""
    if chunk_size is None:
        return [(inputs, outputs)]
    n = batch_size(inputs)
    return [
        take_examples(inputs, outputs, slice(i, i + chunk_size)) for i in range(0, n, chunk_size)
    ]
