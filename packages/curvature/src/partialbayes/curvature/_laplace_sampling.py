"""Weight samples of a Laplace posterior and swapping them into the model (the MAP restored on exit)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._caller import user_stacklevel
from partialbayes.curvature._laplace_core import LaplaceCore
from partialbayes.predictive import check_count, check_generator, check_sample


class LaplaceSampling(LaplaceCore):
    """``θ ~ N(θ*, P⁻¹)`` on the subset, and the model carrying a sample (part of `LaplaceBase`)."""

    def sample(
        self,
        n: int = 1,
        *args: torch.Generator | None,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """Draw weight samples ``θ ~ N(θ*, P⁻¹)`` of the subset.

        Args:
            n: Number of samples.
            *args: Deprecated: the generator given positionally (``sample(n, gen)``); pass
                ``generator=gen`` instead. Still accepted, with a ``DeprecationWarning``, for one minor
                version.
            generator: Source of randomness (on the model's device or the CPU); same seed, same samples.

        Returns:
            ``{param name: [n, k]}`` with the ``k`` entries of each parameter in ``subset.gather`` order,
            parameters in ``subset.names`` order.

        Raises:
            ValueError: If ``n`` is not a positive int.
            TypeError: If the generator is not a ``torch.Generator``, is given twice, or with more than
                one extra positional argument.
        """
        generator = check_generator(_generator_argument("sample", args, generator))
        self._require_fit()
        n = check_count("n", n)
        centered = self._sample_centered(n, generator)
        return {name: self._map[name] + centered[name] for name in self.subset.names}

    def _noise(self, shape: Sequence[int], generator: torch.Generator | None) -> Tensor:
        device = generator.device if generator is not None else self.device
        eps = torch.randn(*shape, generator=generator, dtype=self.dtype, device=device)
        return eps.to(self.device)

    @contextmanager
    def swapped(self, sample: Mapping[str, Tensor]) -> Iterator[nn.Module]:
        """Write one weight sample into the model; restore the MAP weights on exit, even on error.

        Args:
            sample: ``{param name: [k]}`` (or ``[1, k]``) for every parameter of the subset, e.g. one row of
                `sample`.

        Yields:
            The model, carrying the sample.

        Raises:
            TypeError: If ``sample`` is not a mapping of tensors.
            ValueError: If it does not cover the subset exactly, a value has the wrong size, or holds
                NaN or inf (the parameter is named; the model is left untouched).
        """
        self._require_fit()
        one = check_sample(self.subset, sample)
        params = dict(self.model.named_parameters())
        try:
            with torch.no_grad():
                for name, values in one.items():
                    p = params[name]
                    p.copy_(self.subset.scatter(name, values, p.detach()))
            yield self.model
        finally:
            with torch.no_grad():
                for name in self.subset.names:
                    p = params[name]
                    p.copy_(self.subset.scatter(name, self._map[name], p.detach()))

    @contextmanager
    def sampled(
        self, *args: torch.Generator | None, generator: torch.Generator | None = None
    ) -> Iterator[nn.Module]:
        """Draw one sample and swap it into the model (see `swapped`); the MAP is restored on exit.

        Args:
            *args: Deprecated: the generator given positionally; pass ``generator=`` (a
                ``DeprecationWarning`` for one minor version).
            generator: Source of randomness.

        Yields:
            The model, carrying the sample.
        """
        generator = _generator_argument("sampled", args, generator)
        one = {k: v[0] for k, v in self.sample(1, generator=generator).items()}
        with self.swapped(one) as model:
            yield model


def _generator_argument(
    method: str, args: tuple[Any, ...], generator: torch.Generator | None
) -> torch.Generator | None:
    """The generator of `sample` / `sampled`, accepting the deprecated positional form with a warning."""
    if not args:
        return generator
    if len(args) > 1 or generator is not None:
        raise TypeError(
            f"{method}() takes the generator once, as the keyword generator=; got {len(args)} extra "
            f"positional argument(s){' and generator=' if generator is not None else ''}"
        )
    warnings.warn(
        f"passing the generator to {method}() positionally is deprecated and will be removed in the "
        f"next minor version; use {method}(..., generator=...)",
        DeprecationWarning,
        stacklevel=user_stacklevel(),
    )
    return args[0]
