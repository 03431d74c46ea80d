"""A posterior given by stored weight samples of a subset: SGMCMC draws, or the last states of parallel chains."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.predictive import sampled_logits, sampled_predict
from partialbayes.predictive.internal import (
    check_finite,
    check_generator,
    check_int,
    check_likelihood,
    read_posterior_file,
    resolve_link,
    rows,
    write_posterior_file,
)
from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset

FORMAT, VERSION = "partialbayes.sgmcmc.SampledPosterior", 1
_FIELDS = {"subset": str, "likelihood": str, "sigma_noise": (int, float)}


class SampledPosterior:
    """The empirical distribution of ``S`` stored samples of a subset's entries (``partialbayes.predictive.Posterior``).

    What `SGMCMC.posterior` and `parallel_chains` return (`concat` joins posteriors). `sample` draws stored
    samples uniformly with replacement; `predict` with ``n_samples=None`` averages over every stored sample once.

    Args:
        model: The model the samples belong to.
        subset: The ``partialbayes.selection.Subset`` the samples fill.
        samples: ``{param name: [S, k]}`` for every parameter of the subset (``subset.gather`` order).
        likelihood: ``"classification"`` (`predict` returns probabilities) or ``"regression"`` (the mean
            and variance of the outputs plus ``sigma_noise²``).
        sigma_noise: Observation noise of the regression likelihood.

    Raises:
        TypeError: A subset that is not a ``Subset``, samples that are not a mapping of tensors.
        ValueError: Samples that do not cover the subset, disagree in ``S`` or hold NaN / inf; a subset that
            does not fit the model; a bad likelihood or noise.
    """

    links: ClassVar[tuple[str, ...]] = ("mc",)

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        samples: Mapping[str, Tensor],
        *,
        likelihood: str = "classification",
        sigma_noise: float = 1.0,
    ) -> None:
        check_subset(subset)
        self.sigma_noise = check_likelihood(likelihood, sigma_noise)
        self.likelihood, self.model, self.subset = likelihood, model, subset
        params = subset.parameters_of(model)
        if not isinstance(samples, Mapping) or any(
            not isinstance(v, Tensor) or v.ndim != 2 for v in samples.values()
        ):
            raise TypeError("samples must be a mapping {param name: [S, k] tensor}")
        sizes = {int(v.shape[0]) for v in samples.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"samples must share one number S >= 1 of rows, got {sorted(sizes)}")
        subset.check_values(rows(samples, 0), what="samples")  # coverage and sizes
        for name, v in samples.items():
            check_finite(v, f"samples hold NaN or inf entries in {name!r}")
        self.samples = {n: samples[n].to(params[n].device) for n in subset.names}

    @property
    def num_samples(self) -> int:
        """Number ``S`` of stored samples."""
        return int(next(iter(self.samples.values())).shape[0])

    @property
    def num_floats(self) -> int:
        """Floats stored: ``S·d``."""
        return sum(v.numel() for v in self.samples.values())

    @classmethod
    def concat(cls, posteriors: Sequence[SampledPosterior]) -> SampledPosterior:
        """One posterior holding the samples of several, in order (same model, subset and likelihood).

        Raises:
            ValueError: If ``posteriors`` is empty or they differ in model, subset or likelihood.
        """
        kinds = [(p.model, p.subset, p.likelihood, p.sigma_noise) for p in posteriors]
        if not kinds or any(k != kinds[0] for k in kinds):  # none, or of other models / subsets
            raise ValueError(
                "concat: posteriors differ in model, subset or likelihood"
                if kinds
                else "concat needs at least one posterior"
            )
        first = posteriors[0]
        samples = {n: torch.cat([p.samples[n] for p in posteriors]) for n in first.samples}
        options = {"likelihood": first.likelihood, "sigma_noise": first.sigma_noise}
        return cls(first.model, first.subset, samples, **options)

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` stored samples drawn uniformly with replacement, ``{param name: [n, k]}``."""
        check_int("n", n)
        check_generator(generator)
        device = "cpu" if generator is None else generator.device
        idx = torch.randint(self.num_samples, (n,), generator=generator, device=device)
        return {name: v[idx.to(v.device)] for name, v in self.samples.items()}

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into the model; restore what was there on exit (even on error)."""
        return self.subset.swapped(self.model, sample)

    def sampled(
        self, *, generator: torch.Generator | None = None
    ) -> AbstractContextManager[nn.Module]:
        """Swap one stored sample, drawn uniformly, into the model (see `swapped`)."""
        return self.swapped(rows(self.sample(1, generator=generator), 0))

    def _contexts(
        self, n_samples: int | None, generator: torch.Generator | None
    ) -> tuple[int, Any]:
        if n_samples is None:  # every stored sample once, in order
            return self.num_samples, lambda s: self.swapped(rows(self.samples, s))
        return n_samples, lambda s: self.sampled(generator=generator)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int | None = None,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Monte Carlo predictive (``partialbayes.predictive.sampled_predict``; link ``"mc"``).

        ``n_samples=None`` averages over every stored sample once; an int draws that many with replacement from
        ``generator``. ``target_ids``: the answer tokens' distribution at the answer positions, ``[P, K]``.
        """
        resolve_link(link, self.links, "SampledPosterior")
        n, ctx = self._contexts(n_samples, generator)
        return sampled_predict(
            self,
            batch,
            n,
            sample_ctx=ctx,
            regression=self.likelihood == "regression",
            noise_var=self.sigma_noise**2,
            target_ids=target_ids,
        )

    def predictive_samples(
        self,
        batch: Any,
        n: int | None = None,
        *,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """Logits under ``n`` drawn samples (``None``: every stored sample in order), ``[n, B, C]``."""
        n, ctx = self._contexts(n, generator)
        return sampled_logits(self, batch, n, sample_ctx=ctx, target_ids=target_ids)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save as safetensors (tensor ``samples``, ``[S, d]`` in subset order) + JSON metadata, atomically."""
        flat = torch.cat(
            [v.to(torch.promote_types(v.dtype, torch.float32)) for v in self.samples.values()], 1
        )
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "subset": self.subset.to_json(),
            "likelihood": self.likelihood,
            "sigma_noise": self.sigma_noise,
        }
        write_posterior_file(path, {"samples": flat}, meta, model=self.model)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> SampledPosterior:
        """Load a posterior saved by `save` onto ``model`` (its parameter names and shapes must match).

        Raises:
            FileNotFoundError: No file at ``path``.
            ValueError: Naming the file: not a file of this format, a model or subset that does not match,
                samples of the wrong shape.
        """
        file = read_posterior_file(path, formats=FORMAT, version=VERSION, fields=_FIELDS)
        file.check_model(model)
        with file.reraised("the saved subset does not fit the model"):
            subset = Subset.from_json(file.meta["subset"], model)
        flat = file.tensor("samples")
        sizes = [subset.num_entries(n) for n in subset.names]
        if flat.ndim != 2 or flat.shape[1] != sum(sizes):
            raise file.error(f"'samples' has shape {tuple(flat.shape)}, expected (S, {sum(sizes)})")
        params = subset.parameters_of(model)
        samples = {
            n: part.to(params[n].dtype)
            for n, part in zip(subset.names, flat.split(sizes, 1), strict=True)
        }
        options = {k: file.meta[k] for k in ("likelihood", "sigma_noise")}
        return cls(model, subset, samples, **options)
