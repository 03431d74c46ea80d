"""Forward hooks and the backward passes that the curvature routines and the linearised predictive run.

One forward pass per minibatch records, for each hooked linear map, its input ``x`` (already gathered to the
selected columns) and its output tensor (`hooked_forward`). Then backward passes of the logits return
``δ``, the gradient w.r.t. every hooked output, through ``torch.autograd.grad`` (no parameter ``.grad`` is
touched, no weight gradients are computed); `cotangents` states once which passes run. Two users:
`stream`, the curvature's pass over a loader (the cotangents are the fisher's output vectors), and
`output_passes`, the per-position unit cotangents ``e_k`` of the Jacobians and of the Kronecker predictive.
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
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._likelihood import (
    CurvatureOptions,
    check_labels,
    check_logits,
    model_device,
)
from partialbayes.curvature._memory import check_exact_fisher
from partialbayes.curvature._outputs import Outputs, position_plan, read_batch
from partialbayes.predictive.internal import model_logits


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


def token_masks(calls: Mapping[str, list[Tensor]], mask: Tensor | None) -> dict[str, Tensor | None]:
    """Which positions of each module's merged inputs count: ``{module: float mask [B, T] | None}``.

    ``None`` for a module called once with ``[B, d]`` inputs (one row per example). Otherwise one column per
    position of the merged calls: a ``[B, d]`` call is one position (1), a ``[B, T, d]`` call takes the
    attention mask when its shape matches, else ones.

    Raises:
        ValueError: Activations that are neither ``[B, d]`` nor ``[B, T, d]``.
    """
    out: dict[str, Tensor | None] = {}
    for name, xs in calls.items():
        parts = []
        for x in xs:
            if x.ndim not in (2, 3):
                raise ValueError(
                    f"linear-map activations must be [B, d] or [B, T, d], got {tuple(x.shape)}"
                )
            if x.ndim == 2:
                parts.append(x.new_ones(x.shape[0], 1))
            elif mask is not None and tuple(mask.shape) == tuple(x.shape[:2]):
                parts.append(mask.to(x.dtype))
            else:
                parts.append(x.new_ones(x.shape[:2]))
        out[name] = None if len(xs) == 1 and xs[0].ndim == 2 else torch.cat(parts, dim=1)
    return out


def check_untied(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    """Refuse target weights shared with another module of ``model`` (tied parameters).

    The hooks see only the target module's calls, so a tied weight's curvature would silently miss the
    other module's use. Only weights registered on a module itself count (PEFT's ``query`` exposing
    ``query.base_layer.weight`` is no tie); calling one module several times is supported.

    Raises:
        ValueError: Naming the target module and the modules it shares its weight with.
    """
    owner = {id(m.weight): name for name, m in modules.items()}
    tied: dict[str, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
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
    """Eval mode, gradients enabled, target weights differentiable; all restored afterwards, even on error.

    Every module gets its own mode back (``model.train(mode)`` would impose the root's on all). With
    ``switch=False`` the model's mode is left alone.
    """
    modes = [(m, m.training) for m in model.modules()]
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
        for m, mode in modes:
            m.training = mode


def _record(
    name: str,
    cols: Tensor | None,
    inputs: list[Tensor],
    outputs: list[Tensor],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Tensor,
) -> None:
    """Forward hook: keep the call's input (gathered to ``cols``, detached) and its output tensor."""
    x = args[0] if args else kwargs.get("input", kwargs.get("x"))
    if x is None:
        raise TypeError(f"module {name!r} was called without an input tensor")
    x = x.detach()
    inputs.append(x if cols is None else x.index_select(-1, cols))
    outputs.append(output)


def hooked_forward(
    model: nn.Module,
    inputs: Tensor | Mapping[str, Any],
    modules: Mapping[str, nn.Module],
    cols: Mapping[str, Tensor | None],
    *,
    switch: bool = True,
) -> tuple[Tensor, dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """One forward pass of ``inputs`` recording every call of the hooked linear maps (inside `prepared`).

    Args:
        model: The network.
        inputs: Model inputs (a tensor or keyword inputs).
        modules: Module name -> ``nn.Linear`` / HF ``Conv1D`` to hook.
        cols: Module -> selected input indices (``None``: all), on the model's device.
        switch: Evaluate in eval mode.

    Returns:
        ``(logits, inputs per call, outputs per call)``: the logits with their graph (backward passes
        need no other state), each module's gathered and detached inputs, and its output tensors.

    Raises:
        ValueError: A hooked module not called by the forward pass.
    """
    calls_in: dict[str, list[Tensor]] = {n: [] for n in modules}
    calls_out: dict[str, list[Tensor]] = {n: [] for n in modules}
    with prepared(model, modules, switch):
        handles = [
            m.register_forward_hook(
                partial(_record, n, cols[n], calls_in[n], calls_out[n]), with_kwargs=True
            )
            for n, m in modules.items()
        ]
        try:
            logits = model_logits(model, inputs)
        finally:
            for h in handles:
                h.remove()
    missing = [n for n, calls in calls_out.items() if not calls]
    if missing:
        raise ValueError(f"modules {missing} were not called by the model's forward pass")
    return logits, calls_in, calls_out


def cotangents(
    logits: Tensor, vectors: Tensor, keep: Tensor | None, positions: str
) -> Iterator[Tensor]:
    """The cotangents of the backward passes, shaped like ``logits``, built one at a time.

    The one statement of which backward passes run: `stream` (curvature, ``vectors`` from
    ``CurvatureOptions.output_vectors``) and ``output_passes`` (Jacobians and the predictive, ``vectors`` the unit vectors
    ``e_k``) both iterate it.

    Args:
        logits: ``[B, C]`` or ``[B, T, C]``.
        vectors: ``[S, N, C]`` output-space vectors of the ``N`` output rows (row-major kept positions).
        keep: ``[B, T]`` kept positions of token-level logits (``None`` for ``[B, C]``).
        positions: ``"joint"``: ``S`` passes, each carrying every kept position's vector (cross-position
            terms ``J_tᵀ v_t v_uᵀ J_u`` enter the outer products, except where positions do not interact);
            ``"each"``: ``S`` passes per round of `position_plan` (one kept position ``t`` per example,
            every other position zero), which gives the exact per-output gradients ``J_tᵀ v_t``.

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
    logits: Tensor, calls: Mapping[str, list[Tensor]], cots: Iterator[Tensor]
) -> Iterator[dict[str, Tensor]]:
    """``{module: δ}`` for each cotangent in turn, the calls merged; the graph is kept until the last one.

    Each call's output gradient comes from its own output tensor, so it is paired with that call's input
    (no reliance on the order in which backward hooks would fire); it is the total derivative, including
    the paths through later calls of the same module. Unused outputs get zero gradients.
    """
    flat = [t for ts in calls.values() for t in ts]
    nxt = next(cots, None)
    while nxt is not None:
        cot, nxt = nxt, next(cots, None)
        grads = torch.autograd.grad(
            logits, flat, grad_outputs=cot, retain_graph=nxt is not None, allow_unused=True
        )
        it = iter(grads)
        yield {
            n: merge_calls(n, [torch.zeros_like(t) if (g := next(it)) is None else g for t in ts])
            for n, ts in calls.items()
        }


BatchObserver = Callable[[int, Tensor, Tensor | None], None]
"""``on_batch(index, logits, labels)``: sees each batch's detached output rows ``[N, C]`` (``[B, C]`` logits,
or the kept positions of token-level ones) and their validated labels (``None`` when the batch has none)
right after its forward pass, before the backward passes."""


@dataclass
class Run:
    """One streamed pass over a loader: its per-call arguments, and what it saw.

    The public function that starts the pass calls `finish` when it is done, so its warnings name the line
    of the user's call.

    Attributes:
        generator: Random generator of ``fisher="mc"``.
        progress: Show a tqdm progress bar.
        on_batch: Observer of each batch's output rows and labels (`BatchObserver`).
        preflight: Called once with the first batch's logits, kept positions and mask, before its backward
            passes (the memory check of a fit).
        batches: Batches read from the loader.
        skipped: Batches skipped because they hold no labelled output (every label -100).
    """

    generator: torch.Generator | None = None
    progress: bool = False
    on_batch: BatchObserver | None = None
    preflight: Callable[[Tensor, Tensor | None, Tensor | None], None] | None = None
    batches: int = 0
    skipped: int = 0

    def finish(self, model: nn.Module) -> None:
        """Warn once about what the pass did silently (stack level: the caller of the public function).

        A model in training mode (the curvature was computed in eval mode, every module's mode restored),
        and the batches skipped for having no labelled output.
        """
        if model.training:
            warnings.warn(
                "model is in training mode; the curvature was computed in eval mode (dropout would "
                "corrupt it) and every module's mode restored afterwards",
                UserWarning,
                stacklevel=3,
            )
        if self.skipped:
            warnings.warn(
                f"skipped {self.skipped} of {self.batches} batches with no labelled outputs (every "
                "label -100)",
                UserWarning,
                stacklevel=3,
            )


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
        token_masks: Module -> float mask ``[B, T]`` of the real positions of ``inputs`` (`token_masks`);
            not the kept *output* positions: a prompt token labelled -100 still feeds the kept ones.
        passes: Iterator of ``{module: δ}`` (``[B, n_out]`` or ``[B, T, n_out]``, full rows), one per
            cotangent; exhaust it before advancing to the next batch.
    """

    index: int
    n_examples: int
    inputs: dict[str, Tensor]
    keep: Tensor | None
    token_masks: dict[str, Tensor | None]
    passes: Iterator[dict[str, Tensor]]


def stream(
    model: nn.Module,
    loader: Iterable[Any],
    modules: Mapping[str, nn.Module],
    options: CurvatureOptions,
    run: Run,
    positions: str = "joint",
) -> Iterator[BatchPasses]:
    """Stream the loader: one forward pass per batch, then the fisher's backward passes, lazily.

    The loader is read once (a generator works), each batch by `read_batch`. A batch left with no labelled
    output (every label -100) is skipped and counted in ``run.skipped``. Labels, when a batch has them, are
    validated by ``check_labels`` whatever the fisher type; ``run.on_batch`` sees every batch's output rows
    and labels.

    Args:
        model: The network (evaluated in eval mode; every module's mode restored after each forward pass).
        loader: Iterable of batches (read once).
        modules: Module name -> hooked linear map (inputs recorded whole: a view autograd keeps).
        options: The checked curvature options.
        run: The pass's generator, progress bar and observer; counts the batches read and skipped.
        positions: For token-level logits, ``"joint"`` or ``"each"`` (see `cotangents`).

    Raises:
        ValueError: Empty loader; every batch without a labelled output; a hooked module not reached by
            the forward pass; bad logits / labels (naming the batch).
    """
    device = model_device(model)
    it: Iterable[Any] = loader
    if run.progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(loader, desc="curvature")
        except ImportError:  # pragma: no cover - tqdm is optional
            pass
    for index, batch in enumerate(it):
        run.batches += 1
        try:
            inputs, outputs = read_batch(
                batch, device, likelihood=options.likelihood, shift=options.shift_labels
            )
            if outputs.unlabelled:
                run.skipped += 1
                continue
            logits, calls_in, calls_out = hooked_forward(
                model, inputs, modules, dict.fromkeys(modules)
            )
            keep = outputs.keep(logits)
            rows = logits if keep is None else logits[keep]
            labels = outputs.targets(logits, keep)
        except (TypeError, ValueError) as err:
            kind = TypeError if isinstance(err, TypeError) else ValueError
            raise kind(f"batch {index}: {err}") from err
        if rows.shape[0] == 0:  # token-level: no kept position (padding, -100, the causal shift)
            run.skipped += 1
            continue
        check_logits(rows, options.num_classes, index)
        if labels is not None:
            labels = check_labels(labels, rows, options.likelihood, index)
        if run.on_batch is not None:
            run.on_batch(index, rows.detach(), labels)
        if options.fisher_type.per_class:
            joint = keep is None or positions == "joint"
            check_exact_fisher(rows, 1 if joint else int(keep.sum(1).max()), index)
        if run.preflight is not None:
            run.preflight(logits.detach(), keep, outputs.attention_mask)
            run.preflight = None  # the first batch only
        vectors = options.output_vectors(rows, labels, run.generator, index)
        yield BatchPasses(
            index=index,
            n_examples=int(logits.shape[0]),
            inputs={n: merge_calls(n, xs) for n, xs in calls_in.items()},
            keep=keep,
            token_masks=token_masks(calls_in, outputs.attention_mask),
            passes=backward_passes(logits, calls_out, cotangents(logits, vectors, keep, positions)),
        )
        del logits, rows
    if run.batches == 0:
        raise ValueError("loader is empty: no batch to compute the curvature from")
    if run.skipped == run.batches:
        raise ValueError(
            f"every batch of the loader ({run.batches}) has no labelled output (every label -100): "
            "nothing to compute the curvature from"
        )


@dataclass
class PositionGrads:
    """The ``K`` backward passes of one round of `position_plan` (one kept position per example).

    Attributes:
        examples: ``[n]`` indices of the examples with an output in this round (all ``B`` for ``[B, C]``
            logits).
        keys: ``[n]`` row-major keys ``b·T + t`` of those outputs (``b`` for ``[B, C]`` logits); sorting by
            them puts rows in `partialbayes.predictive.flatten_outputs` order.
        grads: Module -> one ``δ`` per logit ``k`` of ``Outputs.ids`` ``[B, (T',) r]`` (gathered to the
            selected rows, detached); the gradient of logit ``(b, t, k)`` for the kept examples, zero for
            the others.
    """

    examples: Tensor
    keys: Tensor
    grads: dict[str, list[Tensor]]


@dataclass
class OutputPasses:
    """One forward pass with hooks and a lazy iterator over the per-position backward passes.

    Attributes:
        logits: Detached logits as the model returns them, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions of token-level logits, ``None`` for ``[B, C]``.
        inputs: Module -> recorded input ``x`` (gathered to the selected columns, calls merged).
        positions: One `PositionGrads` per round of `position_plan`.
    """

    logits: Tensor
    keep: Tensor | None
    inputs: dict[str, Tensor]
    positions: Iterator[PositionGrads]


def _position_grads(
    logits: Tensor,
    keep: Tensor | None,
    calls: Mapping[str, list[Tensor]],
    rows: Mapping[str, Tensor | None],
    ids: Tensor,
) -> Iterator[PositionGrads]:
    """The ``K`` backward passes with cotangents ``e_k``, ``k ∈ ids``, of every kept position (``"each"``)."""
    b, n_cls = logits.shape[0], len(ids)
    plan = position_plan(keep, b, logits.device)
    if not plan:  # no kept output: zero gradients of the right shapes, no backward pass
        empty = torch.zeros(0, dtype=torch.long, device=logits.device)
        zeros = {}
        for m, outs in calls.items():
            z, r = merge_calls(m, [torch.zeros_like(o) for o in outs]), rows.get(m)
            zeros[m] = [z if r is None else z.index_select(-1, r)] * n_cls
        yield PositionGrads(examples=empty, keys=empty, grads=zeros)
        return
    n_rows = b if keep is None else int(keep.sum())
    units = logits.new_zeros(n_cls, 1, logits.shape[-1]).scatter_(2, ids[:, None, None], 1.0)
    vectors = units.expand(n_cls, n_rows, logits.shape[-1])  # e_k: no [C, C] identity
    passes = backward_passes(logits, calls, cotangents(logits, vectors, keep, "each"))
    for t, examples in plan:
        grads: dict[str, list[Tensor]] = {m: [] for m in calls}
        for _ in range(n_cls):
            for m, g in next(passes).items():
                r = rows.get(m)
                grads[m].append((g if r is None else g.index_select(-1, r)).detach())
        keys = examples if t is None else examples * logits.shape[1] + t
        yield PositionGrads(examples=examples, keys=keys, grads=grads)


def output_passes(
    model: nn.Module,
    inputs: Tensor | Mapping[str, Any],
    outputs: Outputs,
    modules: Mapping[str, nn.Module],
    cols: Mapping[str, Tensor | None],
    rows: Mapping[str, Tensor | None],
) -> OutputPasses:
    """Forward pass with hooks on ``modules``, then (lazily) ``K`` backward passes per kept output position.

    Gradients are taken w.r.t. the hooked outputs only (no parameter ``.grad``); the model's mode is left
    as it is.

    ``outputs`` tells which positions and logits count (``K = C``, or ``len(outputs.target_ids)``);
    ``modules`` / ``cols`` as for `hooked_forward`; ``rows`` gather the output gradients (``None``: all).

    Raises:
        ValueError: A hooked module not called by the forward pass; logits of an unsupported shape or
            token-level logits without an attention mask or labels.
    """
    logits, calls_in, calls_out = hooked_forward(model, inputs, modules, cols, switch=False)
    keep = outputs.keep(logits)
    return OutputPasses(
        logits=logits.detach(),
        keep=keep,
        inputs={n: merge_calls(n, xs) for n, xs in calls_in.items()},
        positions=_position_grads(
            logits, keep, calls_out, rows, outputs.ids(logits.shape[-1], logits.device)
        ),
    )


def in_row_order(keys: list[Tensor], parts: list[Tensor]) -> Tensor:
    """Concatenate per-position results ``[n_i, ...]`` and sort their rows by key (row-major ``(b, t)``)."""
    if len(parts) == 1:
        return parts[0]
    order = torch.argsort(torch.cat(keys))
    return torch.cat(parts).index_select(0, order.to(parts[0].device))
