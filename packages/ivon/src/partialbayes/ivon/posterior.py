"""Posterior use of an IVON run: the learned Gaussian, weight samples, predictions, Multi-IVON.

`GaussianPosterior` and `MultiIVON` implement ``partialbayes.predictive.Posterior``: the subset is the
entries with σ > 0 (for a mixture: the entries where the runs differ), samples are ``{param name: [n, k]}``
in ``Subset.gather`` order, and `predict` averages the softmax over weight samples.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, overload

import torch
from torch import Tensor, nn

from partialbayes.ivon._io import Run, read_posterior_file, write_posterior_file
from partialbayes.ivon.optimizer import IVON
from partialbayes.predictive import (
    check_count,
    check_sample,
    resolve_link,
    rows,
    sampled_logits,
    sampled_predict,
)
from partialbayes.selection import Block, KronBlock, MaskBlock, Subset

LIKELIHOODS = ("classification", "regression")


def _deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in partialbayes-ivon 0.4; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _check_likelihood(likelihood: str, sigma_noise: float) -> float:
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
    if (
        isinstance(sigma_noise, bool)
        or not isinstance(sigma_noise, (int, float))
        or not math.isfinite(sigma_noise)
        or sigma_noise <= 0
    ):
        raise ValueError(f"sigma_noise must be a finite number > 0, got {sigma_noise!r}")
    return float(sigma_noise)


def _normal_(t: Tensor, generator: torch.Generator | None) -> None:
    if generator is None or torch.device(generator.device).type == t.device.type:
        t.normal_(generator=generator)
    else:
        z = torch.empty(t.shape, dtype=t.dtype, device=generator.device).normal_(
            generator=generator
        )
        t.copy_(z)


def _randn(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise of ``shape`` in ``like``'s dtype and device, drawn on the generator's device."""
    z = torch.empty(shape, dtype=like.dtype, device=like.device)
    _normal_(z, generator)
    return z


def _check_model(model: nn.Module, shapes: Mapping[str, torch.Size], who: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
    params = dict(model.named_parameters())
    for name, shape in shapes.items():
        if name not in params:
            raise ValueError(f"{who}: the model has no parameter {name!r}")
        if params[name].shape != shape:
            raise ValueError(
                f"{who}: parameter {name!r} has shape {tuple(params[name].shape)} in the model, "
                f"{tuple(shape)} in the posterior"
            )


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


class _Entries:
    """Where the subset's entries sit in each parameter: ``None`` (all) or flat int64 indices."""

    def __init__(self, model: nn.Module, subset: Subset) -> None:
        params = dict(model.named_parameters())
        self.index: dict[str, Tensor | None] = {}
        for name in subset.names:
            p = params[name]
            if isinstance(subset.block(name), KronBlock) and subset.num_entries(name) == p.numel():
                self.index[name] = None
            else:
                self.index[name] = subset.mask(name).reshape(-1).nonzero().squeeze(1).to(p.device)

    def gather(self, name: str, t: Tensor, *, copy: bool = True) -> Tensor:
        """The entries of ``t`` as ``[k]``: a copy, or (``copy=False``, all entries) a view when possible."""
        idx = self.index[name]
        flat = t.detach().reshape(-1)
        if idx is None:
            return flat.clone() if copy else flat
        return flat.index_select(0, idx.to(flat.device))

    def write_(self, p: Tensor, name: str, values: Tensor) -> None:
        idx = self.index[name]
        values = values.to(device=p.device, dtype=p.dtype)
        if idx is None:
            p.copy_(values.view(p.shape))
        elif p.is_contiguous():
            p.view(-1).index_copy_(0, idx, values)
        else:
            tmp = p.detach().reshape(-1).clone()
            tmp.index_copy_(0, idx, values)
            p.copy_(tmp.view(p.shape))

    @contextmanager
    def swapped(self, model: nn.Module, sample: Mapping[str, Tensor]) -> Iterator[nn.Module]:
        params = dict(model.named_parameters())
        saved = {name: self.gather(name, params[name]) for name in sample}
        try:
            with torch.no_grad():
                for name, values in sample.items():
                    self.write_(params[name], name, values)
            yield model
        finally:
            with torch.no_grad():
                for name, values in saved.items():
                    self.write_(params[name], name, values)


class _SampledFamily:
    """What GaussianPosterior and MultiIVON share: the model binding, swapping, predicting, saving."""

    links: ClassVar[tuple[str, ...]] = ("mc",)
    _kind: ClassVar[str]  # what the file format calls the class
    likelihood: str
    sigma_noise: float
    _model: nn.Module | None
    _subset: Subset | None
    _entries: _Entries | None

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

    @property
    def entries(self) -> _Entries:
        if self._entries is None:
            self._entries = _Entries(self.model, self.subset)
        return self._entries

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        raise NotImplementedError

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into the model; restore its values on exit, even on error.

        Entries outside the subset are never touched (the model holds the posterior mean there).

        Raises:
            ValueError: If the sample does not cover the subset exactly or has the wrong sizes.
        """
        one = check_sample(self.subset, sample)
        return self.entries.swapped(self.model, one)

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
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Monte Carlo predictive over ``n_samples`` weight samples (eval mode, no gradients).

        Classification: ``(1/S) Σ_s softmax(f(x; w_s))``, probabilities of the logits' shape (``[B, C]``,
        or ``[B, T, C]`` for token-level outputs). Regression: the mean and variance of the outputs plus
        ``sigma_noise²``. One weight sample is held at a time.

        Args:
            batch: Any batch kind (tensor, ``(inputs, labels)``, dict / ``BatchEncoding``); labels ignored.
            link: ``"mc"`` (the only one).
            n_samples: Number of weight samples ``S``.
            generator: Source of randomness (same seed, same prediction).

        Returns:
            Probabilities, or ``(mean, variance)`` for regression.
        """
        resolve_link(link, self.links, type(self).__name__)
        return sampled_predict(
            self,
            batch,
            n_samples,
            generator=generator,
            sample_ctx=self._sample_ctx(generator),
            regression=self.likelihood == "regression",
            noise_var=self.sigma_noise**2,
        )

    def predictive_samples(
        self, batch: Any, n: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """Logits under ``n`` weight samples, ``[n, B, C]`` (or ``[n, B, T, C]``); eval mode, no gradients."""
        return sampled_logits(
            self,
            batch,
            n,
            generator=generator,
            sample_ctx=self._sample_ctx(generator),
        )

    def _runs(self) -> list[Run]:
        raise NotImplementedError

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save as one safetensors file with JSON metadata (see `save_posterior`)."""
        write_posterior_file(
            path,
            self._runs(),
            kind=type(self)._kind,
            likelihood=self.likelihood,
            sigma_noise=self.sigma_noise,
        )


class GaussianPosterior(_SampledFamily):
    """A mean-field Gaussian over named parameters: ``w[name] ~ N(mean[name], std[name]²)``.

    Implements ``partialbayes.predictive.Posterior`` once it knows its model (`ivon_posterior` and
    `load_posterior` give it one): the subset is the entries with ``σ > 0``; the model must hold the means
    (it does after IVON training: outside ``sampled_params`` the parameters are the means).

    Args:
        mean: Parameter name -> mean, in the parameter's storage shape.
        std: Parameter name -> standard deviation, same shape (0 for deterministic entries).
        model: The model the parameters belong to.
        likelihood: ``"classification"`` or ``"regression"`` (what `predict` returns).
        sigma_noise: Observation noise standard deviation of the regression likelihood.

    Raises:
        ValueError: If ``mean`` and ``std`` name different parameters or shapes, a ``std`` is negative or
            not finite, or ``model`` lacks a parameter.
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
        for name, m in mean.items():
            s = std[name]
            if s.shape != m.shape:
                raise ValueError(
                    f"GaussianPosterior: std of {name!r} has shape {tuple(s.shape)}, "
                    f"mean has {tuple(m.shape)}"
                )
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise ValueError(f"GaussianPosterior: std of {name!r} is negative or not finite")
        self._mean = dict(mean)
        self._std = dict(std)
        self.sigma_noise = _check_likelihood(likelihood, sigma_noise)
        self.likelihood = likelihood
        if model is not None:
            _check_model(model, {n: m.shape for n, m in mean.items()}, "GaussianPosterior")
        self._model = model
        self._subset: Subset | None = None
        self._entries: _Entries | None = None
        self._gathered: dict[str, tuple[Tensor, Tensor]] | None = None

    @property
    def mean(self) -> dict[str, Tensor]:
        """Parameter name -> mean, storage shape."""
        return self._mean

    @property
    def std(self) -> dict[str, Tensor]:
        """Parameter name -> standard deviation, storage shape (0 outside the subset)."""
        return self._std

    _kind = "GaussianPosterior"

    @property
    def num_floats(self) -> int:
        """Floats of the standard deviations (the means are the MAP weights the model holds)."""
        return sum(s.numel() for s in self._std.values())

    def _runs(self) -> list[Run]:
        return [(self._mean, self._std)]

    def _build_subset(self) -> Subset:
        model = self.model
        names = [n for n, _ in model.named_parameters() if n in self._std]
        return _subset_of(model, {n: self._std[n] != 0 for n in names}, "GaussianPosterior")

    def _moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (mean [k], std [k])}`` of the subset's entries, on the parameters' devices."""
        if self._gathered is None:
            params = dict(self.model.named_parameters())
            self._gathered = {
                n: (
                    self.entries.gather(n, self._mean[n], copy=False).to(params[n].device),
                    self.entries.gather(n, self._std[n], copy=False).to(params[n].device),
                )
                for n in self.subset.names
            }
        return self._gathered

    def sample_full(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """One weight sample ``mean + std·z`` of every parameter, in storage shape (noise in ``mean`` order).

        Args:
            generator: Random generator (same seed, same sample); ``None`` for the global RNG.

        Returns:
            Parameter name -> sampled tensor.
        """
        out = {}
        for name, m in self._mean.items():
            z = torch.empty_like(m)
            _normal_(z, generator)
            out[name] = torch.addcmul(m, self._std[name], z)
        return out

    @overload
    def sample(
        self, n: int = 1, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]: ...

    @overload
    def sample(self, n: torch.Generator | None) -> dict[str, Tensor]: ...

    def sample(
        self, n: int | torch.Generator | None = 1, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """``n`` weight samples ``{param name: [n, k]}`` of the subset's entries (``Subset.gather`` order).

        Args:
            n: Number of samples. (Deprecated: a generator or ``None`` in its place draws one full-shape
                sample as before 0.3; use `sample_full`.)
            generator: Source of randomness (same generator state, same samples); noise is drawn on its
                device, parameter by parameter in ``subset.names`` order.

        Returns:
            ``{param name: [n, k]}`` on the parameters' devices.
        """
        if n is None or isinstance(n, torch.Generator):
            _deprecated(
                "GaussianPosterior.sample(generator) (one full-shape sample)",
                "GaussianPosterior.sample_full(generator), or sample(n, generator=...) for the "
                "{name: [n, k]} layout",
            )
            return self.sample_full(n)
        check_count("n", n)
        out = {}
        for name, (m, s) in self._moments().items():
            out[name] = torch.addcmul(m, s, _randn((n, m.shape[0]), m, generator))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module) -> GaussianPosterior:
        """Load a `GaussianPosterior` saved with `save` / `save_posterior` onto ``model``.

        Raises:
            ValueError: If the file holds a `MultiIVON`, is no IVON posterior, or does not fit ``model``.
        """
        post = load_posterior(path, model)
        if not isinstance(post, GaussianPosterior):
            raise ValueError(f"{os.fspath(path)} holds a MultiIVON; load it with MultiIVON.load")
        return post


def ivon_posterior(
    optimizer: IVON,
    model: nn.Module,
    *,
    likelihood: str = "classification",
    sigma_noise: float = 1.0,
) -> GaussianPosterior:
    """The Gaussian learned by ``optimizer`` for ``model``: means and ``σ = 1/√(ess·(h+δ))``.

    Only parameters of ``model`` that ``optimizer`` holds are included; entries outside a subset given to
    :meth:`IVON.from_subset` get ``σ = 0``. The posterior records ``model`` (its parameters hold the means
    outside ``sampled_params``), so it is a ready ``partialbayes.predictive.Posterior``.

    Args:
        optimizer: The IVON optimizer that trained ``model``.
        model: The model.
        likelihood: ``"classification"`` or ``"regression"`` (what `GaussianPosterior.predict` returns).
        sigma_noise: Observation noise standard deviation of the regression likelihood.

    Returns:
        The posterior (tensors are copies, detached from the model).

    Raises:
        ValueError: If the optimizer holds none of the model's parameters.
        RuntimeError: If called inside ``sampled_params``.
    """
    if optimizer._sampling:
        raise RuntimeError(
            "ivon_posterior: called inside sampled_params (parameters hold a sample)"
        )
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    mean, std = {}, {}
    for name, p in model.named_parameters():
        if p not in group_of:
            continue
        g = group_of[p]
        s = (optimizer.state[p]["hess"] + g["weight_decay"]).mul(g["ess"]).rsqrt()
        mask = optimizer.variational_mask(p)
        if mask is False:
            s = torch.zeros_like(s)
        elif isinstance(mask, Tensor):
            s = s * mask
        mean[name] = p.detach().clone()
        std[name] = s
    if not mean:
        raise ValueError("ivon_posterior: the optimizer holds none of the model's parameters")
    return GaussianPosterior(mean, std, model, likelihood=likelihood, sigma_noise=sigma_noise)


@contextmanager
def swapped_params(model: nn.Module, values: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """Temporarily replace named parameters of ``model`` by ``values``; restore them even on error.

    Args:
        model: The model.
        values: Parameter name -> tensor of the parameter's shape.

    Yields:
        The model, holding ``values``.

    Raises:
        ValueError: If a name is unknown or a shape does not match.
    """
    named = dict(model.named_parameters())
    for name, v in values.items():
        if name not in named:
            raise ValueError(f"swapped_params: model has no parameter {name!r}")
        if v.shape != named[name].shape:
            raise ValueError(
                f"swapped_params: value for {name!r} has shape {tuple(v.shape)}, "
                f"parameter has {tuple(named[name].shape)}"
            )
    saved = {name: named[name].data for name in values}
    try:
        for name, v in values.items():
            named[name].data = v.to(device=named[name].device, dtype=named[name].dtype)
        yield model
    finally:
        for name, d in saved.items():
            named[name].data = d


class MultiIVON(_SampledFamily):
    """Multi-IVON: the uniform mixture of the Gaussians of several independent IVON runs.

    As a ``partialbayes.predictive.Posterior`` its subset is every entry that varies under the mixture:
    ``σ > 0`` in some run, or means that differ between runs (independent runs differ in every trained
    weight). The model must hold the runs' common values elsewhere (the first run's model does). Samples
    are stratified over the runs: sample ``i`` of a draw comes from run ``(o + i) mod K`` with a uniformly
    drawn offset ``o``, so each sample is a draw from the mixture and ``n = K`` draws visit every run once.

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
        self.sigma_noise = _check_likelihood(
            self.likelihood, first.sigma_noise if sigma_noise is None else sigma_noise
        )
        if model is None:
            model = first._model
        if model is not None:
            _check_model(model, {n: m.shape for n, m in first.mean.items()}, "MultiIVON")
        self._model = model
        self._subset: Subset | None = None
        self._entries: _Entries | None = None
        self._gathered: dict[str, tuple[Tensor, Tensor]] | None = None

    @property
    def mean(self) -> dict[str, Tensor]:
        """The mixture mean (the average of the component means)."""
        first, rest = self.components[0], self.components[1:]
        k = len(self.components)
        return {n: sum((c.mean[n] for c in rest), first.mean[n]) / k for n in first.mean}

    _kind = "MultiIVON"

    @property
    def num_floats(self) -> int:
        """Floats beyond the model's weights: every run's σ, and the means of all runs but one."""
        per_run = sum(m.numel() for m in self.components[0].mean.values())
        return len(self.components) * 2 * per_run - per_run

    def _runs(self) -> list[Run]:
        return [(c.mean, c.std) for c in self.components]

    def _build_subset(self) -> Subset:
        model = self.model
        first = self.components[0]
        masks = {}
        for name, _ in model.named_parameters():
            if name not in first.mean:
                continue
            varies = torch.zeros(first.mean[name].shape, dtype=torch.bool)
            for c in self.components:
                varies |= (c.std[name] != 0).cpu()
                varies |= (c.mean[name] != first.mean[name].to(c.mean[name].device)).cpu()
            masks[name] = varies
        return _subset_of(model, masks, "MultiIVON")

    def _moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{name: (means [K, k], stds [K, k])}`` of the subset's entries per run."""
        if self._gathered is None:
            params = dict(self.model.named_parameters())
            self._gathered = {
                n: (
                    torch.stack(
                        [
                            self.entries.gather(n, c.mean[n]).to(params[n].device)
                            for c in self.components
                        ]
                    ),
                    torch.stack(
                        [
                            self.entries.gather(n, c.std[n]).to(params[n].device)
                            for c in self.components
                        ]
                    ),
                )
                for n in self.subset.names
            }
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
        """One full-shape sample: a uniformly drawn run (or the given one), then its Gaussian.

        Args:
            generator: Random generator; ``None`` for the global RNG.
            component: Index of the run to sample from; ``None`` draws it uniformly.

        Returns:
            Parameter name -> sampled tensor, storage shape.
        """
        k = len(self.components)
        if component is None:
            component = self._offset(generator)
        if not 0 <= component < k:
            raise ValueError(f"MultiIVON.sample: component must be in [0, {k}), got {component}")
        return self.components[component].sample_full(generator)

    @overload
    def sample(
        self, n: int = 1, *, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]: ...

    @overload
    def sample(
        self, n: torch.Generator | None, component: int | None = None
    ) -> dict[str, Tensor]: ...

    def sample(
        self,
        n: int | torch.Generator | None = 1,
        component: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """``n`` stratified mixture samples ``{param name: [n, k]}`` (``Subset.gather`` order).

        The offset ``o`` is drawn first, then the noise parameter by parameter; sample ``i`` comes from run
        ``(o + i) mod K``.

        Args:
            n: Number of samples. (Deprecated: a generator or ``None`` in its place, optionally with
                ``component``, draws one full-shape sample as before 0.3; use `sample_full`.)
            component: Only with the deprecated form.
            generator: Source of randomness (same generator state, same samples).

        Returns:
            ``{param name: [n, k]}`` on the parameters' devices.
        """
        if n is None or isinstance(n, torch.Generator) or component is not None:
            _deprecated(
                "MultiIVON.sample(generator, component) (one full-shape sample)",
                "MultiIVON.sample_full(generator, component), or sample(n, generator=...) for the "
                "{name: [n, k]} layout",
            )
            gen = n if isinstance(n, torch.Generator) else generator
            return self.sample_full(gen, component)
        check_count("n", n)
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
        """Load a `MultiIVON` saved with `save` / `save_posterior` onto ``model``.

        A file holding one `GaussianPosterior` loads as a mixture of one run.
        """
        post = load_posterior(path, model)
        if isinstance(post, GaussianPosterior):
            return cls([post], model)
        return post


IVONPosterior = GaussianPosterior | MultiIVON


def save_posterior(posterior: IVONPosterior, path: str | os.PathLike[str]) -> None:
    """Write a :class:`GaussianPosterior` or :class:`MultiIVON` to ``path`` (one ``.safetensors`` file).

    Tensors ``"<component>/mean/<name>"`` and ``"<component>/std/<name>"`` (moved to the CPU), plus JSON
    metadata naming the format, the kind, the number of components, every parameter's shape and dtype, the
    likelihood and ``sigma_noise``.
    The file is written to a temporary sibling and renamed into place, so an interrupted save never leaves
    a truncated file behind.

    Args:
        posterior: The posterior to save.
        path: Destination file.

    Raises:
        TypeError: If ``posterior`` is neither a :class:`GaussianPosterior` nor a :class:`MultiIVON`.
    """
    if not isinstance(posterior, (GaussianPosterior, MultiIVON)):
        raise TypeError(
            f"save_posterior: expected a GaussianPosterior or MultiIVON, got {type(posterior).__name__}"
        )
    posterior.save(path)


def load_posterior(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
) -> IVONPosterior:
    """Read a posterior written by :func:`save_posterior`.

    Args:
        path: The ``.safetensors`` file.
        model: If given, every saved parameter must exist in ``model.named_parameters()`` with the saved
            shape; the tensors are then placed on that parameter's device (unless ``device`` is given).
        device: Device for the loaded tensors; default: the model's parameters' devices, else the CPU.

    Returns:
        A :class:`GaussianPosterior`, or a :class:`MultiIVON` if a mixture was saved; bound to ``model``
        when one is given (a ready ``partialbayes.predictive.Posterior``).

    Raises:
        FileNotFoundError: If there is no file at ``path``.
        ValueError: Naming the file: if it is not a readable IVON posterior of a known version (garbage,
            truncated, metadata that is not JSON or lacks a field, a missing or unexpected tensor, a tensor
            of the wrong shape or dtype, NaN or inf means, NaN, inf or negative standard deviations, an
            invalid likelihood or ``sigma_noise``), or does not fit ``model`` (the parameter is named).
    """
    saved = read_posterior_file(path, model)
    params = dict(model.named_parameters()) if model is not None else {}

    def place(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {
            n: t.to(device if device is not None else params[n].device if params else "cpu")
            for n, t in tensors.items()
        }

    try:
        runs = [
            GaussianPosterior(
                place(mean),
                place(std),
                model,
                likelihood=saved.likelihood,
                sigma_noise=saved.sigma_noise,
            )
            for mean, std in saved.runs
        ]
    except ValueError as err:
        raise ValueError(f"{os.fspath(path)!r}: the saved settings are invalid: {err}") from err
    return MultiIVON(runs, model) if saved.kind == "MultiIVON" else runs[0]


def predict_mean(
    model: nn.Module, posterior: IVONPosterior, fn: Callable[[nn.Module], Tensor]
) -> Tensor:
    """``fn(model)`` with the posterior mean swapped in, without gradients.

    Args:
        model: The model.
        posterior: A :class:`GaussianPosterior`, or a :class:`MultiIVON` of one component. The mean of a
            mixture of several runs is refused: independent runs sit in different modes (and permutations)
            of the weights, so their averaged weights are no meaningful network. Use ``posterior.predict``,
            or ``predict_mean`` on each component.
        fn: Computes the output from the model, e.g. ``lambda m: m(x).logits``.

    Returns:
        The output at the mean.

    Raises:
        ValueError: For a :class:`MultiIVON` of several components.
    """
    if isinstance(posterior, MultiIVON) and len(posterior.components) > 1:
        raise ValueError(
            f"predict_mean: a MultiIVON of {len(posterior.components)} runs has no meaningful mean "
            "network (averaged weights of independent runs); use posterior.predict, or predict_mean on "
            "each of posterior.components"
        )
    with torch.no_grad(), swapped_params(model, posterior.mean):
        return fn(model)


def predict_mc(
    model: nn.Module,
    posterior: IVONPosterior,
    fn: Callable[[nn.Module], Tensor],
    n_samples: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Deprecated: use ``posterior.predictive_samples(batch, n)`` or ``posterior.predict(batch)``.

    Outputs of ``fn`` under ``n_samples`` full-shape weight samples, stacked: shape ``(n_samples, *out)``.
    For :class:`MultiIVON` the samples cycle through the components (sample ``i`` from component
    ``i mod K``).

    Args:
        model: The model.
        posterior: A :class:`GaussianPosterior` or :class:`MultiIVON`.
        fn: Computes the output from the model.
        n_samples: Number of samples, >= 1.
        generator: Random generator (same seed, same result).

    Returns:
        The stacked outputs.

    Raises:
        ValueError: If ``n_samples < 1``.
    """
    _deprecated(
        "partialbayes.ivon.predict_mc",
        "posterior.predictive_samples(batch, n) (logit samples) or posterior.predict(batch)",
        stacklevel=3,
    )
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"predict_mc: n_samples must be an int >= 1, got {n_samples!r}")
    outs = []
    with torch.no_grad():
        for i in range(n_samples):
            if isinstance(posterior, MultiIVON):
                w = posterior.sample_full(generator, component=i % len(posterior.components))
            else:
                w = posterior.sample_full(generator)
            with swapped_params(model, w):
                outs.append(fn(model))
    return torch.stack(outs)
