"""Batches, logits and the output-space vectors whose backward passes give the curvature factors.

Every fisher type is expressed as ``S`` backward passes of the logits with cotangents ``v_s`` (``[S, B, C]``):
the curvature is ``Σ_n Σ_s J_nᵀ v_{s,n} v_{s,n}ᵀ J_n``.

* classification, ``exact``: the lossless factorisation of the softmax Hessian
  ``diag(p) - p pᵀ = M Mᵀ`` with columns ``m_c = √p_c (e_c - p)``: ``S = C``.
* classification, ``mc``: ``v_s = (p - e_{y_s}) / √k`` with ``y_s ~ Cat(p)``: ``S = k``.
* classification, ``empirical``: ``v = p - e_y`` (true labels): ``S = 1``.
* regression (Gaussian, ``sigma_noise`` σ): ``exact`` ``v_d = e_d / σ`` (``S = D``); ``mc``
  ``v_s = ε_s / (σ √k)``; ``empirical`` ``v = (f - y) / σ²``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

LIKELIHOODS = ("classification", "regression")
FISHERS = ("exact", "mc", "empirical")


def check_options(
    likelihood: str, fisher: str, mc_samples: int, sigma_noise: float, sharing: str = "reduce"
) -> None:
    """Validate the shared keyword options of the curvature functions.

    Raises:
        ValueError: Naming the option at fault.
    """
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
    if fisher not in FISHERS:
        raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
    if sharing not in ("reduce", "expand"):
        raise ValueError(f"sharing must be 'reduce' or 'expand', got {sharing!r}")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
    if not (
        isinstance(sigma_noise, (int, float)) and math.isfinite(sigma_noise) and sigma_noise > 0
    ):
        raise ValueError(f"sigma_noise must be a positive finite number, got {sigma_noise!r}")


def model_device(model: nn.Module) -> torch.device:
    """Device of the model's first parameter (cpu for a parameterless model)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) else value


def split_batch(batch: Any, device: torch.device) -> tuple[Any, Tensor | None, Tensor | None]:
    """Split a batch into ``(inputs, labels | None, attention_mask | None)`` on ``device``.

    Accepted: a tensor ``x``; a pair ``(x, y)``; a Hugging Face dict (``"labels"`` optional,
    ``"attention_mask"`` marks the real tokens).

    Raises:
        TypeError: If the batch is of another kind.
    """
    if isinstance(batch, dict):
        inputs = {k: _to(v, device) for k, v in batch.items() if k != "labels"}
        labels = _to(batch.get("labels"), device)
        mask = inputs.get("attention_mask")
        return inputs, labels, mask
    if isinstance(batch, Tensor):
        return batch.to(device), None, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], Tensor):
        return batch[0].to(device), _to(batch[1], device), None
    raise TypeError(
        "batch must be a tensor x, a pair (x, y) or a dict with model inputs (and 'labels'), "
        f"got {type(batch).__name__}"
    )


def logits_of(model: nn.Module, inputs: Any) -> Tensor:
    """Call ``model`` on ``inputs`` (tensor or keyword dict) and return its logits."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, Tensor):
        raise TypeError(f"model output has no logits tensor: got {type(out).__name__}")
    return logits


def forward_logits(model: nn.Module, batch: Any) -> Tensor:
    """Logits of ``model`` on a batch.

    Args:
        model: The network.
        batch: A tensor ``x`` or pair ``(x, y)`` (calls ``model(x)``) or a Hugging Face dict
            (calls ``model(**inputs).logits`` with the ``"labels"`` key excluded).

    Returns:
        The logits, ``[B, C]`` for a classifier.
    """
    inputs, _, _ = split_batch(batch, model_device(model))
    return logits_of(model, inputs)


def check_logits(logits: Tensor, num_classes: int | None, batch_index: int) -> None:
    """Logits must be ``[B, C]`` (with ``C == num_classes`` when given) and finite.

    Raises:
        ValueError: Naming the batch and the shape at fault.
    """
    if logits.ndim != 2:
        raise ValueError(
            f"batch {batch_index}: model output must be logits of shape [B, C], got {tuple(logits.shape)}"
        )
    if num_classes is not None and logits.shape[1] != num_classes:
        raise ValueError(
            f"batch {batch_index}: model outputs {logits.shape[1]} logits but num_classes={num_classes}"
        )
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"batch {batch_index}: the model's logits are not finite")


def check_labels(labels: Tensor, logits: Tensor, likelihood: str, batch_index: int) -> Tensor:
    """Validate one batch's labels against its logits ``[B, C]``; the one check every entry point uses.

    Classification: integer class indices of shape ``[B]`` in ``[0, C)``. Regression: real targets of shape
    ``[B, C]`` (or ``[B]`` when ``C == 1``).

    Args:
        labels: The batch's labels (on the device of ``logits``).
        logits: The model's logits ``[B, C]`` for the batch.
        likelihood: ``"classification"`` or ``"regression"``.
        batch_index: Position of the batch in its loader (named in the error).

    Returns:
        The labels as the likelihood uses them: ``int64 [B]`` (classification) or ``[B, C]`` in their own
        dtype (regression; no precision is lost before the training loss is computed).

    Raises:
        TypeError: If ``labels`` is not a tensor.
        ValueError: Naming the batch and the problem: wrong dtype, wrong shape, labels out of range,
            non-finite regression targets.
    """
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"batch {batch_index}: labels must be a tensor, got {type(labels).__name__}"
        )
    b, c = logits.shape
    if likelihood == "classification":
        if labels.dtype.is_floating_point or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(
                f"batch {batch_index}: classification labels must be integer class indices, "
                f"got dtype {labels.dtype}"
            )
        if tuple(labels.shape) != (b,):
            raise ValueError(
                f"batch {batch_index}: classification labels must have shape [{b}] (one class per "
                f"example), got {tuple(labels.shape)}"
            )
        if b > 0:
            lo, hi = int(labels.min()), int(labels.max())
            if lo < 0 or hi >= c:
                raise ValueError(
                    f"batch {batch_index}: labels out of range [0, {c}): min {lo}, max {hi}"
                )
        return labels.long()
    if labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"batch {batch_index}: regression targets must be real numbers, got dtype {labels.dtype}"
        )
    y = labels[:, None] if labels.ndim == 1 and c == 1 else labels
    if tuple(y.shape) != (b, c):
        expected = f"[{b}, {c}]" + (f" or [{b}]" if c == 1 else "")
        raise ValueError(
            f"batch {batch_index}: regression targets of shape {tuple(labels.shape)} do not match the "
            f"model outputs: expected {expected}"
        )
    if not bool(torch.isfinite(y).all()):
        raise ValueError(f"batch {batch_index}: regression targets are not finite")
    return y


def _require_labels(labels: Tensor | None, batch_index: int) -> Tensor:
    if labels is None:
        raise ValueError(
            f"batch {batch_index}: fisher='empirical' needs labels, the batch has none"
        )
    return labels


def output_vectors(
    logits: Tensor,
    labels: Tensor | None,
    *,
    likelihood: str,
    fisher: str,
    mc_samples: int,
    sigma_noise: float,
    generator: torch.Generator | None,
    batch_index: int,
) -> Tensor:
    """Cotangents ``[S, B, C]`` of the backward passes for one batch (see the module docstring).

    The curvature of the batch's summed negative log-likelihood is ``Σ_s J_nᵀ v_s v_sᵀ J_n``.

    Args:
        logits: ``[B, C]``.
        labels: The batch's labels as returned by `check_labels`, or ``None``; used by
            ``fisher="empirical"`` only.
        likelihood: ``"classification"`` or ``"regression"``.
        fisher: ``"exact"``, ``"mc"`` or ``"empirical"``.
        mc_samples: ``k`` for ``fisher="mc"``.
        sigma_noise: Regression noise ``σ``.
        generator: Random generator for ``fisher="mc"`` (its device may differ from the logits').
        batch_index: Position of the batch in its loader (named in errors).

    Raises:
        ValueError: ``fisher="empirical"`` on a batch without labels.
    """
    f = logits.detach()
    b, c = f.shape
    eye = torch.eye(c, dtype=f.dtype, device=f.device)
    if likelihood == "classification":
        p = torch.softmax(f, dim=-1)
        if fisher == "exact":
            # m_c = √p_c (e_c - p)  for every example:  [C, B, C]
            return p.sqrt().T[:, :, None] * (eye[:, None, :] - p[None])
        if fisher == "empirical":
            y = _require_labels(labels, batch_index)
            return (p - eye[y])[None]
        dev = generator.device if generator is not None else p.device
        ys = torch.multinomial(p.to(dev), mc_samples, replacement=True, generator=generator)
        ys = ys.to(p.device).T  # [k, B]
        return (p[None] - eye[ys]) / math.sqrt(mc_samples)
    s = float(sigma_noise)
    if fisher == "exact":
        return eye[:, None, :].expand(c, b, c) / s
    if fisher == "empirical":
        y = _require_labels(labels, batch_index).to(f.dtype)
        return ((f - y) / s**2)[None]
    dev = generator.device if generator is not None else f.device
    eps = torch.randn((mc_samples, b, c), generator=generator, dtype=f.dtype, device=dev)
    return eps.to(f.device) / (s * math.sqrt(mc_samples))
