"""The one interface every posterior family implements, and the helpers that sample-based families share.

``predictive`` defines the protocol but never imports a posterior class: Laplace (``curvature``), SWAG,
IVON and the sampling-based linearised Laplace (``linear_sampling``) each implement it, so a user switches
family by changing the line that builds the posterior.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from partialbayes.predictive._batch import model_logits, split_batch


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
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Predictive for a batch (labels in it are ignored).

        Classification: probabilities with the logits' shape, ``[B, C]`` or ``[B, T, C]``. Regression:
        ``(mean, variance)`` of the predictive, each ``[B, C]``.
        """
        ...

    def predictive_samples(
        self, batch: Any, n: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``n`` logit samples ``[n, B, C]`` (or ``[n, B, T, C]``) for a batch."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save as safetensors + JSON metadata (never pickle)."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> Posterior:
        """Load a saved posterior onto ``model``; refuse a model whose structure does not match."""
        ...


def resolve_link(link: str | None, offered: Sequence[str], family: str) -> str:
    """The link to use: ``offered[0]`` for ``None``, else ``link`` if the family offers it.

    Raises:
        ValueError: If ``link`` is not one of ``offered`` (the message lists them).
    """
    if link is None:
        return offered[0]
    if link not in offered:
        raise ValueError(
            f"{family}.predict: link={link!r} is not offered; {family} offers {tuple(offered)}"
        )
    return link


def check_count(name: str, n: object) -> int:
    """A positive ``int`` (bools refused), else a ``ValueError`` naming ``name``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def rows(sample: Mapping[str, Tensor], i: int) -> dict[str, Tensor]:
    """Sample ``i`` of a batch of samples ``{name: [n, k]}``, as ``{name: [k]}``."""
    return {name: values[i] for name, values in sample.items()}


def sampled_logits(
    posterior: Posterior,
    batch: Any,
    n: int,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Logits of the model under ``n`` weight samples of ``posterior``, stacked: ``[n, *logits shape]``.

    The samples are drawn with one ``posterior.sample(n, generator=...)`` call and swapped in one at a time
    (the MAP is restored afterwards). Runs without gradients, with the model's mode left as it is (put the
    model in eval mode to switch dropout off).

    Args:
        posterior: Any `Posterior`.
        batch: A batch in any accepted form (labels are ignored).
        n: Number of weight samples.
        generator: Source of randomness (same seed, same logits).

    Returns:
        ``[n, B, C]`` (or ``[n, B, T, C]``) logits.
    """
    check_count("n", n)
    device = next(posterior.model.parameters()).device
    inputs = split_batch(batch, device=device).inputs
    draws = posterior.sample(n, generator=generator)
    outs = []
    with torch.no_grad():
        for i in range(n):
            with posterior.swapped(rows(draws, i)) as model:
                outs.append(model_logits(model, inputs))
    return torch.stack(outs)
