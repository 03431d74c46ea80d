"""Tempered SGMCMC on a subset: one ``torch.optim.Optimizer`` whose ``T = 0`` limit is the matching optimizer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.predictive.internal import (
    check_choice,
    check_finite,
    check_generator,
    check_int,
    check_number,
)
from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset

METHODS = ("sgld", "sghmc", "sgnht", "baoa")


class SGMCMC(torch.optim.Optimizer):
    """Tempered stochastic-gradient MCMC over the entries of a ``Subset``; ``T = 0`` is an optimizer.

    Only the subset's entries move. The loss is the **mean** minibatch loss ``ℓ`` (as for SGD) and the target
    the tempered posterior ``p(θ | D)^{1/T} ∝ exp(−N ℓ(θ) / T − λ‖θ‖² / (2T))`` (``N = num_data``,
    ``λ = prior_precision``: SGD's weight decay ``λ / N``). With ``g = ∇ℓ(θ) + (λ/N) θ`` and ``ξ ~ N(0, I)``:

    * ``"sgld"``: ``θ ← θ − η g + √(2ηT/N) ξ``; ``T = 0``: SGD.
    * ``"sghmc"``: ``b ← μ b + g + √(2(1−μ)T/(ηN)) ξ``, ``θ ← θ − η b``; ``T = 0``:
      ``torch.optim.SGD(lr=η, momentum=μ, weight_decay=λ/N)`` bit for bit.
    * ``"sgnht"``: SGHMC with ``μ`` replaced by a thermostat ``1 − f`` (one scalar, from ``f = 1−μ``),
      ``f ← f + (η/N)(ηN·mean(b²) − 2T/(2−f))``; no ``T = 0`` optimizer.
    * ``"baoa"``: ``b ← b + g``, ``θ ← θ − (η/2) b``, ``b ← μ b + √((1−μ²)T/(ηN)) ξ``, ``θ ← θ − (η/2) b``.

    The concept page relates them to the papers' units. After step ``t > burn_in`` with
    ``(t − burn_in) % thin == 0`` the subset's values are kept; `posterior` makes them a `SampledPosterior`.
    The learning rate may follow any ``torch.optim.lr_scheduler`` (it must stay ``> 0``).

    Args:
        model: The model; its current weights are the chain's start.
        subset: The ``partialbayes.selection.Subset`` of entries to sample.
        lr: Learning rate ``η > 0``.
        num_data: Number ``N`` of training examples (the likelihood's scale).
        method: ``"sgld"``, ``"sghmc"``, ``"sgnht"`` or ``"baoa"``.
        temperature: ``T >= 0``; ``0`` is the deterministic optimizer.
        momentum: ``μ`` in ``[0, 1)`` (SGHMC / SGNHT / BAOA; ignored by SGLD).
        prior_precision: ``λ >= 0`` of the Gaussian prior ``N(0, λ⁻¹ I)`` on the subset's entries.
        burn_in: Steps before the first kept sample.
        thin: Keep every ``thin``-th sample after the burn-in.
        generator: Source of the noise (same seed, same chain); on the parameters' device.

    Raises:
        TypeError: A subset that is not a ``Subset``, a generator that is not a ``torch.Generator``, step
            counts that are not ints.
        ValueError: An unknown method, a setting out of range (named), an empty subset, a subset that
            does not fit the model.
    """

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        *,
        lr: float,
        num_data: int,
        method: str = "sghmc",
        temperature: float = 1.0,
        momentum: float = 0.9,
        prior_precision: float = 0.0,
        burn_in: int = 0,
        thin: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        check_subset(subset, empty_ok=False)  # a block selects at least one entry
        check_choice("method", method, METHODS)
        params = subset.parameters_of(model)
        defaults = {
            "lr": check_number("lr", lr),
            "momentum": check_number("momentum", momentum, "[0, 1)"),
            "temperature": check_number("temperature", temperature, "[0, inf)"),
            "prior_precision": check_number("prior_precision", prior_precision, "[0, inf)"),
        }
        super().__init__(list(params.values()), defaults)
        self.model, self.subset, self.method = model, subset, method
        self.num_data = check_int("num_data", num_data)
        self.burn_in = check_int("burn_in", burn_in, "[0, inf)")
        self.thin = check_int("thin", thin)
        self.generator = check_generator(generator)
        self.names = list(params)
        self._index = [  # flat positions of the entries; None: the whole parameter (updated in place)
            None
            if subset.num_entries(n) == p.numel() and p.is_contiguous()
            else subset.mask(n).to(p.device).reshape(-1).nonzero().squeeze(1)
            for n, p in params.items()
        ]
        chunks: dict[Any, list[int]] = {}  # updated together: on CUDA per dtype/device (foreach),
        for k, p in enumerate(params.values()):  # else per tensor (cache-friendly, like SGD's loop)
            chunks.setdefault((p.dtype, p.device) if p.is_cuda else k, []).append(k)
        self._chunks = list(chunks.values())
        self._noise: dict[int, tuple[Tensor, list[Tensor]]] = {}  # per chunk: a buffer, its views
        self.steps, self.friction = 0, 1.0 - self.defaults["momentum"]
        self.samples: list[dict[str, Tensor]] = []

    def _add_noise(self, chunk: int, xs: list[Tensor], std: float) -> None:
        """``x += std · ξ`` for the tensors of a chunk: one ``normal_`` into the chunk's kept buffer."""
        if std:
            if chunk not in self._noise:
                sizes = [x.numel() for x in xs]
                flat = xs[0].new_empty(sum(sizes))
                self._noise[chunk] = flat, list(flat.split(sizes))
            flat, views = self._noise[chunk]
            flat.normal_(0.0, std, generator=self.generator)
            torch._foreach_add_(xs, views)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        """One sampler step from the gradients in ``.grad``; returns the optional ``closure``'s loss.

        Raises:
            ValueError: A parameter of the subset without a gradient; a kept sample with NaN or inf entries
                (gradients are not checked at every step, which would cost a pass over them).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        lr, mu, temp, params = group["lr"], group["momentum"], group["temperature"], group["params"]
        check_number(f"lr (step {self.steps + 1})", lr)  # a scheduler may have changed it
        n, theta, g, norms = self.num_data, [], [], []
        for name, p, i in zip(self.names, params, self._index, strict=True):
            if p.grad is None:
                raise ValueError(f"parameter {name!r} has no gradient: call loss.backward() first")
            theta.append(p.view(-1) if i is None else p.view(-1)[i])
            g.append(p.grad.reshape(-1) if i is None else p.grad.reshape(-1)[i])
            if self.method != "sgld" and "buf" not in self.state[p]:
                self.state[p]["buf"] = torch.zeros_like(theta[-1])
        for c, chunk in enumerate(self._chunks):
            th, gr = [theta[k] for k in chunk], [g[k] for k in chunk]
            if group["prior_precision"]:
                gr = torch._foreach_add(gr, th, alpha=group["prior_precision"] / n)
            if self.method == "sgld":
                torch._foreach_add_(th, gr, alpha=-lr)
                self._add_noise(c, th, math.sqrt(2 * lr * temp / n))
                continue
            b = [self.state[params[k]]["buf"] for k in chunk]
            if self.method == "baoa":
                torch._foreach_add_(b, gr)
                torch._foreach_add_(th, b, alpha=-lr / 2)
                torch._foreach_mul_(b, mu)
                self._add_noise(c, b, math.sqrt((1 - mu * mu) * temp / (lr * n)))
            else:
                torch._foreach_mul_(b, mu if self.method == "sghmc" else 1 - self.friction)
                torch._foreach_add_(b, gr)
                self._add_noise(c, b, math.sqrt(2 * (1 - mu) * temp / (lr * n)))
            torch._foreach_add_(th, b, alpha=-lr / 2 if self.method == "baoa" else -lr)
            if self.method == "sgnht":  # Σ b² of the chunk, read once all chunks moved
                norms.append(torch.stack(torch._foreach_norm(b)).square().sum())
        if self.method == "sgnht":
            kinetic = sum(float(x) for x in norms) / sum(t.numel() for t in theta)
            target = 2 * temp / (2 - self.friction)  # the Euler momentum's kinetic temperature at T
            self.friction += lr / n * (lr * n * kinetic - target)
        for p, i, t in zip(params, self._index, theta, strict=True):
            if i is not None:
                p.view(-1).index_copy_(0, i, t)
        self.steps += 1
        done = self.steps - self.burn_in
        if done > 0 and done % self.thin == 0:  # only kept samples are checked (a check is a pass)
            sample = self.current()
            for name, v in sample.items():
                check_finite(v, f"NaN or inf entries in {name!r} at step {self.steps}")
            self.samples.append(sample)
        return loss

    def current(self) -> dict[str, Tensor]:
        """The model's current subset values ``{param name: [k]}`` (a copy; after `run_chain`: its start)."""
        params = self.param_groups[0]["params"]
        return {
            n: self.subset.gather(n, p.detach()).clone()
            for n, p in zip(self.names, params, strict=True)
        }

    def posterior(self, **options: Any) -> Any:
        """The kept samples as a `SampledPosterior` of ``self.model`` (``options``: its keywords).

        Raises:
            ValueError: Before the first kept sample.
        """
        from partialbayes.sgmcmc._posterior import SampledPosterior

        if not self.samples:
            raise ValueError(
                f"no sample kept after {self.steps} step(s) (burn_in={self.burn_in}, thin={self.thin}): "
                "run more steps or lower burn_in"
            )
        stacked = {n: torch.stack([s[n] for s in self.samples]) for n in self.names}
        return SampledPosterior(self.model, self.subset, stacked, **options)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state plus the step count and the SGNHT friction (samples are not included)."""
        return {**super().state_dict(), "steps": self.steps, "friction": self.friction}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict` (buffers, step count, friction)."""
        state = dict(state_dict)
        self.steps, self.friction = state.pop("steps", 0), state.pop("friction", self.friction)
        super().load_state_dict(state)
