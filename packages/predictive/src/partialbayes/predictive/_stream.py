"""Streaming Monte Carlo over sampled forward passes, holding only running sums."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from partialbayes.predictive._decomposition import Uncertainty, entropy
from partialbayes.predictive._validate import check_int, check_nonneg, check_tensor, check_type

SampleContext = Callable[[int], AbstractContextManager[object]]


@dataclass(frozen=True)
class MCPrediction:
    """Result of [`mc_predict`][partialbayes.predictive.mc_predict].

    Attributes:
        probs: Predictive probabilities ``(1/S) Σ_s softmax(f_s)``, ``[..., C]``.
        uncertainty: Entropy decomposition, fields of shape ``[...]``.
        n_samples: ``S``.
    """

    probs: Tensor
    uncertainty: Uncertainty
    n_samples: int


@dataclass(frozen=True)
class MCRegression:
    """Result of [`mc_predict_regression`][partialbayes.predictive.mc_predict_regression].

    Attributes:
        mean: Predictive mean ``(1/S) Σ_s m_s``.
        var: Predictive variance (law of total variance), equal to ``uncertainty.total``.
        uncertainty: ``aleatoric`` = mean noise variance, ``epistemic`` = variance of the means.
        n_samples: ``S``.
    """

    mean: Tensor
    var: Tensor
    uncertainty: Uncertainty
    n_samples: int


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _checked_output(out: object, s: int, shape: torch.Size | None) -> Tensor:
    x = check_tensor(f"forward() output (sample {s})", out)
    if shape is not None and x.shape != shape:
        raise ValueError(
            f"forward() returned shape {tuple(x.shape)} at sample {s}, "
            f"but {tuple(shape)} at sample 0"
        )
    return x


def mc_predict(
    sample_ctx: SampleContext, forward: Callable[[], Tensor], n_samples: int, *, grad: bool = False
) -> MCPrediction:
    """Average the softmax over ``S`` sampled forward passes, streaming (the ``S`` logits are never held together).

    For ``s = 0..S−1`` it enters ``sample_ctx(s)`` (which puts sampled weights in place) and calls
    ``forward()`` for logits ``[..., C]``. Example::

        g = torch.Generator().manual_seed(0)
        pred = mc_predict(lambda s: posterior.sampled(generator=g), lambda: model(x), 32)

    Args:
        sample_ctx: Factory ``s -> context manager``; each context applies one weight sample
            and must restore the weights on exit.
        forward: Zero-argument callable returning logits ``[..., C]`` under the current weights.
        n_samples: ``S ≥ 1``.
        grad: Keep autograd enabled (default: run under ``torch.no_grad()``).

    Returns:
        An [`MCPrediction`][partialbayes.predictive.MCPrediction] with the predictive and the
        total / aleatoric / epistemic decomposition.

    Raises:
        ValueError: If ``n_samples`` is invalid, or a forward output is non-finite or changes shape.
        TypeError: If ``sample_ctx`` or ``forward`` is not callable.
    """
    _check_callables(sample_ctx, forward)
    check_int("n_samples", n_samples)
    sum_p: Tensor | None = None
    sum_h: Tensor | None = None
    shape = None
    with torch.no_grad() if not grad else nullcontext():
        for s in range(n_samples):
            with sample_ctx(s):
                logits = _checked_output(forward(), s, shape)
            shape = logits.shape
            log_p = torch.log_softmax(logits.to(_acc_dtype(logits)), dim=-1)
            p, h = log_p.exp(), entropy(log_p)
            sum_p = p if sum_p is None else sum_p + p
            sum_h = h if sum_h is None else sum_h + h
    assert sum_p is not None
    assert sum_h is not None
    probs = sum_p / n_samples
    total = -torch.where(probs > 0, probs * probs.log(), torch.zeros_like(probs)).sum(-1)
    aleatoric = sum_h / n_samples
    epistemic = (total - aleatoric).clamp_min(0.0)
    return MCPrediction(probs, Uncertainty(total, aleatoric, epistemic), n_samples)


def mc_predict_regression(
    sample_ctx: SampleContext,
    forward: Callable[[], Tensor | tuple[Tensor, Tensor]],
    n_samples: int,
    *,
    noise_var: Tensor | float | None = None,
    grad: bool = False,
) -> MCRegression:
    """Streaming regression predictive over ``S`` sampled forward passes (Welford updates).

    Args:
        sample_ctx: Factory ``s -> context manager`` applying one weight sample.
        forward: Returns predicted means ``[...]``, or a pair ``(mean, noise variance)``.
        n_samples: ``S ≥ 1``.
        noise_var: Homoscedastic observation noise added to the aleatoric part (when ``forward``
            returns only means).
        grad: Keep autograd enabled.

    Returns:
        An [`MCRegression`][partialbayes.predictive.MCRegression].
    """
    _check_callables(sample_ctx, forward)
    check_int("n_samples", n_samples)
    mean: Tensor | None = None
    m2: Tensor | None = None
    sum_v: Tensor | None = None
    shape = None
    with torch.no_grad() if not grad else nullcontext():
        for s in range(n_samples):
            with sample_ctx(s):
                out = forward()
            var_s = None
            if isinstance(out, tuple):
                if len(out) != 2:
                    raise ValueError("forward() must return a tensor or a (mean, var) pair")
                out, var_s = out
            m_s = _checked_output(out, s, shape)
            shape = m_s.shape
            m_s = m_s.to(_acc_dtype(m_s))
            if var_s is not None:
                v = check_nonneg(f"forward() variance (sample {s})", var_s).to(m_s.dtype)
                sum_v = v if sum_v is None else sum_v + v
            if mean is None or m2 is None:
                mean, m2 = m_s.clone(), torch.zeros_like(m_s)
            else:
                delta = m_s - mean
                mean = mean + delta / (s + 1)
                m2 = m2 + delta * (m_s - mean)
    assert mean is not None
    assert m2 is not None
    aleatoric = torch.zeros_like(mean) if sum_v is None else sum_v / n_samples
    if noise_var is not None:
        aleatoric = aleatoric + check_nonneg(
            "noise_var", torch.as_tensor(noise_var, dtype=mean.dtype, device=mean.device)
        )
    epistemic = m2 / n_samples
    total = aleatoric + epistemic
    return MCRegression(mean, total, Uncertainty(total, aleatoric, epistemic), n_samples)


def _check_callables(sample_ctx: object, forward: object) -> None:
    check_type("sample_ctx", sample_ctx, Callable, "callable (s -> context manager)")
    check_type("forward", forward, Callable, "a zero-argument callable")
