"""Posterior use of an IVON run: the learned Gaussian, weight samples, predictions, Multi-IVON."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from partialbayes.ivon.optimizer import IVON


@dataclass(frozen=True)
class GaussianPosterior:
    """A mean-field Gaussian over named parameters: ``w[name] ~ N(mean[name], std[name]²)``.

    Attributes:
        mean: Parameter name -> mean, in the parameter's storage shape.
        std: Parameter name -> standard deviation, same shape (0 for deterministic entries).
    """

    mean: dict[str, Tensor]
    std: dict[str, Tensor]

    def __post_init__(self) -> None:
        if set(self.mean) != set(self.std):
            raise ValueError("GaussianPosterior: mean and std must name the same parameters")
        for name, m in self.mean.items():
            if self.std[name].shape != m.shape:
                raise ValueError(
                    f"GaussianPosterior: std of {name!r} has shape {tuple(self.std[name].shape)}, "
                    f"mean has {tuple(m.shape)}"
                )

    def sample(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """One weight sample ``mean + std·z`` per parameter (noise drawn in ``mean`` order).

        Args:
            generator: Random generator (same seed, same sample); ``None`` for the global RNG.

        Returns:
            Parameter name -> sampled tensor.
        """
        out = {}
        for name, m in self.mean.items():
            z = torch.empty_like(m)
            _normal_(z, generator)
            out[name] = torch.addcmul(m, self.std[name], z)
        return out


def _normal_(t: Tensor, generator: torch.Generator | None) -> None:
    if generator is None or torch.device(generator.device).type == t.device.type:
        t.normal_(generator=generator)
    else:
        z = torch.empty(t.shape, dtype=t.dtype, device=generator.device).normal_(
            generator=generator
        )
        t.copy_(z)


def ivon_posterior(optimizer: IVON, model: nn.Module) -> GaussianPosterior:
    """The Gaussian learned by ``optimizer`` for ``model``: means and ``σ = 1/√(ess·(h+δ))``.

    Only parameters of ``model`` that ``optimizer`` holds are included; entries outside a subset given to
    :meth:`IVON.from_subset` get ``σ = 0``.

    Args:
        optimizer: The IVON optimizer that trained ``model``.
        model: The model (its parameters hold the means outside ``sampled_params``).

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
    return GaussianPosterior(mean, std)


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


class MultiIVON:
    """Multi-IVON: the uniform mixture of the Gaussians of several independent IVON runs.

    Args:
        components: Posteriors of the runs (same parameter names and shapes).

    Raises:
        ValueError: If there are no components or they name different parameters or shapes.
    """

    def __init__(self, components: Sequence[GaussianPosterior]) -> None:
        if len(components) == 0:
            raise ValueError("MultiIVON: needs at least one component")
        first = components[0]
        for i, c in enumerate(components[1:], start=1):
            if set(c.mean) != set(first.mean) or any(
                c.mean[n].shape != first.mean[n].shape for n in first.mean
            ):
                raise ValueError(f"MultiIVON: component {i} names other parameters or shapes")
        self.components = tuple(components)

    @property
    def mean(self) -> dict[str, Tensor]:
        """The mixture mean (the average of the component means)."""
        first, rest = self.components[0], self.components[1:]
        k = len(self.components)
        return {n: sum((c.mean[n] for c in rest), first.mean[n]) / k for n in first.mean}

    def sample(
        self, generator: torch.Generator | None = None, component: int | None = None
    ) -> dict[str, Tensor]:
        """One sample of the mixture: a uniformly drawn component (or the given one), then its Gaussian.

        Args:
            generator: Random generator; ``None`` for the global RNG.
            component: Index of the component to sample from; ``None`` draws it uniformly.

        Returns:
            Parameter name -> sampled tensor.
        """
        k = len(self.components)
        if component is None:
            device = None if generator is None else generator.device
            component = int(torch.randint(k, (1,), generator=generator, device=device).item())
        if not 0 <= component < k:
            raise ValueError(f"MultiIVON.sample: component must be in [0, {k}), got {component}")
        return self.components[component].sample(generator)


Posterior = GaussianPosterior | MultiIVON


def predict_mean(
    model: nn.Module, posterior: Posterior, fn: Callable[[nn.Module], Tensor]
) -> Tensor:
    """``fn(model)`` with the posterior mean swapped in, without gradients.

    Args:
        model: The model.
        posterior: A :class:`GaussianPosterior`, or a :class:`MultiIVON` of one component. The mean of a
            mixture of several runs is refused: independent runs sit in different modes (and permutations)
            of the weights, so their averaged weights are no meaningful network. Use :func:`predict_mc`, or
            ``predict_mean`` on each component.
        fn: Computes the output from the model, e.g. ``lambda m: m(x).logits``.

    Returns:
        The output at the mean.

    Raises:
        ValueError: For a :class:`MultiIVON` of several components.
    """
    if isinstance(posterior, MultiIVON) and len(posterior.components) > 1:
        raise ValueError(
            f"predict_mean: a MultiIVON of {len(posterior.components)} runs has no meaningful mean "
            "network (averaged weights of independent runs); use predict_mc, or predict_mean on each "
            "of posterior.components"
        )
    with torch.no_grad(), swapped_params(model, posterior.mean):
        return fn(model)


def predict_mc(
    model: nn.Module,
    posterior: Posterior,
    fn: Callable[[nn.Module], Tensor],
    n_samples: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Outputs of ``fn`` under ``n_samples`` weight samples, stacked: shape ``(n_samples, *out)``.

    Average ``softmax`` of the stack for the Bayesian model average. For :class:`MultiIVON` the samples cycle
    through the components (sample ``i`` from component ``i mod K``), a stratified draw from the uniform
    mixture; use a multiple of ``K`` samples.

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
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"predict_mc: n_samples must be an int >= 1, got {n_samples!r}")
    outs = []
    with torch.no_grad():
        for i in range(n_samples):
            if isinstance(posterior, MultiIVON):
                w = posterior.sample(generator, component=i % len(posterior.components))
            else:
                w = posterior.sample(generator)
            with swapped_params(model, w):
                outs.append(fn(model))
    return torch.stack(outs)
