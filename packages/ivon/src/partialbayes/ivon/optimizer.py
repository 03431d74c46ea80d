"""The IVON optimizer (Shen et al., ICML 2024, Alg. 1) as a ``torch.optim.Optimizer``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from partialbayes.ivon import _kernels as kernels
from partialbayes.ivon._checks import check_state_dict, validate_group
from partialbayes.ivon._kernels import Fold, Hyper, Shift, Update, fold_, shift_, update_
from partialbayes.ivon._noise import normal_
from partialbayes.predictive.internal import (
    check_bool,
    check_choice,
    check_generator,
    check_int,
    check_number,
    check_type,
)

if TYPE_CHECKING:  # the selection package is an optional extra: never imported at run time
    from partialbayes.selection import Subset

HESS_APPROX = ("price", "gradsq")

#: With ``compiled=None``, a (device, dtype) bucket uses the compiled kernels when its parameters of more than
#: ``_kernels.SMALL[True]`` entries hold at least this many entries in all (below, compiling does not pay).
AUTO_COMPILE_MIN = 1 << 20

#: Parameters of these dtypes keep an exact copy of their means inside a sample (see `IVON.sampled_params`).
_HALF = (torch.float16, torch.bfloat16)

_Mask = Tensor | bool  # True: all entries variational; False: none; BoolTensor: those entries


class IVON(torch.optim.Optimizer):
    """Improved Variational Online Newton: a mean-field Gaussian posterior learned at the cost of AdamW.

    Each parameter entry has a mean ``m`` (held in the parameter), a Hessian estimate ``h`` and a gradient
    momentum; the posterior is ``N(m, σ²)`` with ``σ = 1/√(ess·(h + weight_decay))``. Draw a weight sample
    with :meth:`sampled_params`, back-propagate inside it, then call :meth:`step`::

        for x, y in loader:
            for _ in range(mc_samples):
                with optimizer.sampled_params(train=True):
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()  # the loss is the *mean* over the batch, as for AdamW
            optimizer.step()

    or ``optimizer.step(closure)`` (each of the ``mc_samples`` closure calls runs inside
    ``sampled_params(train=True)``). Memory between steps is AdamW's (momentum and ``h``). ``GradScaler``,
    ``torch.distributed`` data parallelism and the Hugging Face ``Trainer`` (:class:`IVONCallback`) are
    supported; the concept page (``docs/pages/concepts/ivon.md``) states the algorithm, the kernels, the
    differences from ``ivon-opt`` and the errors you may see.

    The private state: ``k`` samples collected since the last step, of batch sizes summing to ``w``:

    | state | ``_sampling`` | ``_count``, ``_weight`` | ``_avg_grad`` (= ``p.grad``) | ``_stat`` | ``_noise`` | ``_stash`` |
    |---|---|---|---|---|---|---|
    | idle (after ``__init__``, ``step``, ``load_state_dict``) | False | 0, 0 | empty | empty | empty | empty |
    | inside ``sampled_params`` | True | ``k``, ``w`` | the ``k`` samples' mean | their statistics' mean (``k ≥ 1``) | this sample's ``z`` | exact means (half precision, data-parallel) |
    | pending: after 1 sample | False | 1, ``w`` | its gradient | empty | its ``z`` (``"price"``) | empty |
    | after ``k ≥ 2`` samples | False | ``k``, ``w`` | weighted mean | weighted mean of ``z·g`` / ``g²`` | empty | empty |

    "Pending" is ``_count == 1`` with ``_stat`` empty (the one sample's statistic is computed inside the update);
    entering a sample in that state first folds it into ``_stat`` (``_materialize``), as the sample redraws
    ``_noise``. A completed ``train=True`` sample moves ``k`` to ``k + 1``; a failed or ``train=False`` one keeps
    ``k``. :meth:`step` needs ``k ≥ 1`` outside a sample and returns to idle (``_discard``), as does a skipped
    or refused step; a sample inside a sample is refused.
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
                ``mc_samples``, ``hess_approx``, ``rescale_lr`` and ``debias``), or ``model.named_parameters()``
                where torch accepts it (messages then name the parameters).
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
            compiled: ``None``: fused ``torch.compile``'d kernels for at least ``AUTO_COMPILE_MIN`` entries per
                device and dtype, silently eager where compiling fails; ``True``: compiled whatever the size (warns
                once on failure); ``False``: eager only. Both compute the same update to rounding.

        Raises:
            ValueError: If a hyperparameter is out of range or ``hess_approx`` is unknown.
            TypeError: If a hyperparameter has the wrong type or a parameter is not floating point.
        """
        check_int("IVON: mc_samples", mc_samples)
        check_choice("IVON: hess_approx", hess_approx, HESS_APPROX)
        check_generator(generator, "IVON: generator")
        if compiled is not None:
            check_bool("IVON: compiled", compiled)
        self.mc_samples = mc_samples
        self.hess_approx = hess_approx
        self.rescale_lr = bool(rescale_lr)
        self.debias = bool(debias)
        self.sync = sync
        self.generator = generator
        self.compiled = compiled
        self._rank_generators: dict[torch.device, torch.Generator] = {}
        self._plan_cache: tuple[list[tuple[int, int]], list[_Bucket]] | None = None
        self._masks: dict[Tensor, _Mask] = {}
        self._names: dict[Tensor, str] = {}
        self._sampling = False
        self._count, self._weight = 0, 0.0  # the states: see the class docstring
        self._avg_grad: dict[Tensor, Tensor] = {}
        self._stat: dict[Tensor, Tensor] = {}
        self._noise: dict[Tensor, Tensor] = {}
        self._stash: dict[Tensor, Tensor] = {}
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
                if p.is_meta:
                    raise ValueError(
                        f"IVON: {self._label(p)} is on the meta device (no values): load the real weights "
                        "(e.g. from_pretrained without device_map='meta') before building the optimizer"
                    )
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        group.setdefault("step", 0)
        self._plan_cache = None
        for p in group["params"]:
            self.state[p] = {
                "momentum": torch.zeros_like(p, memory_format=torch.preserve_format),
                "hess": torch.full_like(p, group["hess_init"], memory_format=torch.preserve_format),
            }

    @classmethod
    def from_subset(cls, model: nn.Module, subset: Subset, **kwargs: Any) -> IVON:
        """IVON over a model's trainable parameters, variational only on the entries of ``subset``.

        Entries outside the subset get no noise and keep ``h = hess_init``: heavy-ball SGD steps of size ``lr``
        (with ``rescale_lr``) with weight decay δ. ``subset`` is a ``partialbayes.selection.Subset`` (anything with
        ``names`` and ``mask(name)``); ``**kwargs`` are :class:`IVON`'s (``lr`` and ``ess`` required).

        Raises:
            TypeError: If ``model`` is no ``nn.Module`` or ``subset`` has no ``names`` and ``mask``.
            ValueError: If the subset names a parameter the model lacks or that is frozen, a mask has the
                wrong shape, or the subset is empty.
        """
        check_type("IVON.from_subset: model", model, nn.Module, "an nn.Module")
        if not (hasattr(subset, "names") and callable(getattr(subset, "mask", None))):
            raise TypeError(
                f"IVON.from_subset: subset must have `names` and `mask(name)`, got {type(subset).__name__}"
            )
        named = dict(model.named_parameters())
        masks: dict[Tensor, _Mask] = {}
        for name in subset.names:
            if name not in named:
                raise ValueError(f"IVON.from_subset: subset names {name!r}, not in the model")
            p = named[name]
            if not p.requires_grad:
                raise ValueError(f"IVON.from_subset: subset parameter {name!r} is frozen")
            mask = subset.mask(name)
            if not (
                isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape == p.shape
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
        opt._plan_cache = None
        opt._names = {p: n for n, p in named.items()}
        return opt

    def variational_mask(self, p: Tensor) -> _Mask:
        """Which entries of parameter ``p`` are variational: ``True`` (all), ``False`` (none) or a mask."""
        return self._masks.get(p, True)

    def posterior_std(self, p: Tensor) -> Tensor:
        """``σ = 1/√(ess·(h+δ))`` of parameter ``p`` (a new tensor), 0 outside its variational entries."""
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            raise KeyError(f"IVON.posterior_std: the optimizer does not hold {_describe(p)}")
        std = (self.state[p]["hess"] + group["weight_decay"]).mul(group["ess"]).rsqrt()
        mask = self.variational_mask(p)
        return std * mask if isinstance(mask, Tensor) else std if mask else torch.zeros_like(std)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """:meth:`torch.optim.Optimizer.zero_grad` that first detaches the collected MC-averaged gradient from ``p.grad``."""
        self._release_grads()
        super().zero_grad(set_to_none=set_to_none)

    # --------------------------------------------------------------------------------------------- sampling
    @contextmanager
    def sampled_params(
        self, train: bool = False, *, batch_size: float | None = None
    ) -> Iterator[None]:
        """Put a weight sample ``w = m + ε``, ``ε ~ N(0, σ²)``, into the parameters; restore the means on exit.

        The noise is added in place and subtracted on exit, also when the body raises (the sample is then
        discarded), so the means come back up to one rounding; half-precision parameters and data-parallel runs
        keep an exact copy of their means instead. With ``train=True`` the gradients at ``w`` (missing ones count
        as zero) are collected on exit, and ``p.grad`` then holds the weighted running MC average :meth:`step`
        will use.

        Args:
            train: Collect the gradient sample for training.
            batch_size: The number of examples behind this sample's gradient: the samples of a step, and the
                ranks of a data-parallel run, are averaged weighted by it (Shen et al., 2024, Alg. 1 note).
                ``None`` weighs every sample alike.

        Yields:
            Nothing; the model's parameters hold the sample inside the block.

        Raises:
            RuntimeError: If already inside ``sampled_params`` of this optimizer.
            TypeError: If ``train`` is not a bool.
            ValueError: If ``batch_size`` is not a number > 0.
        """
        if not isinstance(train, bool):
            raise TypeError(
                f"IVON.sampled_params: train must be a bool, got {type(train).__name__} {train!r}"
            )
        weight = 1.0
        if batch_size is not None:
            weight = check_number("IVON.sampled_params: batch_size", batch_size)
        if self._sampling:
            raise RuntimeError("IVON.sampled_params: already inside sampled_params (nested use)")
        self._sampling = True
        try:
            with torch.no_grad():
                self._enter(train)
        except BaseException:
            self._sampling = False
            raise
        completed = False
        try:
            yield
            completed = True
        finally:
            try:
                with torch.no_grad():
                    self._leave()
                    if completed and train:
                        self._collect(weight)
            finally:
                if self._stat or self._count != 1 or self.hess_approx != "price":
                    self._noise = {}  # no pending statistic waits for this sample's noise
                self._sampling = False

    def _enter(self, train: bool) -> None:
        """Draw the noise ``z`` and add ``ε = z/√(λ(h+δ))`` to every variational parameter, in place."""
        if self._count == 1 and not self._stat:
            self._materialize()  # the pending statistic needs its noise, which is redrawn now
        if train:
            self._release_grads()
        # data-parallel replicas must stay equal to the bit: no rank-specific rounding of the means
        exact = self.sync is not False and _distributed()
        for b in self._plan():
            params = b.var[0]
            if not params:
                continue
            device, generator = params[0].device, self.generator
            if generator is None and exact:  # each rank its own noise, seeded from the global seed
                if device not in self._rank_generators:
                    seed = (torch.initial_seed() + 7919 * torch.distributed.get_rank()) % 2**63
                    self._rank_generators[device] = torch.Generator(device).manual_seed(seed)
                generator = self._rank_generators[device]
            if params[0] not in self._noise:  # one float16 buffer per bucket, a view per parameter
                flat = torch.empty(b.size, dtype=torch.float16, device=device)
                views = torch._C._nn.unflatten_dense_tensors(flat, params)
                self._noise.update(zip(params, views, strict=True))
            noise = [self._noise[p] for p in params]
            normal_(noise, generator)
            for z, mask in zip(noise, b.masks or (), strict=False):
                z.mul_(True if mask is None else mask)
            if exact or params[0].dtype in _HALF:
                self._stash.update((p, p.detach().clone()) for p in params)
            self._shift(b, noise, 1.0)

    def _leave(self) -> None:
        """Take the sample's noise out of the parameters again (half precision: copy the means back)."""
        for p, mean in self._stash.items():
            p.detach().copy_(mean)
        for b in self._plan():
            if b.var[0] and b.var[0][0] in self._noise and b.var[0][0] not in self._stash:
                self._shift(b, [self._noise[p] for p in b.var[0]], -1.0)
        self._stash = {}

    def _shift(self, b: _Bucket, noise: list[Tensor], sign: float) -> None:
        kernels.run(
            shift_, [b.var[0], b.var[2], noise], Shift, scale=sign / math.sqrt(b.group["ess"]),
            weight_decay=float(b.group["weight_decay"]), **b.opts[0],
        )  # fmt: skip

    def _collect(self, weight: float) -> None:
        """Fold the sample's gradients into the weighted running means, exposed as ``p.grad``.

        The first sample's statistic stays pending (computed inside the update with one sample per step); a
        second sample first folds it into a buffer (:meth:`_materialize`).
        """
        self._count += 1
        self._weight += weight
        rate = weight / self._weight
        for b in self._plan():
            params = b.var[0] + b.fixed[0]
            grads = []  # a missing gradient counts as zero; no view into someone's bucket is kept
            for p in params:
                g = torch.zeros_like(p) if p.grad is None else p.grad
                if g.is_sparse:
                    raise TypeError("IVON does not support sparse gradients")
                grads.append(g if g._base is None else g.clone())
            if self._count == 1:
                self._avg_grad.update(zip(params, grads, strict=True))
            else:
                if self._stat:
                    self._fold(b, grads[: len(b.var[0])], rate)
                avg = [self._avg_grad[p] for p in params]
                torch._foreach_lerp_(avg, grads, rate)
                grads = avg
            for p, g in zip(params, grads, strict=True):
                p.grad = g

    def _materialize(self) -> None:
        """Fold the pending statistic of the first sample (``z·g`` or ``g²``) into its own zeroed buffers."""
        for b in self._plan():
            self._stat.update((p, torch.zeros_like(p)) for p in b.var[0])
            self._fold(b, [self._avg_grad[p] for p in b.var[0]], 1.0)

    def _fold(self, b: _Bucket, grads: list[Tensor], rate: float) -> None:
        """Fold one sample's statistic, from its gradients of the bucket's variational parameters, into ``_stat``."""
        price = self.hess_approx == "price"
        noise = [self._noise[p] for p in b.var[0]] if price else None
        columns = [[self._stat[p] for p in b.var[0]], grads, noise]
        kernels.run(fold_, columns, Fold, hess_approx=self.hess_approx, rate=rate)

    def _discard(self) -> None:
        """Forget the collected samples and free their buffers (after a step, or a skipped one)."""
        self._release_grads()
        self._count, self._weight = 0, 0.0
        self._avg_grad.clear()
        self._stat, self._noise = {}, {}

    # ------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update means, momentum and Hessian from the gradient samples collected since the last step.

        A ``GradScaler`` (``scaler.step(optimizer)``) passes its scale and inf flag: a step with non-finite
        gradients is skipped, the state untouched and the samples dropped; otherwise the statistics are unscaled.
        Without a scaler non-finite gradients raise (state untouched, samples dropped).

        Args:
            closure: Optional; computes the loss and calls ``backward()``. Called ``mc_samples`` times, each
                inside ``sampled_params(train=True)``; the returned losses are averaged.

        Returns:
            The average closure loss, or ``None`` without a closure (or if the closure returns ``None``).

        Raises:
            RuntimeError: If called inside ``sampled_params`` or with no gradient sample collected (the
                message says how to collect one), or if a ``GradScaler`` unscaled the gradients of several MC
                samples before the step (call ``scaler.unscale_`` only with one sample per step).
            ValueError: If the collected gradient of a parameter holds NaN or inf (no GradScaler); the
                message names the parameters.
            TypeError: If ``closure`` is not callable.
        """
        if self._sampling:
            raise RuntimeError("IVON.step() called inside sampled_params; call it after the block")
        loss = None if closure is None else self._run_closure(closure)
        if self._count == 0:
            outside = any(p.grad is not None for g in self.param_groups for p in g["params"])
            raise RuntimeError(
                "IVON.step() needs at least one gradient sample: "
                + ("the gradients in p.grad were computed outside sampled_params (at the means, not at a "
                   "weight sample); " if outside else "")
                + "run forward/backward inside `with optimizer.sampled_params(train=True):` first (or pass "
                "a closure); with the Hugging Face Trainer, pass callbacks=[partialbayes.ivon.IVONCallback()]"
            )  # fmt: skip
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        if found_inf is not None and float(found_inf) != 0.0:
            self._discard()
            return loss
        if found_inf is not None:
            self._unscale(getattr(self, "grad_scale", None))
        if self.sync is not False and _distributed():
            self._all_reduce()
        bad: list[str] = []
        for b in self._plan() if found_inf is None else ():  # a GradScaler has checked already
            params = [p for p in b.var[0] + b.fixed[0] if p.numel()]
            # the max-norm propagates NaN, shows ±inf, cannot overflow and allocates no copy of the gradients
            norms = torch._foreach_norm([self._avg_grad[p] for p in params], ord=math.inf)
            finite = torch.stack(norms).isfinite().tolist() if params else []
            bad += [self._label(p) for p, ok in zip(params, finite, strict=True) if not ok]
        if bad:
            self._discard()
            raise ValueError(
                f"IVON.step: non-finite gradients (NaN or inf) in {', '.join(bad)}; no step was taken, the "
                "state is unchanged and the collected samples were dropped (use torch.amp.GradScaler to "
                "skip such steps instead)"
            )
        for group in self.param_groups:
            group["step"] += 1
        for b in self._plan():
            self._update(b)
        self._discard()
        return loss

    def _run_closure(self, closure: Callable[[], Any]) -> Any:
        check_type("IVON.step: closure", closure, Callable, "callable")
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
        for b in self._plan():
            torch._foreach_mul_([self._avg_grad[p] for p in b.var[0] + b.fixed[0]], inv)
            stats = [self._stat[p] for p in b.var[0]] if self._stat else []
            if stats:  # a pending statistic is computed later from the unscaled gradient
                torch._foreach_mul_(stats, inv if self.hess_approx == "price" else inv * inv)

    def _all_reduce(self) -> None:
        """Average gradient and Hessian statistics over the ranks, weighted by their samples' batch sizes."""
        if self._count == 1 and not self._stat:
            self._materialize()  # a pending statistic is not a mean over the ranks' samples
        for b in self._plan():
            tensors = [self._avg_grad[p] for p in b.var[0] + b.fixed[0]]
            tensors += [self._stat[p] for p in b.var[0]] if self._stat else []
            if tensors:  # each becomes Σ_r w_r·t_r / Σ_r w_r, with one all-reduce
                flat = torch._C._nn.flatten_dense_tensors(tensors).mul_(self._weight)
                flat = torch.cat([flat, flat.new_full((1,), self._weight)])
                torch.distributed.all_reduce(flat)
                values = flat[:-1].div_(flat[-1])
                torch._foreach_copy_(tensors, torch._C._nn.unflatten_dense_tensors(values, tensors))

    def _update(self, b: _Bucket) -> None:
        """The IVON update of one bucket, in place: learned ``h`` on variational entries, fixed elsewhere."""
        g, pending = b.group, self._count == 1 and not self._stat and self.hess_approx == "price"
        delta, clip = float(g["weight_decay"]), float(g["clip_radius"])
        hyper = Hyper(
            lr=float(g["lr"]) * (float(g["hess_init"]) + delta if self.rescale_lr else 1.0),
            beta1=float(g["beta1"]),
            beta2=float(g["beta2"]),
            weight_decay=delta,
            ess=float(g["ess"]),
            bias_correction=1.0 - float(g["beta1"]) ** g["step"] if self.debias else 1.0,
            clip_radius=None if clip == math.inf else clip,
        )
        kw = {"hyper": hyper, "hess_approx": self.hess_approx, **b.opts[1]}
        for (params, momentum, hess), learn in ((b.var, True), (b.fixed, False)):
            grads = [self._avg_grad[p] for p in params]
            noise = [self._noise[p] for p in params] if learn and pending else None
            stat = [self._stat[p] for p in params] if learn and self._stat else None
            columns = [params, momentum, hess, grads, noise, stat, b.masks if learn else None]
            if columns[-1] is None:
                kernels.run(update_, columns, Update, **kw, learn_hess=learn)
            else:  # variational masks on some parameters only: items grouped by their absent fields
                items = zip(*(c or [None] * len(params) for c in columns), strict=True)
                kernels.apply(update_, [Update(*i) for i in items], **kw, learn_hess=learn)

    # ---------------------------------------------------------------------------------------------- helpers
    def _plan(self) -> list[_Bucket]:
        """Each parameter group split by (device, dtype), so that one call sees homogeneous tensors; cached."""
        key = [(id(g), len(g["params"])) for g in self.param_groups]
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, [])
            for group in self.param_groups:
                by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
                for p in group["params"]:
                    by_key.setdefault((p.device, p.dtype), []).append(p)
                self._plan_cache[1].extend(self._bucket(group, ps) for ps in by_key.values())
        return self._plan_cache[1]

    def _bucket(self, group: dict[str, Any], params: list[Tensor]) -> _Bucket:
        masks = {p: self.variational_mask(p) for p in params}
        var, fixed = ([p for p in params if (masks[p] is False) is f] for f in (False, True))
        partial = (masks[p] if isinstance(masks[p], Tensor) else None for p in var)
        # `kernels.run`'s options (see ``compiled``; only ``compiled=True`` warns of a failure to compile)
        large = (
            sum(p.numel() for p in q if p.numel() > kernels.SMALL[True]) for q in (var, params)
        )
        auto = (self.compiled is None and n >= AUTO_COMPILE_MIN for n in large)
        opts = [{"compiled": bool(self.compiled) or a, "warn": bool(self.compiled)} for a in auto]
        var_, fixed_ = (
            [q, *([self.state[p][k] for p in q] for k in ("momentum", "hess"))]
            for q in (var, fixed)
        )
        full, n = all(masks[p] is True for p in var), sum(p.numel() for p in var)
        return _Bucket(group, var_, None if full else [*partial], fixed_, n, opts)

    def _release_grads(self) -> None:
        """Detach the averaged gradients this optimizer exposes as ``p.grad`` (before a sample, after a step)."""
        for p, g in self._avg_grad.items():
            if p.grad is g:
                p.grad = None

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
        """The optimizer state plus ``"generator_state"`` (of ``generator``, if given); pending samples are not saved."""
        if self._count:
            warnings.warn(
                "IVON.state_dict: gradient samples collected since the last step are not saved",
                stacklevel=2,
            )
        out = super().state_dict()
        if self.generator is not None:
            out["generator_state"] = self.generator.get_state()
        return out

    def _check_outside(self, who: str) -> None:
        """A ``RuntimeError`` naming ``who`` while the parameters hold a sample (`sampled_params`)."""
        if self._sampling:
            raise RuntimeError(
                f"{who}: not allowed inside sampled_params (the parameters hold a sample)"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, checked whole before anything changes.

        Raises:
            RuntimeError: If called inside ``sampled_params``.
            TypeError: If ``state_dict`` is no dict of the expected structure.
            ValueError: If it is not an IVON state dict or does not fit this optimizer's parameters (the
                message names the group and the parameter).
        """
        self._check_outside("IVON.load_state_dict")
        check_state_dict(state_dict, self.param_groups, self._label)
        state_dict = dict(state_dict)
        gen_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("step", 0)
        self._plan_cache = None
        if gen_state is not None and self.generator is not None:
            self.generator.set_state(gen_state)
        self._discard()


class _Bucket(NamedTuple):
    """The parameters of one group on one device and of one dtype, with their state tensors."""

    group: dict[str, Any]
    var: list[list[Tensor]]  # the variational parameters, their momenta and their h
    masks: list[Tensor | None] | None  # their variational entries (None: all)
    fixed: list[list[Tensor]]  # the same for the parameters without variational entries
    size: int  # entries of the variational parameters
    opts: list[
        dict[str, bool]
    ]  # `kernels.run`'s compile options: for the variational ones, for all


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} / {value.dtype}"
    return type(value).__name__
