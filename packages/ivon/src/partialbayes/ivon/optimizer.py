"""The IVON optimizer (Shen et al., ICML 2024, Alg. 1) as a ``torch.optim.Optimizer``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from partialbayes.ivon import _blocked as blocked
from partialbayes.ivon import _compiled as compiled_kernels
from partialbayes.ivon import _distributed as dist_utils
from partialbayes.ivon import _kernels as kernels
from partialbayes.ivon._checks import check_state_dict, validate_group
from partialbayes.ivon._math import Hyper
from partialbayes.ivon._noise import normal_

if TYPE_CHECKING:  # the selection package is an optional extra: never imported at run time
    from partialbayes.selection import Subset

HESS_APPROX = ("price", "gradsq")

#: With ``compiled=None``, a (device, dtype) bucket uses the compiled kernels when its parameters of more than
#: ``_blocked.SMALL`` entries hold at least this many entries in all (below, compiling does not pay).
AUTO_COMPILE_MIN = 1 << 22

_Mask = Tensor | bool  # True: all entries variational; False: none; BoolTensor: those entries


class IVON(torch.optim.Optimizer):
    r"""Improved Variational Online Newton: a mean-field Gaussian posterior learned at the cost of AdamW.

    Each parameter entry has a mean ``m`` (held in the parameter), a Hessian estimate ``h`` and a gradient
    momentum; the posterior is ``N(m, σ²)`` with ``σ = 1/√(ess·(h + weight_decay))``. Draw a weight sample
    with :meth:`sampled_params`, back-propagate inside it, then call :meth:`step`::

        for x, y in loader:
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()  # the loss is the *mean* over the batch, as for AdamW
            optimizer.step()

    or ``optimizer.step(closure)`` with a closure that computes the loss and calls ``backward()`` (the
    optimizer wraps each of its ``mc_samples`` calls in ``sampled_params(train=True)``).

    The update is :func:`partialbayes.ivon._math.ivon_update`, run as fused ``torch.compile``'d kernels on
    large models when a compiler is available, else eagerly (``compiled``). ``torch.amp.GradScaler`` and
    ``torch.distributed`` data parallelism are supported; non-finite gradients raise in :meth:`step`. The
    concept page (``docs/pages/concepts/ivon.md``) states the algorithm, the differences from ``ivon-opt``,
    the cost and the errors you may see.
    """

    #: ``torch.amp.GradScaler.step`` hands this optimizer its scale and inf flag instead of unscaling ``.grad``
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
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
        compiled: bool | None = None,
    ) -> None:
        """Create the optimizer.

        Args:
            params: Parameters or parameter groups (dicts may override every hyperparameter but
                ``mc_samples``, ``hess_approx``, ``rescale_lr`` and ``debias``); with a torch whose optimizers
                accept them, ``model.named_parameters()`` too (error messages then name the parameters).
            lr: Learning rate, > 0.
            ess: Effective sample size λ (usually the number of training examples), > 0.
            hess_init: Initial Hessian ``h₀`` > 0.
            beta1: Gradient momentum in ``[0, 1)``.
            beta2: Hessian momentum in ``[0, 1)``.
            weight_decay: δ ≥ 0, the prior precision divided by ``ess``.
            mc_samples: Number of weight samples per :meth:`step` when a closure is given.
            hess_approx: ``"price"`` (reparameterisation trick, the paper's) or ``"gradsq"`` (``mean(g²)``).
            clip_radius: Element-wise clipping radius of the preconditioned step (``inf``: none).
            rescale_lr: Multiply ``lr`` by ``hess_init + weight_decay`` (as the reference and the paper do).
            debias: Debias the gradient momentum by ``1 − β1ᵗ``.
            sync: All-reduce across ranks; ``None`` means "when torch.distributed is initialised".
            generator: Generator for the noise (same seed, same trajectory); ``None``: the global RNG.
            compiled: ``None`` (default): fused ``torch.compile``'d kernels for models of at least
                ``AUTO_COMPILE_MIN`` entries per device and dtype, falling back silently to the eager kernels
                where compilation fails; ``True``: compiled kernels for every parameter of more than 65,536
                entries (warns once if compilation fails); ``False``: eager kernels only. Both compute the
                same update (to rounding) from the same noise.

        Raises:
            ValueError: If a hyperparameter is out of range or ``hess_approx`` is unknown.
            TypeError: If a hyperparameter has the wrong type or a parameter is not floating point.
        """
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"IVON: mc_samples must be an int >= 1, got {mc_samples!r}")
        if hess_approx not in HESS_APPROX:
            raise ValueError(f"IVON: hess_approx must be one of {HESS_APPROX}, got {hess_approx!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"IVON: generator must be a torch.Generator, got {type(generator).__name__}"
            )
        if compiled is not None and not isinstance(compiled, bool):
            raise TypeError(f"IVON: compiled must be None, True or False, got {compiled!r}")
        self.mc_samples = mc_samples
        self.hess_approx = hess_approx
        self.rescale_lr = bool(rescale_lr)
        self.debias = bool(debias)
        self.sync = sync
        self.generator = generator
        self.compiled = compiled
        self._rank_generators: dict[torch.device, torch.Generator] = {}
        self._masks: dict[Tensor, _Mask] = {}
        self._names: dict[Tensor, str] = {}
        self._sampling = False
        self._count = 0  # gradient samples collected since the last step
        self._pending = (
            False  # one sample collected, its Hessian statistic not yet computed (see _collect)
        )
        self._avg_grad: dict[
            Tensor, Tensor
        ] = {}  # running MC mean of the gradient, exposed as p.grad
        self._stat: dict[
            Tensor, Tensor
        ] = {}  # running MC mean of the Hessian statistic (ε·g or g²)
        self._samples: dict[Tensor, Tensor] = {}  # the last weight sample, views into _sample_bufs
        self._sample_bufs: dict[Any, Tensor] = {}  # (device, dtype) -> one flat buffer
        self._stat_bufs: dict[Any, Tensor] = {}
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
        validate_group(defaults)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------------- set-up
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (validated), initialising its momentum to 0 and Hessian to ``hess_init``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:  # a rejected group must not stay behind (a later step would find it without state)
            validate_group(group)
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
            TypeError: If ``model`` is no ``nn.Module`` or ``subset`` has no ``names`` and ``mask``.
            ValueError: If the subset names a parameter the model lacks or that is frozen, a mask has the
                wrong shape, or the subset is empty.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"IVON.from_subset: model must be an nn.Module, got {type(model).__name__}"
            )
        if not (hasattr(subset, "names") and callable(getattr(subset, "mask", None))):
            raise TypeError(
                f"IVON.from_subset: subset must have `names` and `mask(name)`, got {type(subset).__name__}"
            )
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
            if (
                not isinstance(mask, Tensor)
                or tuple(mask.shape) != tuple(p.shape)
                or mask.dtype != torch.bool
            ):
                raise ValueError(
                    f"IVON.from_subset: mask of {name!r} must be a bool tensor of the storage shape "
                    f"{tuple(p.shape)}, got {_describe(mask)}"
                )
            masks[p] = True if bool(mask.all()) else mask.to(p.device)
        if not any(bool(m.any()) if isinstance(m, Tensor) else m for m in masks.values()):
            raise ValueError("IVON.from_subset: the subset has no stochastic entries")
        params = [p for p in named.values() if p.requires_grad]
        opt = cls(params, **kwargs)
        opt._masks = {p: masks.get(p, False) for p in params}
        opt._names = {p: n for n, p in named.items()}
        opt._layout_cache = None
        return opt

    def variational_mask(self, p: Tensor) -> _Mask:
        """Which entries of parameter ``p`` are variational: ``True`` (all), ``False`` (none) or a mask."""
        return self._masks.get(p, True)

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

    # --------------------------------------------------------------------------------------------- sampling
    @contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Swap a weight sample ``w ~ N(m, σ²)`` into the parameters; restore the means on exit.

        The means are restored even if the body raises (the sample is then discarded). With
        ``train=True`` the gradients at ``w`` (``p.grad``, accumulated over any number of backward passes in
        the body; missing gradients count as zero) are collected on exit for the next :meth:`step`.
        Afterwards ``p.grad`` holds the running MC average of the gradient (the tensor :meth:`step` will
        use: a ``torch.amp.GradScaler`` checks and unscales it there); it is detached again when the next
        sample is drawn and after the step. The samples live in one reused buffer per (device, dtype): a
        reference to a parameter kept from inside the block is overwritten by the next sample.

        Args:
            train: Collect the gradient sample for training.

        Yields:
            Nothing; the model's parameters hold the sample inside the block.

        Raises:
            RuntimeError: If already inside ``sampled_params`` of this optimizer.
            TypeError: If ``train`` is not a bool.
        """
        if not isinstance(train, bool):
            raise TypeError(f"IVON.sampled_params: train must be a bool, got {train!r}")
        if self._sampling:
            raise RuntimeError("IVON.sampled_params: already inside sampled_params (nested use)")
        self._sampling = True
        try:
            with torch.no_grad():
                means = self._draw(train)
        except BaseException:
            self._sampling = False
            raise
        try:
            yield
        finally:
            for p, m in means.items():
                p.data = m
            self._sampling = False
        if train:
            with torch.no_grad():
                self._collect()

    def _draw(self, train: bool) -> dict[Tensor, Tensor]:
        """Put a weight sample into every variational parameter; returns their means."""
        if self._pending:
            self._materialize()  # the first sample's statistic must leave the sample buffer
        if train:
            self._release_grads()
        self._samples = self._views(self._sample_bufs)
        means: dict[Tensor, Tensor] = {}
        for group, params in self._buckets():
            var = [p for p in params if p in self._samples]
            if not var:
                continue
            noise = [self._samples[p] for p in var]
            normal_(noise, 1.0 / math.sqrt(group["ess"]), self._generator_for(var[0].device))
            items = [
                (z, p.data, self.state[p]["hess"], self._mask_tensor(p))
                for z, p in zip(noise, var, strict=True)
            ]
            blocked.apply(
                kernels.sample_,
                items,
                writes=1,
                weight_decay=float(group["weight_decay"]),
                **self._compile_opts(var),
            )
            for p, w in zip(var, noise, strict=True):
                means[p] = p.data
                p.data = w
        return means

    def _collect(self) -> None:
        """Fold the gradients at the sample into the running means; expose the gradient mean as ``p.grad``.

        The first sample's Hessian statistic is left pending (``_pending``): with one MC sample per step it is
        computed inside the update, from the sample buffer and the gradient, which saves a pass. A second
        sample first moves it into its own buffer (:meth:`_materialize`).
        """
        self._count += 1
        k = self._count
        for _group, params in self._buckets():
            grads = [self._take_grad(p) for p in params]
            if k == 1:
                self._avg_grad.update(zip(params, grads, strict=True))
            else:
                var = [(p, g) for p, g in zip(params, grads, strict=True) if p in self._stat]
                items = [(self._stat[p], g, self._sample_of(p), p.data) for p, g in var]
                blocked.apply(kernels.stat_, items, writes=1, hess_approx=self.hess_approx, count=k)
                torch._foreach_lerp_([self._avg_grad[p] for p in params], grads, 1.0 / k)
            for p in params:
                p.grad = self._avg_grad[p]
        self._pending = k == 1 and bool(self._samples)

    def _materialize(self) -> None:
        """Compute the pending statistic of the first sample (``ε·g`` or ``g²``) into its own buffers."""
        self._stat = self._views(self._stat_bufs)
        items = [(s, self._avg_grad[p], self._sample_of(p), p.data) for p, s in self._stat.items()]
        blocked.apply(kernels.stat_, items, writes=1, hess_approx=self.hess_approx, count=1)
        self._pending = False

    def _sample_of(self, p: Tensor) -> Tensor | None:
        """The weight sample of ``p`` if the Hessian statistic needs it (``"price"``)."""
        return self._samples[p] if self.hess_approx == "price" else None

    def _discard(self) -> None:
        """Forget the collected samples (after a step, or a skipped one)."""
        self._release_grads()
        self._count = 0
        self._pending = False
        self._avg_grad.clear()
        self._stat = {}

    # ------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update means, momentum and Hessian from the gradient samples collected since the last step.

        With ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` passes its scale and inf flag
        (``_step_supports_amp_scaling``): a step with non-finite gradients is skipped without touching the
        state (means, momentum, ``h`` and the step counter stay as they were, the samples are dropped),
        otherwise the gradient statistics are unscaled before the update. Without a scaler, non-finite
        gradients raise (the state is left untouched and the samples are dropped).

        Args:
            closure: Optional; computes the loss and calls ``backward()``. Called ``mc_samples`` times, each
                inside ``sampled_params(train=True)``; the returned losses are averaged.

        Returns:
            The average closure loss, or ``None`` without a closure (or if the closure returns ``None``).

        Raises:
            RuntimeError: If called inside ``sampled_params`` or with no gradient sample collected, or if a
                ``GradScaler`` unscaled the gradients of several MC samples before the step (call
                ``scaler.unscale_`` only with one sample per step).
            ValueError: If the collected gradient of a parameter holds NaN or inf (no GradScaler); the
                message names the parameters.
            TypeError: If ``closure`` is not callable.
        """
        if self._sampling:
            raise RuntimeError(
                "IVON.step() was called inside sampled_params; call it after the block"
            )
        loss = None if closure is None else self._run_closure(closure)
        if self._count == 0:
            raise RuntimeError(
                "IVON.step() needs at least one gradient sample: run forward/backward inside "
                "`with optimizer.sampled_params(train=True):` first (or pass a closure)"
            )
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        if found_inf is not None and float(found_inf) != 0.0:
            self._discard()
            return loss
        if found_inf is not None:
            self._unscale(getattr(self, "grad_scale", None))
        if self._sync_enabled():
            self._all_reduce()
        if found_inf is None:
            self._check_finite()
        for group in self.param_groups:
            group["step"] += 1
        for group, params in self._buckets():
            self._update(group, params)
        self._discard()
        return loss

    def _run_closure(self, closure: Callable[[], Any]) -> Any:
        if not callable(closure):
            raise TypeError(f"IVON.step: closure must be callable, got {type(closure).__name__}")
        losses = []
        for _ in range(self.mc_samples):
            with self.sampled_params(train=True), torch.enable_grad():
                value = closure()
            losses.append(value.detach() if isinstance(value, Tensor) else value)
        return None if any(v is None for v in losses) else sum(losses) / len(losses)

    def _unscale(self, grad_scale: Tensor | None) -> None:
        """Divide the collected statistics by a GradScaler's scale (``None``: the user unscaled ``p.grad``)."""
        if grad_scale is None:
            if self._count > 1:
                raise RuntimeError(
                    "IVON with GradScaler: scaler.unscale_(optimizer) unscales only the averaged gradient, "
                    "not the Hessian statistic of several MC samples; with mc_samples > 1 let "
                    "scaler.step(optimizer) unscale"
                )
            return
        inv = 1.0 / float(grad_scale)
        for _group, params in self._buckets():
            torch._foreach_mul_([self._avg_grad[p] for p in params], inv)
            stats = [self._stat[p] for p in params if p in self._stat]
            if stats:  # a pending statistic is computed later from the unscaled gradient
                torch._foreach_mul_(stats, inv if self.hess_approx == "price" else inv * inv)

    def _all_reduce(self) -> None:
        """Average the gradient and Hessian statistics over the ranks (one all-reduce per bucket)."""
        if self._pending:
            self._materialize()
        for _group, params in self._buckets():
            dist_utils.all_reduce_mean_([self._avg_grad[p] for p in params])
            dist_utils.all_reduce_mean_([self._stat[p] for p in params if p in self._stat])

    def _check_finite(self) -> None:
        """Raise, naming the parameters, if a collected gradient holds NaN or inf; the samples are dropped."""
        bad: list[str] = []
        for _group, params in self._buckets():
            params = [p for p in params if p.numel()]
            if not params:
                continue
            # min and max propagate NaN and show ±inf, and cannot overflow (a sum or a norm can)
            extremes = torch.stack([torch.stack(torch.aminmax(self._avg_grad[p])) for p in params])
            finite = torch.isfinite(extremes).all(dim=1)
            if not bool(finite.all()):
                bad += [
                    self._label(p) for p, ok in zip(params, finite.tolist(), strict=True) if not ok
                ]
        if bad:
            self._discard()
            raise ValueError(
                f"IVON.step: non-finite gradients (NaN or inf) in {', '.join(bad)}; no step was taken, the "
                "state is unchanged and the collected samples were dropped (use torch.amp.GradScaler to "
                "skip such steps instead)"
            )

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """The IVON update of one bucket, in place: learned ``h`` on variational entries, fixed elsewhere."""
        hyper = self._hyper(group)
        learn, fixed = [], []
        for p in params:
            state = self.state[p]
            head = (p.data, state["momentum"], state["hess"], self._avg_grad[p])
            if self.variational_mask(p) is False:
                fixed.append((*head, None, None, None))
                continue
            sample = self._sample_of(p) if self._pending else None
            learn.append((*head, sample, self._stat.get(p), self._mask_tensor(p)))
        opts = self._compile_opts(params)
        for items, learn_hess in ((learn, True), (fixed, False)):
            blocked.apply(
                kernels.update_, items, writes=3, hyper=hyper, hess_approx=self.hess_approx,
                learn_hess=learn_hess, **opts,
            )  # fmt: skip

    def _hyper(self, group: dict[str, Any]) -> Hyper:
        delta = float(group["weight_decay"])
        lr = float(group["lr"]) * (float(group["hess_init"]) + delta if self.rescale_lr else 1.0)
        clip = float(group["clip_radius"])
        return Hyper(
            lr=lr,
            beta1=float(group["beta1"]),
            beta2=float(group["beta2"]),
            weight_decay=delta,
            ess=float(group["ess"]),
            bias_correction=1.0 - float(group["beta1"]) ** group["step"] if self.debias else 1.0,
            clip_radius=None if clip == math.inf else clip,
        )

    # ---------------------------------------------------------------------------------------------- helpers
    def _buckets(self) -> Iterator[tuple[dict[str, Any], list[Tensor]]]:
        """Each parameter group split by (device, dtype), so that one call sees homogeneous tensors."""
        for group in self.param_groups:
            by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in group["params"]:
                by_key.setdefault((p.device, p.dtype), []).append(p)
            for params in by_key.values():
                yield group, params

    def _mask_tensor(self, p: Tensor) -> Tensor | None:
        mask = self.variational_mask(p)
        return mask if isinstance(mask, Tensor) else None

    def _compile_opts(self, params: list[Tensor]) -> dict[str, bool]:
        """Whether a bucket runs the compiled kernels (see ``compiled``), and whether a failure warns."""
        if self.compiled is False or not compiled_kernels.available():
            return {"compiled": False, "warn": False}
        if self.compiled:
            return {"compiled": True, "warn": True}
        large = sum(p.numel() for p in params if p.numel() > blocked.SMALL)
        return {"compiled": large >= AUTO_COMPILE_MIN, "warn": False}

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

    def _release_grads(self) -> None:
        """Detach the averaged gradients this optimizer exposes as ``p.grad`` (before a sample, after a step)."""
        for p, g in self._avg_grad.items():
            if p.grad is g:
                p.grad = None

    def _views(self, store: dict[Any, Tensor]) -> dict[Tensor, Tensor]:
        """Views, shaped like each variational parameter, into one reused flat buffer per (device, dtype)."""
        if self._layout_cache is None:
            layout: dict[Tensor, tuple[tuple[torch.device, torch.dtype], int]] = {}
            sizes: dict[tuple[torch.device, torch.dtype], int] = {}
            for _group, params in self._buckets():
                for p in params:
                    if self.variational_mask(p) is not False:
                        key = (p.device, p.dtype)
                        layout[p] = (key, sizes.get(key, 0))
                        sizes[key] = sizes.get(key, 0) + p.numel()
            self._layout_cache = (layout, sizes)
        layout, sizes = self._layout_cache
        for key, size in sizes.items():
            if key not in store or store[key].numel() != size:
                store[key] = torch.empty(size, device=key[0], dtype=key[1])
        return {
            p: store[key][off : off + p.numel()].view(p.shape) for p, (key, off) in layout.items()
        }

    def _label(self, p: Tensor) -> str:
        """``param_groups[g]['params'][i]`` with the parameter's name (when known) and shape, for messages."""
        for g, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    name = self._names.get(p, names[i] if names else None)
                    named = f" {name!r}" if name else ""
                    return f"parameter{named} (param_groups[{g}]['params'][{i}], shape {tuple(p.shape)})"
        return f"parameter of shape {tuple(p.shape)}"

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

        The whole state dict is checked before anything is changed: on an error the optimizer is as it was.

        Args:
            state_dict: The saved state.

        Raises:
            RuntimeError: If called inside ``sampled_params``.
            TypeError: If ``state_dict`` is no dict of the expected structure.
            ValueError: If it is not an IVON state dict or does not fit this optimizer's parameters (the
                message names the group and the parameter: another count, another shape, a missing or
                non-finite momentum or Hessian, a hyperparameter out of range).
        """
        if self._sampling:
            raise RuntimeError("IVON.load_state_dict: not allowed inside sampled_params")
        check_state_dict(state_dict, self.param_groups, self._label)
        state_dict = dict(state_dict)
        gen_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("step", 0)
        if gen_state is not None and self.generator is not None:
            self.generator.set_state(gen_state)
        self._discard()


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} / {value.dtype}"
    return type(value).__name__
