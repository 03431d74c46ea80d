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
from partialbayes.ivon import _compiled as compiled_kernels
from partialbayes.ivon import _distributed as dist_utils
from partialbayes.ivon._math import draw_, price_product_, running_mean_, update_

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
    when the context exits (which also supports gradient accumulation over several backward passes inside
    one sample), after which ``.grad`` holds the running MC-averaged gradient until the next sample or step;
    ``torch.amp.GradScaler`` is supported (unscaling and skipped inf steps, see :meth:`step`).

    Cost: with one MC sample a step makes 4 passes over the parameters for the sample (incl. the normal
    draw) and 11 for the update, or 2 in all with ``compiled=True``; memory is AdamW's plus one parameter
    copy (the reused sample buffer).

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
        compiled: Run the sample and the update as ``torch.compile``'d fused kernels (one pass over the
            parameters each instead of 3 and 12; same noise, same results up to rounding). Compiles on first
            use (tens of seconds on a CPU, needs a C++ compiler there); if compilation fails it warns once
            and falls back to the eager kernels.

    Raises:
        ValueError: If a hyperparameter is out of range or ``hess_approx`` is unknown.
        TypeError: If a hyperparameter has the wrong type or a parameter is not floating point.
    """

    #: ``torch.amp.GradScaler.step`` hands this optimizer its scale and inf flag instead of unscaling ``.grad``
    _step_supports_amp_scaling = True

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
        compiled: bool = False,
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
        self.compiled = bool(compiled)
        self._rank_generators: dict[torch.device, torch.Generator] = {}
        self._masks: dict[Tensor, _Mask] = {}
        self._workspace = blocked.Workspace()
        self._sampling = False
        self._count = 0
        self._avg_grad: dict[Tensor, Tensor] = {}
        self._est: dict[Tensor, Tensor] = {}  # per variational parameter: see _math.EST_KINDS
        self._est_kind: str | None = None
        self._sample_bufs: dict[Any, Tensor] = {}  # (device, dtype) -> flat buffer of the samples
        self._est_bufs: dict[Any, Tensor] = {}  # the same for the statistic of several MC samples
        self._layout_cache: Any = None
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
        try:  # a rejected group must not stay behind (a later step would find it without state)
            _validate_group(group)
            for p in group["params"]:
                if not p.is_floating_point():
                    raise TypeError(f"IVON: parameters must be floating point, got dtype {p.dtype}")
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._layout_cache = None
        group.setdefault("step", 0)
        for p in group["params"]:
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
        if not any(bool(m.any()) if isinstance(m, Tensor) else m for m in masks.values()):
            raise ValueError("IVON.from_subset: the subset has no stochastic entries")
        params = [p for p in named.values() if p.requires_grad]
        opt = cls(params, **kwargs)
        opt._masks = {p: masks.get(p, False) for p in params}
        opt._layout_cache = None
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
        return g.clone() if g._base is not None else g  # never keep a view into someone's bucket

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as :meth:`torch.optim.Optimizer.zero_grad`, without touching collected samples.

        Between the samples of one step ``p.grad`` is the running MC-averaged gradient this optimizer
        collected (see :meth:`sampled_params`). It is detached from ``p.grad`` first (``p.grad`` becomes
        ``None`` there), so that ``zero_grad(set_to_none=False)`` never zeroes the average in place.

        Args:
            set_to_none: Set the other gradients to ``None`` instead of zeroing them.
        """
        self._release_grads()
        super().zero_grad(set_to_none=set_to_none)

    def _release_grads(self) -> None:
        """Detach the averaged gradients this optimizer exposes as ``p.grad`` (before a sample, after a step)."""
        for p, g in self._avg_grad.items():
            if p.grad is g:
                p.grad = None

    def _layout(self) -> dict[Tensor, tuple[tuple[torch.device, torch.dtype], int]]:
        """Offset of every variational parameter in the flat buffer of its (device, dtype)."""
        if self._layout_cache is None:
            layout: dict[Tensor, tuple[tuple[torch.device, torch.dtype], int]] = {}
            sizes: dict[tuple[torch.device, torch.dtype], int] = {}
            for _group, params in self._buckets():
                for p in params:
                    if self.variational_mask(p) is False or p in layout:
                        continue
                    key = (p.device, p.dtype)
                    layout[p] = (key, sizes.get(key, 0))
                    sizes[key] = sizes.get(key, 0) + p.numel()
            self._layout_cache = (layout, sizes)
        return self._layout_cache[0]

    def _views(self, store: dict[Any, Tensor]) -> dict[Tensor, Tensor]:
        """Views, shaped like each variational parameter, into the reused flat buffers of ``store``."""
        layout = self._layout()
        assert self._layout_cache is not None
        for key, size in self._layout_cache[1].items():
            buf = store.get(key)
            if buf is None or buf.numel() != size:
                store[key] = torch.empty(size, device=key[0], dtype=key[1])
        return {
            p: store[key][off : off + p.numel()].view(p.shape) for p, (key, off) in layout.items()
        }

    # --------------------------------------------------------------------------------------------- sampling
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Swap a weight sample ``w ~ N(m, σ²)`` into the parameters; restore the means on exit.

        The means are restored even if the body raises (the sample is then discarded). With
        ``train=True`` the gradients at ``w`` (``p.grad``, accumulated over any number of backward passes in
        the body; missing gradients count as zero) are collected on exit into the running gradient and
        Hessian statistics of the next :meth:`step`. Afterwards ``p.grad`` holds the running MC average of the
        gradient (the tensor :meth:`step` will use: a ``torch.amp.GradScaler`` checks and unscales it there),
        and it is detached again when the next sample is drawn and after the step.

        The samples live in one reused buffer per (device, dtype): a reference to a parameter kept from
        inside the block is overwritten by the next sample.

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
                means, samples = self._draw(train)
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

    def _draw(self, train: bool) -> tuple[dict[Tensor, Tensor], dict[Tensor, Tensor]]:
        """Put samples into the variational parameters; returns their means and samples by parameter."""
        if self._count and self._est_kind in ("sample", "grad"):
            self._materialize()  # the pending first sample's statistic must leave the sample buffer
        if train:
            self._release_grads()
        views = self._views(self._sample_bufs)
        means: dict[Tensor, Tensor] = {}
        for group, params in self._buckets():
            var = [p for p in params if p in views and p not in means]
            if not var:
                continue
            device = var[0].device
            gen = self._generator_for(device)
            std = 1.0 / math.sqrt(group["ess"])
            noise = [views[p] for p in var]
            # the noise: one normal_ per parameter, in order (the reference's order), all drawn first
            for z in noise:
                if gen is None or _same_device(torch.device(gen.device), device):
                    z.normal_(0.0, std, generator=gen)
                else:  # the generator lives elsewhere: draw there, copy over
                    z_gen = torch.empty(z.shape, dtype=z.dtype, device=gen.device)
                    z.copy_(z_gen.normal_(0.0, std, generator=gen))
            mean_views = [p.data for p in var]
            hess = [self.state[p]["hess"] for p in var]
            masks = self._mask_list(var)
            fn = functools.partial(
                draw_, std=std, delta=group["weight_decay"], generator=gen, draw=False
            )
            done: set[int] = set()
            if self._use_compiled(var):
                done = self._draw_compiled(noise, mean_views, hess, masks, group["weight_decay"])
            for idx in self._categories(var, masks):
                idx = [i for i in idx if i not in done]
                if idx:
                    sub = [_pick(noise, idx), _pick(mean_views, idx), _pick(hess, idx)]
                    blocked.apply(
                        fn, [*sub, _pick(masks, idx)], blocked=self._blocked(device),
                        workspace=self._workspace,
                    )  # fmt: skip
            for p, m, w in zip(var, mean_views, noise, strict=True):
                means[p] = m
                p.data = w
        return means, views

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

    def _use_compiled(self, params: list[Tensor]) -> bool:
        if not (self.compiled and compiled_kernels.available()):
            return False
        return all(p.is_contiguous() and self.state[p]["hess"].is_contiguous() for p in params)

    @staticmethod
    def _draw_compiled(
        noise: list[Tensor],
        means: list[Tensor],
        hess: list[Tensor],
        masks: list[Tensor | None],
        delta: float,
    ) -> set[int]:
        """Compiled :func:`draw_` (noise already drawn) on the large parameters; returns which were done."""
        c = compiled_kernels.scalars([delta], noise[0])
        done = set()
        for i, args in enumerate(zip(noise, means, hess, masks, strict=True)):
            if args[0].numel() > blocked.SMALL and compiled_kernels.draw_one(*args, c):
                done.add(i)
        return done

    @staticmethod
    def _blocked(device: torch.device) -> bool:
        return device.type == "cpu"

    @staticmethod
    def _restore(means: dict[Tensor, Tensor]) -> None:
        for p, m in means.items():
            p.data = m

    def _collect(self, samples: dict[Tensor, Tensor]) -> None:
        """Fold the gradients at the sample into the running statistics; expose the average as ``p.grad``.

        The first sample's Hessian statistic is left pending: with one MC sample per step it is computed
        inside the update (from the sample buffer and the gradient), which saves two passes and a buffer.
        """
        self._count += 1
        k = self._count
        if k == 1:
            self._est_kind = "sample" if self.hess_approx == "price" else "grad"
        for _group, params in self._buckets():
            grads = [self._take_grad(p) for p in params]
            if k == 1:
                self._avg_grad.update(zip(params, grads, strict=True))
                for p in params:
                    if p in samples and self.hess_approx == "price":
                        self._est[p] = samples[p]
            else:
                var = [i for i, p in enumerate(params) if p in samples]
                if var:
                    ws = [samples[params[i]] for i in var]
                    gs = [grads[i] for i in var]
                    if self.hess_approx == "price":
                        price_product_(ws, ws, [params[i].data for i in var], gs)
                    else:
                        for w, g in zip(ws, gs, strict=True):
                            torch.mul(g, g, out=w)
                    running_mean_([self._est[params[i]] for i in var], ws, k)
                running_mean_([self._avg_grad[p] for p in params], grads, k)
            for p in params:
                p.grad = self._avg_grad[p]

    def _materialize(self) -> None:
        """Move the pending statistic of the first sample (``ε·g`` or ``g²``) into its own buffers."""
        views = self._views(self._est_bufs)
        for p, e in views.items():
            g = self._avg_grad[p]
            if self._est_kind == "sample":
                price_product_([e], [self._est[p]], [p.data], [g])
            else:
                torch.mul(g, g, out=e)
            self._est[p] = e
        self._est_kind = "price" if self._est_kind == "sample" else "gradsq"

    def _discard(self) -> None:
        """Forget the collected samples (a skipped step)."""
        self._release_grads()
        self._count = 0
        self._est_kind = None
        self._avg_grad.clear()
        self._est.clear()

    # ------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update means, momentum and Hessian from the gradient samples collected since the last step.

        Works with ``torch.amp.GradScaler``: ``scaler.step(optimizer)`` passes its scale and inf flag
        (``_step_supports_amp_scaling``); a step with non-finite gradients is skipped without touching the
        state (means, momentum, ``h`` and the step counter stay as they were, the samples are dropped),
        otherwise the gradient statistics are unscaled before the update.

        Args:
            closure: Optional; computes the loss and calls ``backward()``. Called ``mc_samples`` times, each
                inside ``sampled_params(train=True)``; the returned losses are averaged.

        Returns:
            The average closure loss, or ``None`` without a closure.

        Raises:
            RuntimeError: If called inside ``sampled_params`` or with no gradient sample collected, or if a
                ``GradScaler`` unscaled the gradients of several MC samples before the step (call
                ``scaler.unscale_`` only with one sample per step).
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
        if not self._unscale():
            self._discard()
            return loss
        sync = self._sync_enabled()
        if sync and self._est_kind in ("sample", "grad"):
            self._materialize()
        for group in self.param_groups:
            group["step"] += 1
        for group, params in self._buckets():
            self._update_bucket(group, params, sync)
        self._discard()
        return loss

    def _unscale(self) -> bool:
        """Apply a GradScaler's scale and inf flag (set as attributes by ``scaler.step``); ``False``: skip."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return True
        if float(found_inf) != 0.0:
            return False
        grad_scale = getattr(self, "grad_scale", None)
        if (
            grad_scale is None
        ):  # the user called scaler.unscale_(optimizer): p.grad is unscaled already
            if self._est_kind in ("price", "gradsq"):
                raise RuntimeError(
                    "IVON with GradScaler: scaler.unscale_(optimizer) unscales only the averaged gradient, "
                    "not the Hessian statistic of several MC samples; with mc_samples > 1 let "
                    "scaler.step(optimizer) unscale"
                )
            return True
        inv = 1.0 / float(grad_scale)
        for _group, params in self._buckets():
            torch._foreach_mul_([self._avg_grad[p] for p in params], inv)
            est = [self._est[p] for p in params if p in self._est]
            if est and self._est_kind == "price":
                torch._foreach_mul_(est, inv)
            elif est and self._est_kind == "gradsq":
                torch._foreach_mul_(est, inv * inv)
        return True

    def _update_bucket(self, group: dict[str, Any], params: list[Tensor], sync: bool) -> None:
        delta = group["weight_decay"]
        grads = [self._avg_grad[p] for p in params]
        est_all = [self._est.get(p) for p in params]
        if sync:
            dist_utils.all_reduce_mean_(grads)
            dist_utils.all_reduce_mean_([e for e in est_all if e is not None])
        masks = self._mask_list(params)
        hyper = {
            "beta1": group["beta1"],
            "beta2": group["beta2"],
            "delta": delta,
            "ess": group["ess"],
            "lr": group["lr"] * (group["hess_init"] + delta) if self.rescale_lr else group["lr"],
            "debias": 1.0 - group["beta1"] ** group["step"] if self.debias else 1.0,
            "clip_radius": group["clip_radius"],
        }
        means = [p.data for p in params]
        momentum = [self.state[p]["momentum"] for p in params]
        hess = [self.state[p]["hess"] for p in params]
        # homogeneous lists: (variational, has a partial mask)
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for i, p in enumerate(params):
            variational = self.variational_mask(p) is not False
            kinds.setdefault((variational, masks[i] is not None), []).append(i)
        if self._use_compiled(params):
            c = compiled_kernels.scalars(
                [
                    1.0 - hyper["beta1"], delta, hyper["ess"], 1.0 - hyper["beta2"],
                    0.5 * (1.0 - hyper["beta2"]) ** 2, hyper["debias"] * delta,
                    -hyper["lr"] / hyper["debias"], hyper["debias"] * hyper["clip_radius"],
                ],
                params[0],
            )  # fmt: skip
            clip = hyper["clip_radius"] != math.inf
            todo = []
            for i, p in enumerate(params):
                kind = self._est_kind if self.variational_mask(p) is not False else None
                args = (means[i], momentum[i], hess[i], grads[i], est_all[i], masks[i], c)
                if not (
                    p.numel() > blocked.SMALL
                    and compiled_kernels.flat_ok(*args[:6])
                    and compiled_kernels.update_one(*args, kind, clip)
                ):
                    todo.append(i)
            if not todo:
                return
            kinds = {k: [i for i in v if i in todo] for k, v in kinds.items()}
        for (variational, _), idx in kinds.items():
            if not idx:
                continue
            fn = functools.partial(
                update_, est_kind=self._est_kind if variational else None, **hyper
            )
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
        self._discard()
