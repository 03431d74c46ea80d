"""Posterior use of an IVON run: `GaussianPosterior`, `MultiIVON` (both ``partialbayes.predictive.Posterior``), files."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.ivon.optimizer import IVON
from partialbayes.predictive import sampled_logits, sampled_predict
from partialbayes.predictive.internal import (
    PosteriorFile,
    check_int,
    check_likelihood,
    check_shapes,
    check_type,
    read_posterior_file,
    resolve_link,
    rows,
    write_posterior_file,
)
from partialbayes.selection import KronBlock, MaskBlock, Subset
from partialbayes.selection.internal import Block

#: The file format of each class (``partialbayes.predictive`` posterior files).
FORMATS = {
    "GaussianPosterior": "partialbayes.ivon.GaussianPosterior",
    "MultiIVON": "partialbayes.ivon.MultiIVON",
}
VERSION = 2
_FIELDS = {"components": int, "parameters": list, "likelihood": str, "sigma_noise": (int, float)}

#: One run's ``(mean, std)``: parameter name -> tensor in the parameter's storage shape.
Run = tuple[dict[str, Tensor], dict[str, Tensor]]


def _randn(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise of ``shape`` in ``like``'s dtype and device, drawn on the generator's device."""
    device = like.device if generator is None else generator.device
    z = torch.empty(shape, dtype=like.dtype, device=device).normal_(generator=generator)
    return z.to(like.device)


def _check_model(model: nn.Module, shapes: Mapping[str, torch.Size], who: str) -> None:
    check_type(f"{who}: model", model, nn.Module, "a torch.nn.Module")
    check_shapes(f"{who}: ", dict(model.named_parameters()), shapes, "the model", "the posterior")


def _subset_of(model: nn.Module, masks: Mapping[str, Tensor], who: str) -> Subset:
    """The Subset whose entries are ``masks`` (parameters without an entry are left out)."""
    blocks: dict[str, Block] = {}
    for name, mask in masks.items():
        mask = mask.to("cpu", torch.bool)
        if bool(mask.all()):
            blocks[name] = KronBlock()
        elif bool(mask.any()):
            blocks[name] = MaskBlock(mask)
    if not blocks:
        raise ValueError(f"{who}: no entry has σ > 0, so there is nothing to sample")
    return Subset.from_model(model, blocks)


class _SampledFamily:
    """What GaussianPosterior and MultiIVON share: the model binding, swapping, predicting, saving."""

    links: ClassVar[tuple[str, ...]] = ("mc",)
    likelihood: str
    sigma_noise: float
    _model: nn.Module | None
    _subset: Subset | None

    def _bind(self, model: nn.Module | None, shapes: Mapping[str, torch.Size]) -> None:
        """Record ``model`` (checked: every parameter present, same shape, not on the meta device)."""
        self._model, self._subset = model, None
        if model is not None:
            _check_model(model, shapes, type(self).__name__)
            self.subset.parameters_of(model)  # refuses a model on the meta device, by name

    @property
    def model(self) -> nn.Module:
        """The model the posterior's samples are swapped into."""
        if self._model is None:
            raise ValueError(
                f"{type(self).__name__} has no model: build it with ivon_posterior(optimizer, model), "
                "load_posterior(path, model), or pass model=... to the constructor"
            )
        return self._model

    @property
    def subset(self) -> Subset:
        """The ``partialbayes.selection.Subset`` of stochastic entries."""
        if self._subset is None:
            self._subset = self._build_subset()
        return self._subset

    def _build_subset(self) -> Subset:
        raise NotImplementedError

    def _runs(self) -> list[Run]:
        raise NotImplementedError

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        raise NotImplementedError

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into the model; restore what was there on exit, even on error."""
        return self.subset.swapped(self.model, sample)

    def sampled(
        self, *, generator: torch.Generator | None = None
    ) -> AbstractContextManager[nn.Module]:
        """Draw one sample and swap it in (see `swapped`); yields the model."""
        return self.swapped(rows(self.sample(1, generator=generator), 0))

    def _sample_ctx(self, generator: torch.Generator | None) -> Any:
        return None

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Monte Carlo predictive over ``n_samples`` weight samples (``partialbayes.predictive.sampled_predict``)."""
        resolve_link(link, self.links, type(self).__name__)
        return sampled_predict(
            self,
            batch,
            n_samples,
            generator=generator,
            sample_ctx=self._sample_ctx(generator),
            regression=self.likelihood == "regression",
            noise_var=self.sigma_noise**2,
            target_ids=target_ids,
        )

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """Logits under ``n`` weight samples, ``[n, B, C]`` (or ``[n, B, T, C]``; ``[n, P, K]`` answer-only)."""
        ctx = self._sample_ctx(generator)
        return sampled_logits(
            self, batch, n, generator=generator, sample_ctx=ctx, target_ids=target_ids
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save as a ``partialbayes.predictive`` posterior file: tensors ``"<run>/mean|std/<name>"``, runs and names."""
        runs = self._runs()
        tensors = {
            f"{k}/{what}/{name}": t
            for k, (mean, std) in enumerate(runs)
            for what, part in (("mean", mean), ("std", std))
            for name, t in part.items()
        }
        meta = {
            "format": FORMATS[type(self).__name__],
            "version": VERSION,
            "components": len(runs),
            "parameters": list(runs[0][0]),
            "likelihood": self.likelihood,
            "sigma_noise": self.sigma_noise,
        }
        write_posterior_file(path, tensors, meta, model=self.model)


class GaussianPosterior(_SampledFamily):
    """A mean-field Gaussian over named parameters: ``w[name] ~ N(mean[name], std[name]²)``.

    A ``partialbayes.predictive.Posterior`` once it has its model (`ivon_posterior` and `load_posterior` give
    it one), which must hold the means (it does after IVON training); the subset is the entries with ``σ > 0``.

    Args:
        mean: Parameter name -> mean, in the parameter's storage shape.
        std: Parameter name -> standard deviation, same shape (0 for deterministic entries).
        model: The model the parameters belong to.
        likelihood: ``"classification"`` or ``"regression"`` (what `predict` returns).
        sigma_noise: Observation noise standard deviation of the regression likelihood.

    Raises:
        ValueError: If ``mean`` and ``std`` name different parameters or shapes, a ``std`` is negative or
            not finite, ``model`` lacks a parameter or holds it on the meta device.
    """

    def __init__(
        self,
        mean: Mapping[str, Tensor],
        std: Mapping[str, Tensor],
        model: nn.Module | None = None,
        *,
        likelihood: str = "classification",
        sigma_noise: float = 1.0,
    ) -> None:
        if set(mean) != set(std):
            raise ValueError("GaussianPosterior: mean and std must name the same parameters")
        check_shapes(
            "GaussianPosterior: ", std, {n: m.shape for n, m in mean.items()}, "std", "mean"
        )
        for name, s in std.items():
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise ValueError(f"GaussianPosterior: std of {name!r} is negative or not finite")
        self._mean = dict(mean)
        self._std = dict(std)
        self.sigma_noise = check_likelihood(likelihood, sigma_noise)
        self.likelihood = likelihood
        self._gathered: dict[str, tuple[Tensor, Tensor]] | None = None
        self._bind(model, {n: m.shape for n, m in mean.items()})

    @property
    def mean(self) -> dict[str, Tensor]:
        """Parameter name -> mean, storage shape."""
        return self._mean

    @property
    def std(self) -> dict[str, Tensor]:
        """Parameter name -> standard deviation, storage shape (0 outside the subset)."""
        return self._std

    @property
    def num_floats(self) -> int:
        """Floats of the standard deviations (the means are the MAP weights the model holds)."""
        return sum(s.numel() for s in self._std.values())

    def _runs(self) -> list[Run]:
        return [(self._mean, self._std)]

    def _build_subset(self) -> Subset:
        names = [n for n, _ in self.model.named_parameters() if n in self._std]
        return _subset_of(self.model, {n: self._std[n] != 0 for n in names}, "GaussianPosterior")

    def _moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (mean [k], std [k])}`` of the subset's entries, on the parameters' devices."""
        if self._gathered is None:
            self._gathered = {}
            for n, p in self.subset.parameters_of(self.model).items():
                mean = self.subset.gather(n, self._mean[n]).to(p.device)
                self._gathered[n] = (mean, self.subset.gather(n, self._std[n]).to(p.device))
        return self._gathered

    def sample_full(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """One weight sample ``mean + std·z`` of every parameter, in storage shape (noise drawn in ``mean`` order)."""
        return {
            name: torch.addcmul(m, self._std[name], _randn(tuple(m.shape), m, generator))
            for name, m in self._mean.items()
        }

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` weight samples ``{param name: [n, k]}`` of the subset's entries, on the parameters' devices.

        The noise is drawn on ``generator``'s device, parameter by parameter in ``subset.names`` order.
        """
        check_int("n", n)
        return {
            name: torch.addcmul(m, s, _randn((n, m.shape[0]), m, generator))
            for name, (m, s) in self._moments().items()
        }

    def penalty(self, model: nn.Module | None = None) -> Tensor:
        """``½ Σ (θ − m)² / σ²`` over the subset's entries of ``model`` (default: the posterior's model).

        Minus the log density up to a constant, differentiable. As the next episode's prior (continual
        learning), train on ``loss + posterior.penalty() / N`` (``N`` its examples; IVON: weight decay 0).
        """
        params = self.subset.parameters_of(self.model if model is None else model)
        moments = self._moments().items()
        z = [(self.subset.gather(n, params[n]) - m) / s for n, (m, s) in moments]  # standardised
        return 0.5 * sum(t.square().sum() for t in z)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> GaussianPosterior:
        """Load a `GaussianPosterior` saved with `save` onto ``model``.

        Raises:
            ValueError: If the file holds a `MultiIVON`, is no IVON posterior, or does not fit ``model``.
        """
        post = load_posterior(path, model)
        if not isinstance(post, GaussianPosterior):
            raise ValueError(f"{os.fspath(path)!r} holds a MultiIVON; load it with MultiIVON.load")
        return post


def ivon_posterior(
    optimizer: IVON,
    model: nn.Module,
    *,
    likelihood: str = "classification",
    sigma_noise: float = 1.0,
) -> GaussianPosterior:
    """The Gaussian learned by ``optimizer`` for ``model``: means and ``σ = 1/√(ess·(h+δ))``, as copies.

    Only parameters the optimizer holds are included; entries outside a subset given to
    :meth:`IVON.from_subset` get ``σ = 0``. The posterior records ``model``, so it is a ready
    ``partialbayes.predictive.Posterior``; ``likelihood`` and ``sigma_noise`` are `GaussianPosterior`'s.

    Raises:
        ValueError: If the optimizer holds none of the model's parameters.
        RuntimeError: If called inside ``sampled_params``.
    """
    optimizer._check_outside("ivon_posterior")
    held = {p for g in optimizer.param_groups for p in g["params"]}
    mean, std = {}, {}
    for name, p in model.named_parameters():
        if p in held:
            mean[name] = p.detach().clone()
            std[name] = optimizer.posterior_std(p)
    if not mean:
        raise ValueError("ivon_posterior: the optimizer holds none of the model's parameters")
    return GaussianPosterior(mean, std, model, likelihood=likelihood, sigma_noise=sigma_noise)


class MultiIVON(_SampledFamily):
    """Multi-IVON: the uniform mixture of the Gaussians of several independent IVON runs.

    Its subset is every entry that varies under the mixture (``σ > 0`` in some run, or means that differ);
    the model must hold the runs' common values elsewhere (the first run's model does). Samples are
    stratified: sample ``i`` of a draw comes from run ``(o + i) mod K`` for a uniformly drawn offset ``o``.

    Args:
        components: Posteriors of the runs (same parameter names and shapes).
        model: The model to swap samples into (default: the first component's model).
        likelihood: What `predict` returns (default: the first component's).
        sigma_noise: Observation noise of the regression likelihood (default: the first component's).

    Raises:
        ValueError: If there are no components or they name different parameters or shapes.
    """

    def __init__(
        self,
        components: Sequence[GaussianPosterior],
        model: nn.Module | None = None,
        *,
        likelihood: str | None = None,
        sigma_noise: float | None = None,
    ) -> None:
        if len(components) == 0:
            raise ValueError("MultiIVON: needs at least one component")
        first = components[0]
        for i, c in enumerate(components[1:], start=1):
            if set(c.mean) != set(first.mean) or any(
                c.mean[n].shape != first.mean[n].shape for n in first.mean
            ):
                raise ValueError(f"MultiIVON: component {i} names other parameters or shapes")
        self.components = tuple(components)
        self.likelihood = first.likelihood if likelihood is None else likelihood
        self.sigma_noise = check_likelihood(
            self.likelihood, first.sigma_noise if sigma_noise is None else sigma_noise
        )
        self._gathered: dict[str, tuple[Tensor, Tensor]] | None = None
        self._bind(
            first._model if model is None else model, {n: m.shape for n, m in first.mean.items()}
        )

    @property
    def mean(self) -> dict[str, Tensor]:
        """The mixture mean (the average of the component means)."""
        first, rest = self.components[0], self.components[1:]
        k = len(self.components)
        return {n: sum((c.mean[n] for c in rest), first.mean[n]) / k for n in first.mean}

    @property
    def num_floats(self) -> int:
        """Floats beyond the model's weights: every run's σ, and the means of all runs but one."""
        per_run = sum(m.numel() for m in self.components[0].mean.values())
        return len(self.components) * 2 * per_run - per_run

    def _runs(self) -> list[Run]:
        return [(c.mean, c.std) for c in self.components]

    def _build_subset(self) -> Subset:
        first = self.components[0]
        masks = {}
        for name, _ in self.model.named_parameters():
            if name not in first.mean:
                continue
            varies = torch.zeros(first.mean[name].shape, dtype=torch.bool)
            for c in self.components:
                varies |= (c.std[name] != 0).cpu()
                varies |= (c.mean[name] != first.mean[name].to(c.mean[name].device)).cpu()
            masks[name] = varies
        return _subset_of(self.model, masks, "MultiIVON")

    def _moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (means [K, k], stds [K, k])}`` of the subset's entries per run."""
        if self._gathered is None:
            self._gathered = {}
            for n, p in self.subset.parameters_of(self.model).items():
                means = [self.subset.gather(n, c.mean[n]).to(p.device) for c in self.components]
                stds = [self.subset.gather(n, c.std[n]).to(p.device) for c in self.components]
                self._gathered[n] = (torch.stack(means), torch.stack(stds))
        return self._gathered

    def _offset(self, generator: torch.Generator | None) -> int:
        device = None if generator is None else generator.device
        k = len(self.components)
        return int(torch.randint(k, (1,), generator=generator, device=device).item())

    def _draw(self, runs: Tensor, generator: torch.Generator | None) -> dict[str, Tensor]:
        out = {}
        for name, (means, stds) in self._moments().items():
            idx = runs.to(means.device)
            m, s = means[idx], stds[idx]
            out[name] = torch.addcmul(m, s, _randn(tuple(m.shape), m, generator))
        return out

    def sample_full(
        self, generator: torch.Generator | None = None, component: int | None = None
    ) -> dict[str, Tensor]:
        """One full-shape sample: from run ``component`` (``None``: drawn uniformly), then its Gaussian."""
        k = len(self.components)
        if component is None:
            component = self._offset(generator)
        check_int("MultiIVON.sample_full: component", component, f"[0, {k})")
        return self.components[component].sample_full(generator)

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` stratified mixture samples ``{param name: [n, k]}``: the offset ``o`` first, then the noise."""
        check_int("n", n)
        k = len(self.components)
        runs = (self._offset(generator) + torch.arange(n)) % k
        return self._draw(runs, generator)

    def _sample_ctx(self, generator: torch.Generator | None) -> Any:
        offset: list[int] = []

        def ctx(s: int) -> AbstractContextManager[nn.Module]:
            if not offset:
                offset.append(self._offset(generator))
            run = torch.tensor([(offset[0] + s) % len(self.components)])
            return self.swapped(rows(self._draw(run, generator), 0))

        return ctx

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> MultiIVON:
        """Load a `MultiIVON` saved with `save` onto ``model``.

        A file holding one `GaussianPosterior` loads as a mixture of one run.
        """
        post = load_posterior(path, model)
        if isinstance(post, GaussianPosterior):
            return cls([post], model)
        return post


IVONPosterior = GaussianPosterior | MultiIVON


def _read_runs(file: PosteriorFile) -> list[Run]:
    """Every run's checked CPU tensors: named by the metadata, of the saved shapes, floating, ``std >= 0``."""
    shapes = {name: shape for name, shape in file.meta["structure"]}
    names, count = file.meta["parameters"], file.meta["components"]
    bad = [n for n in names if not isinstance(n, str) or n not in shapes]
    if not names or bad or len(set(names)) != len(names):
        raise file.error(
            f"metadata field 'parameters' must name distinct parameters of the saved structure, got {bad or names}"
        )
    if count < 1 or (file.meta["format"] == FORMATS["GaussianPosterior"] and count != 1):
        raise file.error(
            f"metadata field 'components' is {count}, which does not fit {file.meta['format']!r}"
        )
    expected = {f"{k}/{w}/{n}" for k in range(count) for w in ("mean", "std") for n in names}
    unexpected = sorted(set(file.tensors) - expected)
    if unexpected:
        raise file.error(f"tensors {unexpected[:3]} are not named by the metadata ({count} runs)")
    runs: list[Run] = []
    for k in range(count):
        run: Run = ({}, {})
        for what, part in zip(("mean", "std"), run, strict=True):
            for name in names:
                key = f"{k}/{what}/{name}"
                t = file.tensor(key, shapes[name])
                if not t.is_floating_point() or (what == "std" and bool((t < 0).any())):
                    raise file.error(
                        f"tensor {key!r} is not a floating tensor of standard deviations >= 0"
                    )
                part[name] = t
        runs.append(run)
    return runs


def load_posterior(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
) -> IVONPosterior:
    """Read a posterior written by ``GaussianPosterior.save`` / ``MultiIVON.save``.

    With ``model`` (whose parameter names and shapes must be the saved structure) the result is bound to it
    and its tensors sit on each parameter's device; ``device`` overrides that (default without a model: the
    CPU). Returns a :class:`GaussianPosterior`, or a :class:`MultiIVON` if a mixture was saved.

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: Naming the file: not a readable IVON posterior of version 2 (a missing or malformed
            field or tensor, NaN / inf entries, negative standard deviations, invalid settings), or one that
            does not fit ``model``.
    """
    file = read_posterior_file(
        path, formats=tuple(FORMATS.values()), version=VERSION, fields=_FIELDS
    )
    if model is not None:
        file.check_model(model)
    params = dict(model.named_parameters()) if model is not None else {}

    def place(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {
            n: t.to(device if device is not None else params[n].device if params else "cpu")
            for n, t in tensors.items()
        }

    options = {k: file.meta[k] for k in ("likelihood", "sigma_noise")}
    with file.reraised("the saved settings are invalid"):
        runs = [
            GaussianPosterior(place(m), place(s), model, **options) for m, s in _read_runs(file)
        ]
    return MultiIVON(runs, model) if file.meta["format"] == FORMATS["MultiIVON"] else runs[0]


def predict_mean(
    model: nn.Module, posterior: IVONPosterior, fn: Callable[[nn.Module], Tensor]
) -> Tensor:
    """``fn(model)`` (e.g. ``lambda m: m(x).logits``) with the posterior mean swapped in, without gradients.

    ``posterior`` is a :class:`GaussianPosterior` or a :class:`MultiIVON` of one component: the averaged
    weights of independent runs are no meaningful network (use ``posterior.predict`` instead).

    Raises:
        ValueError: For a :class:`MultiIVON` of several components, or a model that lacks a parameter.
    """
    if isinstance(posterior, MultiIVON) and len(posterior.components) > 1:
        raise ValueError(
            f"predict_mean: a MultiIVON of {len(posterior.components)} runs has no meaningful mean "
            "network (averaged weights of independent runs); use posterior.predict, or predict_mean on "
            "each of posterior.components"
        )
    mean = posterior.mean
    _check_model(model, {n: m.shape for n, m in mean.items()}, "predict_mean")
    whole = _subset_of(
        model, {n: torch.ones(m.shape, dtype=torch.bool) for n, m in mean.items()}, "predict_mean"
    )
    with torch.no_grad(), whole.swapped(model, {n: m.reshape(-1) for n, m in mean.items()}):
        return fn(model)
