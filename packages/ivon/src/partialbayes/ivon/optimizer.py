"""The IVON optimizer (Shen et al., ICML 2024, Alg. 1) as a ``torch.optim.Optimizer``."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from partialbayes.ivon import _blocked as blocked
from partialbayes.ivon import _distributed as dist_utils
from partialbayes.ivon._math import collect_price_, running_mean_, sample_, update_

if TYPE_CHECKING:  # the selection package is an optional extra: never imported at run time
    from partialbayes.selection import Subset

HESS_APPROX = ("price", "gradsq")

_Mask = Tensor | bool  # True: all entries variational; False: none; BoolTensor: those entries


def _check_hyper(
    name: str, value: Any, *, low: float, high: float, low_open: bool, high_open: bool
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"IVON: {name} must be a real number, got {type(value).__name__} {value!r}")
    ok_low = value > low if low_open else value >= low
    ok_high = value < high if high_open else value <= high
    if math.isnan(value) or not (ok_low and ok_high):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"IVON: {name} must lie in {lo}{low}, {high}{hi}, got {value!r}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _pick(items: list[Any], idx: list[int]) -> list[Any] | None:
    """``items`` at ``idx``, or ``None`` if all of those are ``None``."""
    out = [items[i] for i in idx]
    return None if all(x is None for x in out) else out


def _validate_group(group: Mapping[str, Any]) -> None:
    inf = math.inf
    _check_hyper("lr", group["lr"], low=0, high=inf, low_open=True, high_open=True)
    _check_hyper("ess", group["ess"], low=0, high=inf, low_open=True, high_open=True)
    _check_hyper("hess_init", group["hess_init"], low=0, high=inf, low_open=True, high_open=True)
    _check_hyper("beta1", group["beta1"], low=0, high=1, low_open=False, high_open=True)
    _check_hyper("beta2", group["beta2"], low=0, high=1, low_open=False, high_open=True)
    _check_hyper(
        "weight_decay", group["weight_decay"], low=0, high=inf, low_open=False, high_open=True
    )
    _check_hyper(
        "clip_radius", group["clip_radius"], low=0, high=inf, low_open=True, high_open=False
    )


class IVON(torch.optim.Optimizer):
    r"""Improved Variational Online Newton: a mean-field Gaussian posterior learned at Adam-like cost.

    Each parameter entry has a mean ``m`` (held in the parameter itself), a Hessian estimate ``h`` and a
    gradient momentum; the posterior is ``N(m, σ²)`` with ``σ = 1/√(ess·(h+δ))``, ``δ = weight_decay``.
    Training draws weights inside :meth:`sampled_params`, back-propagates there, and calls :meth:`step`::

        for x, y in loader:
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()
            optimizer.step()

    or, equivalently, ``optimizer.step(closure)`` with a closure that computes the loss and calls
    ``backward()`` (the optimizer wraps each of its ``mc_samples`` calls in ``sampled_params(train=True)``;
    unlike ``ivon-opt``, the closure must not enter ``sampled_params`` itself).

    The loss is the **mean** over the batch, as for AdamW; ``ess`` (typically the training-set size) turns it
    into a sum. The update per step ``t`` (``ε = w − m`` the applied noise, averages over the MC samples)::

        ĝ = mean(g);  ĥ = mean(ε·g)·ess·(h+δ)  ("price")   or   ĥ = mean(g²)  ("gradsq")
        μ ← β1·μ + (1−β1)·ĝ
        h ← β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ)
        m ← m − α·clip((μ/(1−β1ᵗ) + δ·m)/(h+δ), ±clip_radius),   α = lr·(hess_init+δ) if rescale_lr

    Differences from ``ivon-opt`` 0.1.3, on purpose: the step counter is part of :meth:`state_dict` (the
    reference loses it, so a resumed run debiases its momentum as if at step 1 — a first step about
    ``1/(1−β1)`` = 10× too large); ``"gradsq"`` uses ``mean(g²)`` without the reference's extra factor
    ``ess`` (``h`` is the Hessian of the *mean* loss, on which scale ``g²`` already lives); parameters may
    live on several devices and dtypes; ``step()`` without a collected sample raises; gradients are read
    (and consumed: ``.grad`` is ``None`` afterwards) when the context exits, which also supports gradient
    accumulation over several backward passes inside one sample.

    Distributed data parallel: when ``torch.distributed`` is initialised (and ``sync`` is not ``False``),
    each rank draws its own noise (seeded by ``torch.initial_seed() + 7919·rank`` unless a generator is
    given — then seed it differently per rank yourself) and :meth:`step` all-reduces (averages) both the
    MC-averaged gradient and the Hessian estimate, so every rank takes the same step.

    Args:
        params: Parameters or parameter groups (dicts may override every hyperparameter but
            ``mc_samples``, ``hess_approx``, ``rescale_lr`` and ``debias``).
        lr: Learning rate, > 0.
        ess: Effective sample size λ (usually the number of training examples), > 0.
        hess_init: Initial Hessian ``h₀`` > 0.
        beta1: Gradient momentum in ``[0, 1)``.
        beta2: Hessian momentum in ``[0, 1)``.
        weight_decay: δ ≥ 0, the prior precision divided by ``ess``.
        mc_samples: Number of weight samples per :meth:`step` when a closure is given.
        hess_approx: ``"price"`` (reparameterisation trick, the paper's) or ``"gradsq"``.
        clip_radius: Element-wise clipping radius of the preconditioned step (``inf``: none).
        rescale_lr: Multiply ``lr`` by ``hess_init + weight_decay`` (as the reference and the paper do).
        debias: Debias the gradient momentum by ``1 − β1ᵗ``.
        sync: All-reduce across ranks; ``None`` means "when torch.distributed is initialised".
        generator: Generator for the noise (same seed, same trajectory). Noise for a parameter on another
            device than the generator is drawn on the generator's device and copied. ``None``: the global RNG.

    Raises:
        ValueError: If a hyperparameter is out of range or ``hess_approx`` is unknown.
        TypeError: If a hyperparameter has the wrong type or a parameter is not floating point.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        ess: float,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99999,
        weight_decay: float = 1e-4,
        mc_samples: int = 1,
        hess_approx: str = "price",
        clip_radius: float = math.inf,
        rescale_lr: bool = True,
        debias: bool = True,
        sync: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"IVON: mc_samples must be an int >= 1, got {mc_samples!r}")
        if hess_approx not in HESS_APPROX:
            raise ValueError(f"IVON: hess_approx must be one of {HESS_APPROX}, got {hess_approx!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"IVON: generator must be a torch.Generator, got {type(generator).__name__}"
            )
        self.mc_samples = mc_samples
        self.hess_approx = hess_approx
        self.rescale_lr = bool(rescale_lr)
        self.debias = bool(debias)
        self.sync = sync
        self.generator = generator
        self._rank_generators: dict[torch.device, torch.Generator] = {}
        self._masks: dict[Tensor, _Mask] = {}
        self._workspace = blocked.Workspace()
        self._sampling = False
        self._count = 0
        self._avg_grad: dict[Tensor, Tensor] = {}
        self._avg_hess: dict[Tensor, Tensor] = {}
        defaults = {
            "lr": lr,
            "ess": ess,
            "hess_init": hess_init,
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": weight_decay,
            "clip_radius": clip_radius,
        }
        _validate_group(defaults)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------------- set-up
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (validated), initialising its momentum to 0 and Hessian to ``hess_init``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        group.setdefault("step", 0)
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(f"IVON: parameters must be floating point, got dtype {p.dtype}")
            self.state[p] = {
                "momentum": torch.zeros_like(p, memory_format=torch.preserve_format),
                "hess": torch.full_like(p, group["hess_init"], memory_format=torch.preserve_format),
            }

    @classmethod
    def from_subset(cls, model: nn.Module, subset: Subset, **kwargs: Any) -> IVON:
        """IVON over a model's trainable parameters, variational only on the entries of ``subset``.

        Entries outside the subset get no noise and keep ``h = hess_init`` (no Hessian update), so their
        mean follows a heavy-ball SGD step of size ``lr`` (with ``rescale_lr``) with weight decay δ.

        Args:
            model: The model; ``subset`` names its parameters (``model.named_parameters()``).
            subset: A ``partialbayes.selection.Subset`` (anything with ``names`` and ``mask(name)``).
            **kwargs: Arguments of :class:`IVON` (``lr`` and ``ess`` are required).

        Returns:
            The optimizer.

        Raises:
            ValueError: If the subset names a parameter the model lacks or that is frozen, a mask has the
                wrong shape, or the subset is empty.
        """
        named = dict(model.named_parameters())
        masks: dict[Tensor, _Mask] = {}
        for name in subset.names:
            if name not in named:
                raise ValueError(
                    f"IVON.from_subset: subset names parameter {name!r}, not in the model"
                )
            p = named[name]
            if not p.requires_grad:
                raise ValueError(f"IVON.from_subset: subset parameter {name!r} is frozen")
            mask = subset.mask(name)
            if tuple(mask.shape) != tuple(p.shape) or mask.dtype != torch.bool:
                raise ValueError(
                    f"IVON.from_subset: mask of {name!r} has shape {tuple(mask.shape)} / {mask.dtype}, "
                    f"expected bool of the storage shape {tuple(p.shape)}"
                )
            masks[p] = True if bool(mask.all()) else mask.to(p.device)
        if not any(m is True or bool(m.any()) for m in masks.values()):
            raise ValueError("IVON.from_subset: the subset has no stochastic entries")
        params = [p for p in named.values() if p.requires_grad]
        opt = cls(params, **kwargs)
        opt._masks = {p: masks.get(p, False) for p in params}
        return opt

    # ---------------------------------------------------------------------------------------------- helpers
    def _buckets(self) -> Iterator[tuple[dict[str, Any], list[Tensor]]]:
        """Each parameter group split by (device, dtype), so foreach kernels see homogeneous lists."""
        for group in self.param_groups:
            by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in group["params"]:
                by_key.setdefault((p.device, p.dtype), []).append(p)
            for params in by_key.values():
                yield group, params

    def variational_mask(self, p: Tensor) -> _Mask:
        """Which entries of parameter ``p`` are variational: ``True`` (all), ``False`` (none) or a mask."""
        return self._masks.get(p, True)

    def _generator_for(self, device: torch.device) -> torch.Generator | None:
        if self.generator is not None:
            return self.generator
        if self._sync_enabled():
            if device not in self._rank_generators:
                gen = torch.Generator(device=device)
                gen.manual_seed(dist_utils.rank_seed(torch.initial_seed()))
                self._rank_generators[device] = gen
            return self._rank_generators[device]
        return None

    def _sync_enabled(self) -> bool:
        return self.sync is not False and dist_utils.is_distributed()

    def _take_grad(self, p: Tensor) -> Tensor:
        g = p.grad
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            raise TypeError("IVON does not support sparse gradients")
        p.grad = None
        return g.clone() if g._base is not None else g  # never keep a view into someone's bucket

    # --------------------------------------------------------------------------------------------- sampling
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Swap a weight sample ``w ~ N(m, σ²)`` into the parameters; restore the means on exit.

        The means are restored even if the body raises (the sample is then discarded). With
        ``train=True`` the gradients at ``w`` (``p.grad``, accumulated over any number of backward passes in
        the body; missing gradients count as zero) are consumed on exit and averaged into the running
        gradient and Hessian estimates used by the next :meth:`step`.

        Args:
            train: Collect the gradient sample for training.

        Yields:
            Nothing; the model's parameters hold the sample inside the block.

        Raises:
            RuntimeError: If already inside ``sampled_params`` of this optimizer.
        """
        if self._sampling:
            raise RuntimeError("IVON.sampled_params: already inside sampled_params (nested use)")
        self._sampling = True
        try:
            with torch.no_grad():
                means, samples = self._draw()
        except BaseException:
            self._sampling = False
            raise
        try:
            yield
        except BaseException:
            self._restore(means)
            self._sampling = False
            raise
        self._restore(means)
        self._sampling = False
        if train:
            with torch.no_grad():
                self._collect(samples)

    def _draw(self) -> tuple[dict[Tensor, Tensor], dict[Tensor, Tensor]]:
        """Put samples into the variational parameters; returns their means and samples by parameter."""
        means: dict[Tensor, Tensor] = {}
        samples: dict[Tensor, Tensor] = {}
        for group, params in self._buckets():
            var = [p for p in params if self.variational_mask(p) is not False]
            if not var:
                continue
            device = var[0].device
            gen = self._generator_for(device)
            std = 1.0 / math.sqrt(group["ess"])
            is_blocked = self._blocked(device)
            noise = [torch.empty_like(p, memory_format=torch.contiguous_format) for p in var]
            # noise is drawn per parameter in order; on the CPU chunk by chunk inside the blocked pass
            draw_in_pass = is_blocked and (
                gen is None or _same_device(torch.device(gen.device), device)
            )
            if not draw_in_pass:
                for i, (z, p) in enumerate(zip(noise, var, strict=True)):
                    if gen is None or _same_device(torch.device(gen.device), device):
                        z.normal_(0.0, std, generator=gen)
                    else:  # the generator lives elsewhere: draw there, copy over
                        z_gen = torch.empty(p.shape, dtype=p.dtype, device=gen.device)
                        noise[i] = z_gen.normal_(0.0, std, generator=gen).to(device)
            mean_views = [p.data for p in var]
            hess = [self.state[p]["hess"] for p in var]
            masks = self._mask_list(var)
            fn = functools.partial(
                sample_, std=std, delta=group["weight_decay"], generator=gen, draw=draw_in_pass
            )
            if is_blocked:  # one parameter at a time, in order (the draw order)
                blocked.apply(
                    fn, [noise, mean_views, hess, masks], blocked=True, workspace=self._workspace
                )
            else:
                for idx in self._categories(var, masks):
                    sub = [_pick(noise, idx), _pick(mean_views, idx), _pick(hess, idx)]
                    blocked.apply(fn, [*sub, _pick(masks, idx)], blocked=False)
            for p, m, w in zip(var, mean_views, noise, strict=True):
                means[p] = m
                samples[p] = w
                p.data = w
        return means, samples

    def _mask_list(self, params: list[Tensor]) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for p in params:
            mask = self.variational_mask(p)
            out.append(mask if isinstance(mask, Tensor) else None)
        return out

    def _categories(self, params: list[Tensor], masks: list[Tensor | None]) -> list[list[int]]:
        """Index lists of parameters with and without a partial mask (homogeneous lists for foreach)."""
        with_mask = [i for i, m in enumerate(masks) if m is not None]
        without = [i for i, m in enumerate(masks) if m is None]
        return [idx for idx in (without, with_mask) if idx]

    @staticmethod
    def _blocked(device: torch.device) -> bool:
        return device.type == "cpu"

    @staticmethod
    def _restore(means: dict[Tensor, Tensor]) -> None:
        for p, m in means.items():
            p.data = m

    def _collect(self, samples: dict[Tensor, Tensor]) -> None:
        self._count += 1
        k = self._count
        for _group, params in self._buckets():
            grads = [self._take_grad(p) for p in params]
            if k == 1:
                self._avg_grad.update(zip(params, grads, strict=True))
            else:
                running_mean_([self._avg_grad[p] for p in params], grads, k)
            var = [(p, g) for p, g in zip(params, grads, strict=True) if p in samples]
            if not var:
                continue
            vp = [p for p, _ in var]
            vg = [g for _, g in var]
            avg = None if k == 1 else [self._avg_hess[p] for p in vp]
            if self.hess_approx == "price":
                est = [samples[p] for p in vp]
                blocked.apply(
                    functools.partial(collect_price_, count=k),
                    [est, [p.data for p in vp], vg, avg],
                    blocked=self._blocked(vp[0].device),
                )
            else:
                est = torch._foreach_mul(vg, vg)
                if avg is not None:
                    running_mean_(avg, est, k)
            if k == 1:
                self._avg_hess.update(zip(vp, est, strict=True))

    # ------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update means, momentum and Hessian from the gradient samples collected since the last step.

        Args:
            closure: Optional; computes the loss and calls ``backward()``. Called ``mc_samples`` times, each
                inside ``sampled_params(train=True)``; the returned losses are averaged.

        Returns:
            The average closure loss, or ``None`` without a closure.

        Raises:
            RuntimeError: If called inside ``sampled_params`` or with no gradient sample collected.
        """
        if self._sampling:
            raise RuntimeError(
                "IVON.step() was called inside sampled_params; call it after the block"
            )
        loss = None
        if closure is not None:
            losses = []
            for _ in range(self.mc_samples):
                with self.sampled_params(train=True), torch.enable_grad():
                    value = closure()
                losses.append(value.detach() if isinstance(value, Tensor) else value)
            loss = sum(losses) / len(losses)
        if self._count == 0:
            raise RuntimeError(
                "IVON.step() needs at least one gradient sample: run forward/backward inside "
                "`with optimizer.sampled_params(train=True):` first (or pass a closure)"
            )
        sync = self._sync_enabled()
        for group in self.param_groups:
            group["step"] += 1
        for group, params in self._buckets():
            self._update_bucket(group, params, sync)
        self._count = 0
        self._avg_grad.clear()
        self._avg_hess.clear()
        return loss

    def _update_bucket(self, group: dict[str, Any], params: list[Tensor], sync: bool) -> None:
        delta = group["weight_decay"]
        grads = [self._avg_grad[p] for p in params]
        est_all = [self._avg_hess.get(p) for p in params]
        if sync:
            dist_utils.all_reduce_mean_(grads)
            dist_utils.all_reduce_mean_([e for e in est_all if e is not None])
        masks = self._mask_list(params)
        fn = functools.partial(
            update_,
            price=self.hess_approx == "price",
            beta1=group["beta1"],
            beta2=group["beta2"],
            delta=delta,
            ess=group["ess"],
            lr=group["lr"] * (group["hess_init"] + delta) if self.rescale_lr else group["lr"],
            debias=1.0 - group["beta1"] ** group["step"] if self.debias else 1.0,
            clip_radius=group["clip_radius"],
        )
        means = [p.data for p in params]
        momentum = [self.state[p]["momentum"] for p in params]
        hess = [self.state[p]["hess"] for p in params]
        # homogeneous lists: (has a Hessian estimate, has a partial mask)
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for i in range(len(params)):
            kinds.setdefault((est_all[i] is not None, masks[i] is not None), []).append(i)
        for idx in kinds.values():
            blocked.apply(
                fn,
                [
                    _pick(means, idx),
                    _pick(momentum, idx),
                    _pick(hess, idx),
                    _pick(grads, idx),
                    _pick(est_all, idx),
                    _pick(masks, idx),
                ],
                blocked=self._blocked(params[0].device),
                workspace=self._workspace,
            )

    # ---------------------------------------------------------------------------------------------- state
    @property
    def current_step(self) -> int:
        """Steps taken by the first parameter group (the reference's attribute name)."""
        return int(self.param_groups[0]["step"]) if self.param_groups else 0

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state: momentum and Hessian per parameter, hyperparameters and step per group.

        Also holds the state of ``generator`` when one was given, so that a reloaded run continues exactly.
        Gradient samples collected since the last :meth:`step` are not saved (a warning says so).

        Returns:
            A dict as :meth:`torch.optim.Optimizer.state_dict` returns, plus ``"generator_state"``.
        """
        if self._count:
            warnings.warn(
                "IVON.state_dict: gradient samples collected since the last step are not saved",
                stacklevel=2,
            )
        out = super().state_dict()
        if self.generator is not None:
            out["generator_state"] = self.generator.get_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (step counters and the generator state included).

        Args:
            state_dict: The saved state.

        Raises:
            RuntimeError: If called inside ``sampled_params``.
        """
        if self._sampling:
            raise RuntimeError("IVON.load_state_dict: not allowed inside sampled_params")
        state_dict = dict(state_dict)
        gen_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            _validate_group(group)
            group.setdefault("step", 0)
        if gen_state is not None and self.generator is not None:
            self.generator.set_state(gen_state)
        self._count = 0
        self._avg_grad.clear()
        self._avg_hess.clear()
