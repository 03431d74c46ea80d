"""Forward hooks and the streamed backward passes every curvature routine is built on.

One forward pass per minibatch records, for each hooked linear map, its input ``x`` (already gathered to the
selected columns) and its output tensor. Then ``S`` backward passes of the logits (one per cotangent from
:func:`partialbayes.curvature._likelihood.output_vectors`) return ``δ``, the gradient w.r.t. every hooked
output, through ``torch.autograd.grad`` (no parameter ``.grad`` is touched, no weight gradients are computed).
Nothing about an example is kept beyond its batch.

A module called several times per forward pass (tied weights, a layer applied twice, a module reused in a
loop) records every call; each call's ``δ`` is the gradient w.r.t. that call's own output tensor, so inputs
and gradients are paired by call. The calls are merged as extra token positions of each example
(`merge_calls`): its per-example gradient is ``Σ_calls Σ_t δ_t x_tᵀ``, and KFAC's ``reduce`` / ``expand``
treat the calls exactly like tokens (Eschenhagen et al., 2023, weight sharing over ``R`` positions).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._caller import user_stacklevel
from partialbayes.curvature._likelihood import (
    check_labels,
    check_logits,
    model_device,
    output_vectors,
)
from partialbayes.curvature._memory import check_exact_fisher
from partialbayes.curvature._outputs import output_rows, position_plan, read_batch
from partialbayes.predictive import model_logits


def merge_calls(name: str, tensors: list[Tensor]) -> Tensor:
    """Merge the per-call tensors of one module into one, the calls as extra token positions.

    One call is returned as it is. Several calls (a shared / tied / looped module) are concatenated along
    the token axis: ``[B, d]`` calls count as one position each, ``[B, T_k, d]`` calls as ``T_k``, giving
    ``[B, Σ_k T_k, d]`` in call order.

    Raises:
        ValueError: Naming the module, when the calls do not share the batch dimension ``B`` or are not
            ``[B, d]`` / ``[B, T, d]``.
    """
    if len(tensors) == 1:
        return tensors[0]
    lead = tensors[0].shape[0]
    if any(t.ndim not in (2, 3) or t.shape[0] != lead for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"module {name!r} is called {len(tensors)} times per forward pass with activations of shapes "
            f"{shapes}: repeated calls are merged as extra token positions of each example and must be "
            "[B, d] or [B, T, d] with the same batch size B"
        )
    return torch.cat([t[:, None] if t.ndim == 2 else t for t in tensors], dim=1)


def call_grads(
    logits: Tensor,
    calls: Mapping[str, list[Tensor]],
    cotangent: Tensor,
    retain_graph: bool,
) -> dict[str, Tensor]:
    """One backward pass of ``logits`` with ``cotangent``: ``{module: δ}``, the calls merged.

    Each call's output gradient comes from its own output tensor, so it is paired with that call's input
    (no reliance on the order in which backward hooks would fire); it is the total derivative, including
    the paths through later calls of the same module. Unused outputs get zero gradients.
    """
    names = list(calls)
    flat = [t for n in names for t in calls[n]]
    grads = torch.autograd.grad(
        logits, flat, grad_outputs=cotangent, retain_graph=retain_graph, allow_unused=True
    )
    out: dict[str, Tensor] = {}
    i = 0
    for n in names:
        k = len(calls[n])
        gs = [
            torch.zeros_like(t) if g is None else g
            for t, g in zip(calls[n], grads[i : i + k], strict=True)
        ]
        out[n] = merge_calls(n, gs)
        i += k
    return out


class Recorder:
    """Context manager hooking linear maps: records gathered inputs and raw outputs of one forward pass.

    A module called several times in one forward pass (weight tying, a layer reused in a loop) records
    every call; `inputs` and `token_masks` merge the calls as extra token positions
    (see `merge_calls`).

    Args:
        modules: Module name -> ``nn.Linear`` / HF ``Conv1D``.
        cols: Module name -> selected input indices (``None`` = all); ``x`` is gathered on the fly.
    """

    def __init__(self, modules: Mapping[str, nn.Module], cols: Mapping[str, Tensor | None]) -> None:
        self.modules = dict(modules)
        self.cols = {
            k: (None if v is None else v.to(model_device(m)))
            for k, v in cols.items()
            for m in [modules[k]]
        }
        self.calls_in: dict[str, list[Tensor]] = {}
        self.calls_out: dict[str, list[Tensor]] = {}
        self._merged: dict[str, Tensor] | None = None
        self._handles: list[Any] = []

    def _hook(self, name: str):
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor
        ) -> None:
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            if x is None:
                raise TypeError(f"module {name!r} was called without an input tensor")
            x = x.detach()
            c = self.cols[name]
            self.calls_in.setdefault(name, []).append(x if c is None else x.index_select(-1, c))
            self.calls_out.setdefault(name, []).append(output)
            self._merged = None

        return hook

    @property
    def inputs(self) -> dict[str, Tensor]:
        """``{module: x}``, gathered inputs with the calls merged (``[B, c]`` or ``[B, T, c]``)."""
        if self._merged is None:
            self._merged = {n: merge_calls(n, xs) for n, xs in self.calls_in.items()}
        return self._merged

    def token_masks(self, mask: Tensor | None) -> dict[str, Tensor | None]:
        """``{module: float mask [B, T] | None}`` matching `inputs` (see `token_mask`), calls merged."""
        out: dict[str, Tensor | None] = {}
        for n, xs in self.calls_in.items():
            if len(xs) == 1:
                out[n] = token_mask(xs[0], mask)
                continue
            parts = [token_mask(x, mask) for x in xs]
            out[n] = torch.cat(
                [
                    torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device) if m is None else m
                    for x, m in zip(xs, parts, strict=True)
                ],
                dim=1,
            )
        return out

    def snapshot(self) -> dict[str, list[Tensor]]:
        """The recorded call outputs (a copy that survives `clear`), for `call_grads`."""
        return {n: list(v) for n, v in self.calls_out.items()}

    def clear(self) -> None:
        """Forget the last forward pass."""
        self.calls_in = {}
        self.calls_out = {}
        self._merged = None

    def __enter__(self) -> Recorder:
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()


def check_untied(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    """Refuse target weights shared with another module of ``model`` (tied parameters).

    The hooks see only the target module's calls, so the curvature of a weight that another module also
    uses (e.g. a classifier tied to an embedding, or two ``nn.Linear`` sharing one ``weight``) would
    silently miss that module's contribution. Calling the same module several times is supported instead.
    Only weights registered on a module itself count, so a wrapper exposing its child's weight (PEFT's
    ``query`` wrapping ``query.base_layer``) is not mistaken for a tie.

    Raises:
        ValueError: Naming the target module and the modules it shares its weight with.
    """
    owner = {id(m.weight): name for name, m in modules.items()}
    tied: dict[str, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        # Only a weight registered on the module itself counts: wrappers that expose a child's weight as a
        # property (PEFT's LoRA layer ``q`` returning ``q.base_layer.weight``) do not use it a second time.
        w = dict(mod.named_parameters(recurse=False)).get("weight")
        if isinstance(w, Tensor) and id(w) in owner:
            target = owner[id(w)]
            if mod is not modules[target]:
                tied.setdefault(target, []).append(name)
    if tied:
        target, others = next(iter(tied.items()))
        raise ValueError(
            f"the weight of module {target!r} is tied to module(s) {others}: hooks on {target!r} would miss "
            "their use of the weight. Curvature of tied weights is supported only when one module is "
            "called several times (e.g. apply the same nn.Linear twice)"
        )


@contextmanager
def prepared(
    model: nn.Module, modules: Mapping[str, nn.Module], switch: bool = True
) -> Iterator[None]:
    """Eval mode (warning if the model was training), gradients enabled, target weights differentiable.

    Restores every module's own mode and the weights' ``requires_grad`` afterwards, even on error. With
    ``switch=False`` the model's mode is left alone.

    Raises:
        ValueError: If a target weight is tied to another module (see `check_untied`).
    """
    check_untied(model, modules)
    modes = [(m, m.training) for m in model.modules()]
    if model.training and switch:
        warnings.warn(
            "model is in training mode; the curvature is computed in eval mode (dropout would corrupt it) "
            "and the mode is restored afterwards",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    weights: list[Tensor] = [m.weight for m in modules.values()]  # type: ignore[misc]
    flags = [(w, bool(w.requires_grad)) for w in weights]
    if switch:
        model.eval()
    try:
        for w, _ in flags:
            w.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for w, flag in flags:
            w.requires_grad_(flag)
        for m, mode in modes:  # each module its own (model.train() would impose the root's on all)
            m.training = mode


BatchObserver = Callable[[int, Tensor, Tensor | None], None]
"""``on_batch(index, logits, labels)``: sees each batch's detached output rows ``[N, C]`` (``[B, C]`` logits,
or the kept positions of token-level ones) and their validated labels (``None`` when the batch has none)
right after its forward pass, before the backward passes."""


@dataclass
class BatchPasses:
    """One minibatch: recorded inputs and a lazy iterator over the backward passes.

    Attributes:
        index: Batch index in the loader.
        n_examples: Examples (sequences) in the batch, ``B``.
        inputs: Module -> gathered input ``x`` (``[B, c]`` or ``[B, T, c]``; the calls of a module called
            several times merged as extra positions).
        keep: ``[B, T]`` bool mask of the kept output positions of token-level logits, ``None`` for
            ``[B, C]`` logits.
        token_masks: Module -> float mask ``[B, T]`` of the real positions of ``inputs`` (``None`` for
            ``[B, c]`` inputs): the attention mask, all ones without one. For token-level logits this is
            not the kept *output* positions: a position whose output is not kept (a prompt token labelled
            -100) still feeds the kept ones through attention.
        passes: Iterator of ``{module: δ}`` (``[B, n_out]`` or ``[B, T, n_out]``, full rows), one per cotangent;
            exhaust it before advancing to the next batch.
    """

    index: int
    n_examples: int
    inputs: dict[str, Tensor]
    keep: Tensor | None
    token_masks: dict[str, Tensor | None]
    passes: Iterator[dict[str, Tensor]]


def cotangents(
    logits: Tensor, vectors: Tensor, keep: Tensor | None, positions: str
) -> Iterator[Tensor]:
    """The cotangents of the backward passes, shaped like ``logits``, built one at a time.

    The one statement of which backward passes run: `stream` (curvature, ``vectors`` from
    ``output_vectors``) and `output_passes` (Jacobians and the predictive, ``vectors`` the unit vectors
    ``e_k``) both iterate it.

    Args:
        logits: ``[B, C]`` or ``[B, T, C]``.
        vectors: ``[S, N, C]`` output-space vectors of the ``N`` output rows (row-major kept positions).
        keep: ``[B, T]`` kept positions of token-level logits (``None`` for ``[B, C]``).
        positions: ``"joint"``: ``S`` passes, each carrying every kept position's vector (cross-position
            terms ``J_tᵀ v_t v_uᵀ J_u`` enter the outer products, except where positions do not interact);
            ``"each"``: ``S`` passes per kept position ``t`` in `position_plan` order (every other position
            zero), which gives the exact per-output gradients ``J_tᵀ v_t``.

    Yields:
        Cotangents ``[B, C]`` / ``[B, T, C]``.
    """
    if keep is None:
        for v in vectors:
            yield v.contiguous()
        return
    if positions == "joint":
        for v in vectors:
            one = vectors.new_zeros(logits.shape)
            one[keep] = v
            yield one
        return
    row = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
    row[keep] = torch.arange(int(keep.sum()), device=keep.device)
    for t, examples in position_plan(keep, keep.shape[0], keep.device):
        rows_t = row[examples, t]
        for v in vectors:
            one = vectors.new_zeros(logits.shape)
            one[examples, t] = v[rows_t]
            yield one


def backward_passes(
    logits: Tensor, calls: dict[str, list[Tensor]], cots: Iterator[Tensor]
) -> Iterator[dict[str, Tensor]]:
    """``{module: δ}`` for each cotangent in turn (`call_grads`), keeping the graph until the last one."""
    nxt = next(cots, None)
    while nxt is not None:
        cot, nxt = nxt, next(cots, None)
        yield call_grads(logits, calls, cot, retain_graph=nxt is not None)


def stream(
    model: nn.Module,
    loader: Iterable[Any],
    modules: Mapping[str, nn.Module],
    cols: Mapping[str, Tensor | None],
    *,
    likelihood: str,
    fisher: str,
    mc_samples: int,
    sigma_noise: float,
    generator: torch.Generator | None,
    num_classes: int | None,
    shift_labels: bool,
    positions: str = "joint",
    progress: bool = False,
    on_batch: BatchObserver | None = None,
) -> Iterator[BatchPasses]:
    """Stream the loader: one forward pass per batch, then the fisher's backward passes, lazily.

    Must run inside :func:`prepared`. The loader is iterated exactly once (a generator works). Batches are
    read by ``partialbayes.predictive.split_batch`` (tensors, pairs, any mapping). Token-level logits
    ``[B, T, C]`` count one output per kept position (see `partialbayes.curvature._outputs`). Labels, when a
    batch has them, are validated by :func:`~partialbayes.curvature._likelihood.check_labels` whatever the
    fisher type; ``on_batch`` (if given) is called with every batch's index, detached output rows and
    validated labels, e.g. to accumulate the training loss from the same forward pass.

    Args:
        model: The network (inside :func:`prepared`).
        loader: Iterable of batches (read once).
        modules: Module name -> hooked linear map.
        cols: Module -> selected input indices (``None``: all).
        likelihood: ``"classification"`` or ``"regression"``.
        fisher: ``"exact"``, ``"mc"`` or ``"empirical"``.
        mc_samples: Sampled labels per output (``fisher="mc"``).
        sigma_noise: Regression noise.
        generator: Random generator of ``fisher="mc"``.
        num_classes: When given, the number of logits the model must output.
        shift_labels: Causal-LM convention for token-level outputs (resolved, a bool).
        positions: For token-level logits, ``"joint"`` or ``"each"`` (see `cotangents`).
        progress: Show a tqdm progress bar.
        on_batch: Observer of each batch's output rows and labels.

    Raises:
        ValueError: Empty loader, a hooked module not reached by the forward pass, bad logits / labels.
    """
    device = model_device(model)
    it: Iterable[Any] = loader
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(loader, desc="curvature")
        except ImportError:  # pragma: no cover - tqdm is optional
            pass
    seen = 0
    with ExitStack() as stack:
        rec = stack.enter_context(Recorder(modules, cols))
        for index, batch in enumerate(it):
            seen += 1
            try:
                inputs, outputs = read_batch(
                    batch, device, likelihood=likelihood, shift=shift_labels
                )
            except (TypeError, ValueError) as err:
                raise type(err)(f"batch {index}: {err}") from err
            rec.clear()
            logits = model_logits(model, inputs)
            try:
                keep = outputs.keep(logits)
                rows = output_rows(logits, keep)
                labels = outputs.targets(logits, keep)
            except ValueError as err:
                raise ValueError(f"batch {index}: {err}") from err
            check_logits(rows, num_classes, index)
            if labels is not None:
                labels = check_labels(labels, rows, likelihood, index)
            if on_batch is not None:
                on_batch(index, rows.detach(), labels)
            missing = [n for n in modules if n not in rec.calls_out]
            if missing:
                raise ValueError(
                    f"batch {index}: modules {missing} were not called by the model's forward pass"
                )
            if fisher == "exact":
                joint = keep is None or positions == "joint"
                check_exact_fisher(rows, 1 if joint else int(keep.any(0).sum()), index)
            vectors = output_vectors(
                rows,
                labels,
                likelihood=likelihood,
                fisher=fisher,
                mc_samples=mc_samples,
                sigma_noise=sigma_noise,
                generator=generator,
                batch_index=index,
            )
            recorded = dict(rec.inputs)  # merges repeated calls first (clear error if they differ)
            masks = rec.token_masks(outputs.attention_mask)
            yield BatchPasses(
                index=index,
                n_examples=int(logits.shape[0]),
                inputs=recorded,
                keep=keep,
                token_masks=masks,
                passes=backward_passes(
                    logits, rec.snapshot(), cotangents(logits, vectors, keep, positions)
                ),
            )
            del logits, rows
    if seen == 0:
        raise ValueError("loader is empty: no batch to compute the curvature from")


def token_mask(x: Tensor, mask: Tensor | None) -> Tensor | None:
    """Which tokens of a hooked activation count: ``None`` when ``x`` is ``[B, d]`` (one row per example).

    Returns:
        A float mask ``[B, T]`` for 3-D ``x`` (the attention mask when its shape matches, else all ones).
    """
    if x.ndim == 2:
        return None
    if x.ndim != 3:
        raise ValueError(
            f"linear-map activations must be [B, d] or [B, T, d], got {tuple(x.shape)}"
        )
    if mask is not None and tuple(mask.shape) == tuple(x.shape[:2]):
        return mask.to(x.dtype)
    return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
