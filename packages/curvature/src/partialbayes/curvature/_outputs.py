"""Which outputs of a batch count: one per example (``[B, C]`` logits) or one per kept position (``[B, T, C]``).

Token-level logits (token classification, causal language models) count one output per kept position, in
row-major ``(b, t)`` order, as ``partialbayes.predictive.flatten_outputs`` does: a position is dropped where
the attention mask is 0 or the label is -100.

Causal language models (``shift_labels=True``): Hugging Face shifts the labels inside the model — the logits
at position ``t`` predict token ``t + 1`` and ``labels = input_ids`` is the usual batch. The same convention
is applied here, explicitly: with labels, the output at ``t`` is scored against ``labels[t + 1]`` and is kept
when the tokens ``t`` and ``t + 1`` are both real (attention mask 1) and ``labels[t + 1] != -100``; the last
position has no target and is dropped. Without labels (prediction), every real token ``t`` is kept, the last
one included (its output is the distribution of the token that would follow the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive import answer_positions, is_causal_lm, kept_positions
from partialbayes.predictive.internal import IGNORE_INDEX, batch_size, split_batch


def resolve_shift_labels(model: nn.Module, shift_labels: bool | None) -> bool:
    """``shift_labels`` as given (checked by `CurvatureOptions`), or (``None``) whether ``model`` is a causal LM."""
    return is_causal_lm(model) if shift_labels is None else shift_labels


def _shifted(t: Tensor, fill: int) -> Tensor:
    """``t[:, 1:]`` followed by one column of ``fill``: the value of position ``t + 1`` at ``t``."""
    return torch.cat([t[:, 1:], torch.full_like(t[:, :1], fill)], dim=1)


@dataclass(frozen=True)
class Outputs:
    """How the outputs of one batch are counted and labelled.

    Attributes:
        attention_mask: ``[B, T]`` mask of the real tokens, or ``None``.
        labels: The batch's labels as given (``[B]``, ``[B, C]``, ``[B, T]``, ``[B, T, C]``), or ``None``.
        shift: Causal-LM convention: the output at ``t`` is scored against ``labels[t + 1]``.
        likelihood: ``"classification"`` or ``"regression"`` (regression targets never mark ignored
            positions: only the attention mask does).
        target_ids: Answer-only outputs: the ``K`` logits kept (checked ids), at the answer positions
            (``partialbayes.predictive.answer_positions``); ``None``: every logit of every kept output.
    """

    attention_mask: Tensor | None
    labels: Tensor | None
    shift: bool
    likelihood: str
    target_ids: Tensor | None = None

    def ids(self, n_cls: int, device: torch.device) -> Tensor:
        """``[K]`` the logits whose Jacobians and covariances are computed: ``target_ids``, or all ``C``."""
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
        """``[B, T]`` bool mask of the kept positions of token-level logits; ``None`` for ``[B, C]`` logits.

        Raises:
            ValueError: Logits that are neither ``[B, C]`` nor ``[B, T, C]``; token-level logits with
                neither an attention mask nor labels; a mask or labels whose shape does not match;
                ``shift`` with ``[B, C]`` logits or with regression.
        """
        if logits.ndim == 2:
            if self.shift:
                raise ValueError(
                    "shift_labels=True is for token-level logits [B, T, C] (causal language models); "
                    f"the model returns logits of shape {tuple(logits.shape)}: pass shift_labels=False"
                )
            return None
        if logits.ndim != 3:
            raise ValueError(
                "model output must be logits of shape [B, C] (one output per example) or [B, T, C] "
                f"(one per token position), got {tuple(logits.shape)}"
            )
        if self.likelihood == "regression":
            if self.shift:
                raise ValueError(
                    "shift_labels=True (next-token prediction) needs likelihood='classification'"
                )
            if self.attention_mask is None:
                raise ValueError(
                    f"token-level regression outputs of shape {tuple(logits.shape)} need an "
                    "attention_mask to tell which positions count (regression targets cannot mark "
                    "ignored positions)"
                )
            return kept_positions(logits, attention_mask=self.attention_mask)
        if self.target_ids is not None:
            mask, labels = self.attention_mask, self.labels
            return answer_positions(
                logits, labels=labels, attention_mask=mask, causal_lm=self.shift
            )
        keep = kept_positions(
            logits, attention_mask=self.attention_mask, labels=self.labels, shift=self.shift
        )
        assert keep is not None
        return keep

    def targets(self, logits: Tensor, keep: Tensor | None) -> Tensor | None:
        """The labels of the kept outputs, or ``None`` without labels.

        Returns:
            The labels unchanged for ``[B, C]`` logits; for token-level logits the labels of the kept
            positions in row-major ``(b, t)`` order: ``[N]`` (classification, shifted when ``shift``) or
            ``[N, C]`` / ``[N]`` (regression targets ``[B, T, C]`` / ``[B, T]``).

        Raises:
            ValueError: Token-level regression targets whose leading dimensions are not ``[B, T]``.
        """
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
    """Split a batch (any kind `partialbayes.predictive.internal.split_batch` accepts) into model inputs and `Outputs`.

    Label -100 means "no label: skip this output" for sequence-level outputs too: the examples of a
    classification batch with labels ``[B]`` whose label is -100 are dropped here (examples do not interact
    in eval mode, so this equals dropping their outputs), which may leave none. ``labels=False``
    (prediction) ignores the labels: every real output counts. ``shift``, ``target_ids`` (answer-only: the
    labels only mark the answer positions, no example is dropped): see `Outputs`.

    Raises:
        TypeError: A batch of an unknown kind (the message names its type and the accepted ones).
        ValueError: An empty batch (0 examples).
    """
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
    """The output positions backpropagated together: at most one per example (examples do not interact).

    Returns:
        ``[(None, arange(B))]`` for ``[B, C]`` logits (``keep=None``); else for ``r = 0, 1, …`` the ``r``-th
        kept position of every example that has one, ``(positions t [n], examples [n])``: one round when
        each example has one answer, wherever it stands.
    """
    if keep is None:
        return [(None, torch.arange(batch, device=device))]
    rank = keep.cumsum(1) - 1  # the index of each kept position within its example
    rounds = int(keep.sum(1).max()) if keep.numel() else 0
    return [(t, b) for b, t in ((keep & (rank == r)).nonzero(as_tuple=True) for r in range(rounds))]


def take_examples(
    inputs: Tensor | dict[str, Any], outputs: Outputs, index: slice | Tensor
) -> tuple[Tensor | dict[str, Any], Outputs]:
    """The examples ``index`` (a slice or an index tensor) of model inputs and of their `Outputs`.

    Tensors of a mapping whose leading dimension is the batch size are indexed; other values are passed
    unchanged.

    Raises:
        ValueError: If the batch size of mapping inputs cannot be told (see ``batch_size``).
    """
    n = batch_size(inputs)
    part: Tensor | dict[str, Any]
    if isinstance(inputs, Tensor):
        part = inputs[index]
    else:
        part = {
            k: (v[index] if isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == n else v)
            for k, v in inputs.items()
        }
    mask = part.get("attention_mask") if isinstance(part, dict) else None
    labels = None if outputs.labels is None else outputs.labels[index]
    return part, replace(outputs, attention_mask=mask, labels=labels)


def split_chunks(
    inputs: Tensor | dict[str, Any], outputs: Outputs, chunk_size: int | None
) -> list[tuple[Tensor | dict[str, Any], Outputs]]:
    """Split model inputs and their `Outputs` into chunks of at most ``chunk_size`` examples (`take_examples`).

    The chunks' outputs, concatenated, are the batch's in row-major order.
    """
    if chunk_size is None:
        return [(inputs, outputs)]
    n = batch_size(inputs)
    return [
        take_examples(inputs, outputs, slice(i, i + chunk_size)) for i in range(0, n, chunk_size)
    ]
