"""The one interface every posterior family implements, and the helpers that sample-based families share."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from partialbayes.predictive._answers import answer_logits
from partialbayes.predictive._batch import eval_mode, is_causal_lm, model_logits, split_batch
from partialbayes.predictive._stream import mc_predict, mc_predict_regression
from partialbayes.predictive._validate import answer_only, check_int, check_type


@runtime_checkable
class Posterior(Protocol):
    """A posterior over a subset of a model's weights (the rest stay at their MAP values).

    Layout of weight samples: ``{param name: [n, k]}`` with the ``k`` stochastic entries of each parameter
    in ``Subset.gather`` order, parameters in ``subset.names`` order — the same for every family.

    Attributes:
        links: The ``link`` values `predict` accepts; the first is the default.
        model: The model whose weights the posterior is over (its current weights are the MAP outside
            `swapped`).
        subset: The ``partialbayes.selection.Subset`` of stochastic entries.
    """

    links: ClassVar[tuple[str, ...]]
    model: nn.Module
    subset: Any

    @property
    def num_floats(self) -> int:
        """Floats the posterior stores beyond the MAP weights."""
        ...

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` weight samples ``{param name: [n, k]}`` (same generator state, same samples)."""
        ...

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into the model; restore the MAP on exit, even on error."""
        ...

    def sampled(
        self, *, generator: torch.Generator | None = None
    ) -> AbstractContextManager[nn.Module]:
        """Draw one sample and swap it in (see `swapped`)."""
        ...

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Predictive for a batch of any kind, in eval mode, without gradients.

        Classification: probabilities of the logits' shape; regression: ``(mean, variance)`` with σ² in the
        variance. ``n_samples`` counts Monte Carlo samples where the link uses them; an unknown ``link`` is a
        ``ValueError`` listing `links`. ``target_ids``: the ``K`` answer tokens' renormalised distribution at the
        answer positions (`answer_positions`), ``[P, K]``.
        """
        ...

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """``n`` logit samples ``[n, B, C]`` (or ``[n, B, T, C]``; ``[n, P, K]`` with ``target_ids``)."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save as safetensors + JSON metadata (never pickle)."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> Posterior:
        """Load a saved posterior onto ``model``; refuse a model whose structure does not match."""
        ...


def rows(sample: Mapping[str, Tensor], i: int) -> dict[str, Tensor]:
    """Sample ``i`` of a batch of samples ``{name: [n, k]}``, as ``{name: [k]}``."""
    return {name: values[i] for name, values in sample.items()}


@contextmanager
def gradients_only(model: nn.Module, names: Iterable[str]) -> Iterator[nn.Module]:
    """Only the parameters ``names`` require gradients (backward stops below them); flags restored on exit."""
    keep = set(names)
    flags = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
    try:
        for n, p, _ in flags:
            p.requires_grad_(n in keep)
        yield model
    finally:
        for _, p, flag in flags:
            p.requires_grad_(flag)


class TrainerEvents:
    """Base of a ``transformers.TrainerCallback`` by duck typing: ``on_*`` events it does not define do nothing."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


SampleContext = Callable[[int], AbstractContextManager[Any]]


def _contexts(
    posterior: Posterior, generator: torch.Generator | None, sample_ctx: SampleContext | None
) -> SampleContext:
    if sample_ctx is not None:
        return check_type("sample_ctx", sample_ctx, Callable, "callable (s -> context)")
    return lambda s: posterior.sampled(generator=generator)


def _forward(
    model: nn.Module, batch: Any, target_ids: Sequence[int] | Tensor | None, causal_lm: bool | None
) -> Callable[[], Tensor]:
    """The model's logits on ``batch`` under its current weights, or their answer-only ``[P, K]`` part."""
    b = split_batch(batch, device=next(model.parameters()).device)
    if target_ids is None:
        return lambda: model_logits(model, b.inputs)
    shift = is_causal_lm(model) if causal_lm is None else causal_lm
    return lambda: answer_logits(
        model_logits(model, b.inputs),
        target_ids,
        labels=b.labels,
        attention_mask=b.attention_mask,
        causal_lm=shift,
    )


def sampled_logits(
    posterior: Posterior,
    batch: Any,
    n: int,
    *,
    generator: torch.Generator | None = None,
    sample_ctx: SampleContext | None = None,
    target_ids: Sequence[int] | Tensor | None = None,
    causal_lm: bool | None = None,
) -> Tensor:
    """Logits under ``n`` weight samples of ``posterior``, stacked: ``[n, *logits shape]`` (eval mode, no gradients).

    Samples are swapped in one at a time with ``posterior.sampled(generator=generator)`` (the MAP restored
    after each); every module's mode is restored afterwards.

    Args:
        posterior: Any `Posterior`.
        batch: A batch in any accepted form (labels only mark the answers of ``target_ids``).
        n: Number of weight samples.
        generator: Source of randomness (same seed, same logits).
        sample_ctx: ``s -> context manager`` that swaps sample ``s`` in, used instead of
            ``posterior.sampled`` (a family's own options, e.g. SWAG's ``scale``, or stratified mixtures);
            it must restore the weights on exit.
        target_ids: Answer-only: the ``K`` answer tokens, whose logits are kept at the answer positions
            only (`answer_logits`, sample by sample: ``[n, B, T, V]`` is never held).
        causal_lm: Whether labels are shifted to find the answers (``None``: `is_causal_lm` of the model).

    Returns:
        ``[n, B, C]`` (or ``[n, B, T, C]``) logits; ``[n, P, K]`` with ``target_ids``.
    """
    check_int("n", n)
    model = posterior.model
    forward = _forward(model, batch, target_ids, causal_lm)
    ctx = _contexts(posterior, generator, sample_ctx)
    outs = []
    with torch.no_grad(), eval_mode(model):
        for s in range(n):
            with ctx(s):
                outs.append(forward())
    return torch.stack(outs)


def sampled_predict(
    posterior: Posterior,
    batch: Any,
    n: int,
    *,
    generator: torch.Generator | None = None,
    sample_ctx: SampleContext | None = None,
    regression: bool = False,
    noise_var: float | Tensor = 0.0,
    target_ids: Sequence[int] | Tensor | None = None,
    causal_lm: bool | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Monte Carlo predictive over ``n`` weight samples, streaming (`mc_predict`; one sample at a time).

    Classification: ``(1/n) Σ_s softmax(f(x; w_s))``. Regression: the mean of the outputs and their variance
    (``1/n`` normaliser) plus ``noise_var``. Eval mode, no gradients, at least float32 accumulation.

    Args:
        posterior: Any `Posterior`.
        batch: A batch in any accepted form (labels only mark the answers of ``target_ids``).
        n: Number of weight samples.
        generator: Source of randomness.
        sample_ctx: ``s -> context manager`` swapping sample ``s`` in (see `sampled_logits`).
        regression: Gaussian-likelihood outputs instead of class logits.
        noise_var: Observation noise variance σ² added to the regression variance.
        target_ids: Answer-only (classification): the distribution over the ``K`` answer tokens at the
            answer positions, the softmax renormalised over them.
        causal_lm: Whether labels are shifted to find the answers (``None``: detected).

    Returns:
        Probabilities of the logits' shape (``[P, K]`` with ``target_ids``), or ``(mean, variance)``.

    Raises:
        ValueError: ``target_ids`` with ``regression``, or repeated / out-of-range ``target_ids``.
    """
    check_int("n", n)
    answer_only(target_ids, regression)
    model = posterior.model
    forward = _forward(model, batch, target_ids, causal_lm)
    ctx = _contexts(posterior, generator, sample_ctx)
    with eval_mode(model):
        if regression:
            out = mc_predict_regression(ctx, forward, n, noise_var=noise_var)
            return out.mean, out.var
        return mc_predict(ctx, forward, n).probs
