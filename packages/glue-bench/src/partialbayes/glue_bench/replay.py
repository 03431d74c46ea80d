"""Share the linearised predictive's passes between the cells of a ramp: capture a batch once, replay it.

The linearised predictive of a KFAC-type Laplace posterior (``KronLaplace.logit_mean_cov``,
``grid_val_nll``) runs one forward pass with hooks on the linear maps of its subset, recording their inputs
``x``, and one backward pass per class with the one-hot cotangent ``e_k`` of the logits, recording the
gradients ``δ_k`` with respect to the maps' outputs. Every cell's quantities are gathers of the same ``x``
and ``δ`` (its rows and columns of its maps). So a ramp runs the network once per batch for all its cells
(:func:`capture_batch`: the logits, every map's inputs and the ``δ_k``) and then lets each cell's posterior
run its own predictive on a replay of that pass (:func:`replaying`): the model's forward returns the
captured logits, each linear map returns a fresh leaf in place of its output and receives its captured
input (so the library's hooks record the same ``x``), and the backward pass of ``e_k`` hands each leaf the
captured ``δ_k`` itself. The library then computes exactly what it computes on the real network, from the
same numbers, without the network's cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class Capture:
    """One batch of the network, as the linearised predictive sees it.

    Attributes:
        inputs: The model's keyword inputs (to check that a replayed batch is this one).
        logits: ``[B, C]`` logits (detached).
        calls: ``{module: [x of each call]}`` the inputs of every captured linear map, per call.
        grads: ``{module: [[δ_k of each class k] of each call]}`` gradients of logit ``k`` with respect to
            each call's output (detached).
    """

    inputs: dict[str, Tensor]
    logits: Tensor
    calls: dict[str, list[Tensor]]
    grads: dict[str, list[list[Tensor]]]


def _logits(out: Any) -> Tensor:
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, Tensor) or logits.ndim != 2:
        raise ValueError(
            f"model output must be logits [B, C], got {getattr(logits, 'shape', type(out))}"
        )
    return logits


def capture_batch(
    model: nn.Module, batch: Mapping[str, Tensor], modules: Mapping[str, nn.Module]
) -> Capture:
    """Run ``model`` once on ``batch`` (eval mode): logits, the inputs of ``modules``, one ``δ_k`` per class.

    The backward passes use the cotangents ``e_k`` broadcast over the batch, like the curvature library's
    predictive, and differentiate the logits with respect to the outputs of ``modules`` only (the weights
    of ``modules`` require gradients meanwhile, so that every output is in the graph).

    Args:
        model: The classifier, in eval mode.
        batch: A dict batch (``labels`` ignored).
        modules: ``{name: linear map}`` to capture.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    calls_in: dict[str, list[Tensor]] = {m: [] for m in modules}
    calls_out: dict[str, list[Tensor]] = {m: [] for m in modules}

    def hook(name: str):
        def record(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor
        ) -> None:
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            if not isinstance(x, Tensor):
                raise TypeError(f"module {name!r} was called without an input tensor")
            calls_in[name].append(x.detach())
            calls_out[name].append(out)

        return record

    weights = [m.weight for m in modules.values()]
    flags = [bool(w.requires_grad) for w in weights]
    handles = [mod.register_forward_hook(hook(n), with_kwargs=True) for n, mod in modules.items()]
    try:
        for w in weights:
            w.requires_grad_(True)
        with torch.enable_grad():
            logits = _logits(model(**inputs))
            missing = [m for m, outs in calls_out.items() if not outs]
            if missing:
                raise ValueError(f"modules {missing} were not called by the model's forward pass")
            b, n_cls = logits.shape
            flat = [t for m in modules for t in calls_out[m]]
            eye = torch.eye(n_cls, dtype=logits.dtype, device=logits.device)
            per_class: list[tuple[Tensor | None, ...]] = []
            for k in range(n_cls):
                per_class.append(
                    torch.autograd.grad(
                        logits,
                        flat,
                        grad_outputs=eye[k].expand(b, n_cls),
                        retain_graph=k < n_cls - 1,
                        allow_unused=True,
                    )
                )
    finally:
        for h in handles:
            h.remove()
        for w, flag in zip(weights, flags, strict=True):
            w.requires_grad_(flag)
    grads: dict[str, list[list[Tensor]]] = {}
    i = 0
    for m in modules:
        grads[m] = []
        for out in calls_out[m]:
            grads[m].append(
                [
                    torch.zeros_like(out) if g[i] is None else g[i].detach()  # type: ignore[union-attr]
                    for g in per_class
                ]
            )
            i += 1
    return Capture(inputs, logits.detach(), calls_in, grads)


class _Replay(torch.autograd.Function):
    """``logits`` as a function of the leaves standing for the maps' outputs, with the captured Jacobian.

    The backward pass of a cotangent ``v`` hands leaf ``j`` the vector-Jacobian product ``Σ_k v_k δ_jk``;
    for a one-hot ``v = e_k`` (what the linearised predictive uses) that is the captured ``δ_jk`` itself.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, grads: list[list[Tensor]], *leaves: Tensor) -> Tensor:
        ctx.grads = grads
        return logits.clone()

    @staticmethod
    def backward(ctx: Any, v: Tensor) -> Any:
        grads: list[list[Tensor]] = ctx.grads
        n_cls = v.shape[1]
        k = int(v[0].argmax())
        if torch.equal(v, torch.eye(n_cls, dtype=v.dtype, device=v.device)[k].expand_as(v)):
            return (None, None, *(g[k] for g in grads))
        out = []
        for g in grads:  # any other cotangent: the vector-Jacobian product
            lead = (v.shape[0],) + (1,) * (g[0].ndim - 1)
            out.append(sum(v[:, c].reshape(lead) * g[c] for c in range(n_cls)))
        return (None, None, *out)


@contextmanager
def replaying(
    model: nn.Module, modules: Mapping[str, nn.Module], capture: Capture
) -> Iterator[None]:
    """Make ``model`` replay ``capture``: its forward returns the captured logits, nothing else runs.

    Inside the block, ``model(**inputs)`` (with the captured batch's inputs; another batch raises) calls
    every captured linear map with its captured input — so forward hooks registered on them (the
    curvature library's) see that input — and each map returns a new leaf tensor instead of computing;
    the logits depend on the leaves through :class:`_Replay`, whose backward pass returns the captured
    gradients. The original forwards are restored on exit, even on error.

    Args:
        model: The model of the capture.
        modules: The same ``{name: linear map}`` as given to :func:`capture_batch`.
        capture: The captured batch.
    """
    pending: dict[str, list[Tensor]] = {}

    def module_forward(name: str):
        def forward(*args: Any, **kwargs: Any) -> Tensor:
            return pending[name].pop(0)

        return forward

    def model_forward(*args: Any, **kwargs: Any) -> Tensor:
        if (
            args
            or set(kwargs) != set(capture.inputs)
            or any(not torch.equal(kwargs[k], v) for k, v in capture.inputs.items())
        ):
            raise ValueError("replaying a captured batch: the model was called on another batch")
        leaves: list[Tensor] = []
        grads: list[list[Tensor]] = []
        for m, xs in capture.calls.items():
            for x, g in zip(xs, capture.grads[m], strict=True):
                leaf = torch.zeros_like(g[0]).requires_grad_()
                pending.setdefault(m, []).append(leaf)
                modules[m](x)
                leaves.append(leaf)
                grads.append(g)
        return _Replay.apply(capture.logits, grads, *leaves)

    saved = {m: mod.__dict__.get("forward") for m, mod in modules.items()}
    saved_model = model.__dict__.get("forward")
    try:
        for m, mod in modules.items():
            mod.forward = module_forward(m)
        model.forward = model_forward
        yield
    finally:
        for m, mod in modules.items():
            _restore(mod, saved[m])
        _restore(model, saved_model)


def _restore(module: nn.Module, forward: Any) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward
