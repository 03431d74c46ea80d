"""Forward hooks, the backward passes of the curvature and the predictive, and the reduction over ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from partialbayes.curvature._likelihood import (
    FISHERS,
    CurvatureOptions,
    Outputs,
    model_device,
    position_plan,
    read_batch,
    resolve_shift_labels,
)
from partialbayes.curvature._memory import check_exact_fisher
from partialbayes.predictive.internal import check_generator, model_logits, prefixed


def merge_calls(name: str, tensors: list[Tensor]) -> Tensor:
    """One module's per-call ``[B, d]`` / ``[B, T_k, d]`` tensors as one ``[B, Σ_k T_k, d]`` (one call as is)."""
    lead = tensors[0].shape[0]
    if any(t.ndim not in (2, 3) or t.shape[0] != lead for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"module {name!r} is called {len(tensors)} times per forward pass with activations of shapes "
            f"{shapes}: linear-map activations must be [B, d] or [B, T, d]; repeated calls are merged "
            "as extra token positions of each example and need the same batch size B"
        )
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat([t[:, None] if t.ndim == 2 else t for t in tensors], dim=1)


def check_untied(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    """Refuse target weights tied to another module (the hooks would miss its use); repeated calls are fine."""
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
) -> tuple[Tensor, dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """One forward pass recording every call of ``modules``: ``(logits with graph, inputs, outputs per call)``.

    Eval mode, gradients on, the target weights differentiable; hooks, modes and flags restored.
    """
    calls_in: dict[str, list[Tensor]] = {n: [] for n in modules}
    calls_out: dict[str, list[Tensor]] = {n: [] for n in modules}
    modes = [(m, m.training) for m in model.modules()]
    weights: list[Tensor] = [m.weight for m in modules.values()]  # type: ignore[misc]
    flags = [(w, bool(w.requires_grad)) for w in weights]
    handles = []
    model.eval()
    try:
        for (n, m), w in zip(modules.items(), weights, strict=True):
            w.requires_grad_(True)
            hook = partial(_record, n, cols[n], calls_in[n], calls_out[n])
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
        with torch.enable_grad():
            logits = model_logits(model, inputs)
    finally:
        for h in handles:
            h.remove()
        for w, flag in flags:
            w.requires_grad_(flag)
        for m, mode in modes:
            m.training = mode
    missing = [n for n, calls in calls_out.items() if not calls]
    if missing:
        raise ValueError(f"modules {missing} were not called by the model's forward pass")
    return logits, calls_in, calls_out


def backward_passes(
    logits: Tensor,
    calls: Mapping[str, list[Tensor]],
    vectors: Tensor,
    keep: Tensor | None,
    positions: str,
) -> Iterator[dict[str, Tensor]]:
    """``{module: δ}`` per cotangent of ``vectors [S, N, C]`` (calls merged, each paired with its own output).

    The cotangents ``[B, (T,) C]`` hold all kept positions per pass (``joint``), or one position per example
    per round of `position_plan` (``each``: ``S`` passes a round); the graph is kept to the last pass.
    """
    flat = [t for ts in calls.values() for t in ts]
    rounds: list[tuple[Any, Tensor | None]] = [(keep, None)]  # (where in the logits, rows of v)
    if keep is not None and positions != "joint":
        row = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
        row[keep] = torch.arange(int(keep.sum()), device=keep.device)
        rounds = [((b, t), row[b, t]) for t, b in position_plan(keep, keep.shape[0], keep.device)]
    left = len(rounds) * len(vectors)
    for where, rows in rounds:
        for v in vectors:
            left -= 1
            cot = v.contiguous() if where is None else vectors.new_zeros(logits.shape)
            if where is not None:
                cot[where] = v if rows is None else v[rows]
            grads = torch.autograd.grad(
                logits, flat, grad_outputs=cot, retain_graph=left > 0, allow_unused=True
            )
            it = iter(grads)
            yield {
                n: merge_calls(
                    n, [torch.zeros_like(t) if (g := next(it)) is None else g for t in ts]
                )
                for n, ts in calls.items()
            }


BatchObserver = Callable[[int, Tensor, Tensor | None], None]
"""``on_batch(index, logits, labels)``: sees each batch's detached output rows ``[N, C]`` (``[B, C]`` logits,
or the kept positions of token-level ones) and their validated labels (``None`` when the batch has none)
right after its forward pass, before the backward passes."""


@dataclass
class Run:
    """One streamed pass over a loader: its arguments (``preflight``: once, on the first batch) and counts."""

    generator: torch.Generator | None = None
    progress: bool = False
    on_batch: BatchObserver | None = None
    preflight: Callable[[Tensor, Tensor | None, Tensor | None], None] | None = None
    batches: int = 0
    skipped: int = 0

    def finish(self, model: nn.Module, stacklevel: int = 3) -> None:
        """Warn about a model left in training mode and skipped batches (``stacklevel``: the user's call)."""
        if model.training:
            warnings.warn(
                "model is in training mode; the curvature was computed in eval mode (dropout would "
                "corrupt it) and every module's mode restored afterwards",
                stacklevel=stacklevel,
            )
        if self.skipped:
            warnings.warn(
                f"skipped {self.skipped} of {self.batches} batches with no labelled outputs (every "
                "label -100)",
                stacklevel=stacklevel,
            )


def entry_pass(compute: Callable[..., Any], args: Mapping[str, Any], subject: Any) -> Any:
    """``compute(model, loader, subject, options, run)`` of a public routine, ``args`` its arguments (checked).

    The options and the `Run` come from ``args`` (the routine's ``locals()``); warnings at the user's line.
    """
    model = args["model"]
    rest = ("model", "loader", "subset", "generator", "progress", "on_batch")  # not the options
    given = {k: v for k, v in args.items() if k not in rest}
    given["shift_labels"] = resolve_shift_labels(model, given["shift_labels"])
    options = CurvatureOptions(**given)
    run = Run(check_generator(args["generator"]), args["progress"], args["on_batch"])
    out = compute(model, args["loader"], subject, options, run)
    run.finish(model, stacklevel=4)
    return out


@dataclass
class BatchPasses:
    """One batch: merged inputs, kept positions, input token masks and a lazy iterator of ``{module: δ}``."""

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
    """Stream ``loader``: per batch one forward pass (labels, logits checked), then the backward passes, lazily."""
    device, fisher = model_device(model), FISHERS[options.fisher]
    it: Iterable[Any] = loader
    if run.progress:
        with suppress(ImportError):  # tqdm is optional
            from tqdm.auto import tqdm

            it = tqdm(loader, desc="curvature")
    for index, batch in enumerate(it):
        run.batches += 1
        with prefixed(f"batch {index}"):
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
            rows, labels = outputs.rows(logits, keep, options.num_classes)
        if rows.shape[0] == 0:  # token-level: no kept position (padding, -100, the causal shift)
            run.skipped += 1
            continue
        if run.on_batch is not None:
            run.on_batch(index, rows.detach(), labels)
        if fisher.per_class:
            rounds = 1 if keep is None or positions == "joint" else int(keep.sum(1).max())
            check_exact_fisher(rows, rounds, index)
        if run.preflight is not None:
            run.preflight(logits.detach(), keep, outputs.attention_mask)
            run.preflight = None  # the first batch only
        if fisher.labels and labels is None:
            raise ValueError(
                f"batch {index}: fisher={fisher.name!r} needs labels, the batch has none"
            )
        f = rows.detach()
        p = torch.softmax(f, dim=-1) if options.likelihood == "classification" else None
        k, s = options.mc_samples, float(options.sigma_noise)
        vectors = fisher.vectors(f, p, labels, k, s, run.generator)  # [S, N, C]
        del p  # not held through the passes
        merged = {n: merge_calls(n, xs) for n, xs in calls_in.items()}  # shapes checked
        mask, masks = outputs.attention_mask, {}
        for n, xs in calls_in.items():  # float [B, T] masks of the real positions of merged inputs
            parts = [
                x.new_ones(x.shape[0], 1)
                if x.ndim == 2
                else mask.to(x.dtype)
                if mask is not None and mask.shape == x.shape[:2]
                else x.new_ones(x.shape[:2])
                for x in xs
            ]
            masks[n] = None if len(xs) == 1 and xs[0].ndim == 2 else torch.cat(parts, dim=1)
        yield BatchPasses(
            index=index,
            n_examples=int(logits.shape[0]),
            inputs=merged,
            keep=keep,
            token_masks=masks,
            passes=backward_passes(logits, calls_out, vectors, keep, positions),
        )
        del logits, rows
    if run.skipped == run.batches:  # none usable: an empty loader, or only unlabelled batches
        raise ValueError(
            f"every batch of the loader ({run.batches}) has no labelled output (every label -100): "
            "nothing to compute the curvature from"
            if run.batches
            else "loader is empty: no batch to compute the curvature from"
        )


@dataclass
class PositionGrads:
    """One round of `position_plan`: ``examples [n]``, row-major ``keys [n]``, ``{module: [δ per logit k]}``."""

    examples: Tensor
    keys: Tensor
    grads: dict[str, list[Tensor]]


@dataclass
class OutputPasses:
    """One hooked forward pass: detached ``logits``, ``keep``, merged ``inputs`` and lazy `PositionGrads`."""

    logits: Tensor
    keep: Tensor | None
    inputs: dict[str, Tensor]
    positions: Iterator[PositionGrads]


def _position_grads(
    logits: Tensor,
    keep: Tensor | None,
    calls: Mapping[str, list[Tensor]],
    rows: Mapping[str, Tensor | None],
    ids: Tensor | None,
) -> Iterator[PositionGrads]:
    """The ``K`` backward passes (cotangents ``e_k``, ``k ∈ ids``, ``None``: all) of every kept position, by rounds."""
    dev = logits.device
    ids = torch.arange(logits.shape[-1], device=dev) if ids is None else ids.to(dev)
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
    passes = backward_passes(logits, calls, vectors, keep, "each")
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
    """Hooked forward pass, then lazily ``K`` backward passes per kept position (``rows`` gather ``δ``)."""
    logits, calls_in, calls_out = hooked_forward(model, inputs, modules, cols)
    keep = outputs.keep(logits)
    return OutputPasses(
        logits=logits.detach(),
        keep=keep,
        inputs={n: merge_calls(n, xs) for n, xs in calls_in.items()},
        positions=_position_grads(logits, keep, calls_out, rows, outputs.target_ids),
    )


def in_row_order(keys: list[Tensor], parts: list[Tensor]) -> Tensor:
    """Concatenate per-round results ``[n_i, ...]`` sorted by key (row-major ``(b, t)``)."""
    if len(parts) == 1:
        return parts[0]
    order = torch.argsort(torch.cat(keys))
    return torch.cat(parts).index_select(0, order.to(parts[0].device))


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """In-place ``"sum"`` / ``"max"`` all-reduce of ``t`` across ranks; a no-op without a process group of 2+."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


@contextmanager
def fail_together(device: torch.device) -> Iterator[None]:
    """Run collective-free work; on exit every rank all-reduces a failure flag and raises if any rank did."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    try:
        yield
    except Exception:
        dist.all_reduce(torch.ones((), device=device), op=dist.ReduceOp.SUM)
        raise
    failed = torch.zeros((), device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    if int(failed) > 0:
        raise RuntimeError(
            f"{int(failed)} other rank(s) raised while computing the curvature on their shard; "
            "see their error"
        )
