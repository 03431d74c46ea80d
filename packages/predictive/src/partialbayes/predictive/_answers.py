"""Answer-only predictions: the ``[P, K]`` logits of the ``K`` answer tokens (``target_ids``) at the answer positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from partialbayes.predictive._batch import kept_positions


def check_target_ids(target_ids: Sequence[int] | Tensor, num_outputs: int) -> Tensor:
    """``target_ids`` as an ``int64`` tensor ``[K]`` of distinct indices in ``[0, num_outputs)``."""
    try:
        ids = torch.as_tensor(target_ids)
    except (TypeError, ValueError, RuntimeError):  # not numbers: refused below
        ids = None
    if ids is not None and (ids.ndim != 1 or ids.numel() == 0):
        raise ValueError(f"target_ids must be a non-empty 1-D list of ids, got {target_ids!r}")
    if ids is None or ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.is_complex():
        raise TypeError(f"target_ids must be integer token ids, got {target_ids!r}")
    bad = ids[(ids < 0) | (ids >= num_outputs)]
    if bad.numel():
        raise ValueError(
            f"target_ids: {int(bad[0])} is out of range for a model with {num_outputs} outputs"
        )
    uniq, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"target_ids: {int(uniq[counts > 1][0])} is repeated; give each id once")
    return ids.long()


def answer_positions(
    logits: Tensor,
    *,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    causal_lm: bool = False,
) -> Tensor | None:
    """``[B, T]`` bool mask of the positions whose outputs are answers (``None`` for ``[B, C]`` logits).

    With labels: the positions they mark (label not -100), shifted for a causal LM (the output at ``t``
    predicts token ``t + 1``, so the answer is read at the token before it). Without labels: the last real
    position of each sequence (attention mask; either padding side) — the next-token prediction after a
    prompt.

    Raises:
        ValueError: A sequence without any real token, or a mask / labels of the wrong shape.
    """
    if logits.ndim != 3 or labels is not None:
        return kept_positions(logits, attention_mask=attention_mask, labels=labels, shift=causal_lm)
    b, t = logits.shape[:2]
    real = torch.ones(b, t, dtype=torch.bool, device=logits.device)
    if attention_mask is not None:
        real = kept_positions(logits, attention_mask=attention_mask)
    if not bool(real.any(1).all()):
        raise ValueError("attention_mask: a sequence has no real token, hence no answer position")
    last = t - 1 - real.flip(1).int().argmax(1)
    return torch.arange(t, device=real.device)[None] == last[:, None]


def answer_index(
    logits: Tensor,
    target_ids: Sequence[int] | Tensor,
    *,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    causal_lm: bool = False,
) -> tuple[Tensor, ...]:
    """(example, position, token) index tensors broadcasting to ``[P, K]``: ``logits[index]`` is `answer_logits`."""
    ids = check_target_ids(target_ids, logits.shape[-1]).to(logits.device)
    keep = answer_positions(
        logits, labels=labels, attention_mask=attention_mask, causal_lm=causal_lm
    )
    every = (torch.arange(logits.shape[0], device=ids.device),)
    rows = every if keep is None else keep.nonzero(as_tuple=True)
    return (*(r[:, None] for r in rows), ids[None])


def answer_logits(
    logits: Tensor,
    target_ids: Sequence[int] | Tensor,
    *,
    labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    causal_lm: bool = False,
) -> Tensor:
    """The logits of the answer tokens at the answer positions, ``[P, K]``.

    ``logits`` are ``[B, T, V]`` (or ``[B, V]``: every row is an answer), ``target_ids`` the ``K`` distinct
    answer tokens; ``labels``, ``attention_mask`` and ``causal_lm`` find the answers as in `answer_positions`;
    the ``P`` answer positions come in row-major ``(b, t)`` order. ``softmax(-1)`` of it is the answer's
    distribution renormalised over the ``K`` tokens.
    """
    mask = attention_mask
    return logits[
        answer_index(logits, target_ids, labels=labels, attention_mask=mask, causal_lm=causal_lm)
    ]
