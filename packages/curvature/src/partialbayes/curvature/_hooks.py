"""Forward hooks and the streamed backward passes every curvature routine is built on.

One forward pass per minibatch records, for each hooked linear map, its input ``x`` (already gathered to the
selected columns) and its output tensor. Then ``S`` backward passes of the logits (one per cotangent from
:func:`partialbayes.curvature._likelihood.output_vectors`) return ``δ``, the gradient w.r.t. every hooked
output, through ``torch.autograd.grad`` (no parameter ``.grad`` is touched, no weight gradients are computed).
Nothing about an example is kept beyond its batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._likelihood import (
    check_logits,
    logits_of,
    model_device,
    output_vectors,
    split_batch,
)


class Recorder:
    """Context manager hooking linear maps: records gathered inputs and raw outputs of one forward pass.

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
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self._handles: list[Any] = []

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            if name in self.outputs:
                raise ValueError(
                    f"module {name!r} is called more than once per forward pass; "
                    "curvature of shared (reused) linear maps is not supported"
                )
            x = args[0].detach()
            c = self.cols[name]
            self.inputs[name] = x if c is None else x.index_select(-1, c)
            self.outputs[name] = output

        return hook

    def clear(self) -> None:
        """Forget the last forward pass."""
        self.inputs.clear()
        self.outputs.clear()

    def __enter__(self) -> Recorder:
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()


@contextmanager
def prepared(
    model: nn.Module, modules: Mapping[str, nn.Module], switch: bool = True
) -> Iterator[None]:
    """Eval mode (warning if the model was training), gradients enabled, target weights differentiable.

    Restores the model's mode and the weights' ``requires_grad`` afterwards, even on error. With
    ``switch=False`` the model's mode is left alone.
    """
    was_training = model.training
    if was_training and switch:
        warnings.warn(
            "model is in training mode; the curvature is computed in eval mode (dropout would corrupt it) "
            "and the mode is restored afterwards",
            UserWarning,
            stacklevel=4,
        )
    flags = [(m.weight, m.weight.requires_grad) for m in modules.values()]
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
        model.train(was_training)


@dataclass
class BatchPasses:
    """One minibatch: recorded inputs and a lazy iterator over the backward passes.

    Attributes:
        index: Batch index in the loader.
        n_examples: Examples (sequences) in the batch, ``B``.
        inputs: Module -> gathered input ``x`` (``[B, c]`` or ``[B, T, c]``).
        mask: Attention mask ``[B, T]`` (bool) or ``None``.
        passes: Iterator of ``{module: δ}`` (``[B, n_out]`` or ``[B, T, n_out]``, full rows), one per cotangent;
            exhaust it before advancing to the next batch.
    """

    index: int
    n_examples: int
    inputs: dict[str, Tensor]
    mask: Tensor | None
    passes: Iterator[dict[str, Tensor]]


def _backward_passes(
    logits: Tensor, outputs: dict[str, Tensor], vectors: Tensor
) -> Iterator[dict[str, Tensor]]:
    names = list(outputs)
    tensors = [outputs[n] for n in names]
    s = vectors.shape[0]
    for i in range(s):
        grads = torch.autograd.grad(
            logits, tensors, grad_outputs=vectors[i], retain_graph=i < s - 1, allow_unused=True
        )
        yield {
            n: (torch.zeros_like(t) if g is None else g)
            for n, t, g in zip(names, tensors, grads, strict=True)
        }


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
    progress: bool = False,
) -> Iterator[BatchPasses]:
    """Stream the loader: one forward pass per batch, then the fisher's backward passes, lazily.

    Must run inside :func:`prepared`.

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
            inputs, labels, mask = split_batch(batch, device)
            rec.clear()
            logits = logits_of(model, inputs)
            check_logits(logits, num_classes, index)
            missing = [n for n in modules if n not in rec.outputs]
            if missing:
                raise ValueError(
                    f"batch {index}: modules {missing} were not called by the model's forward pass"
                )
            vectors = output_vectors(
                logits,
                labels,
                likelihood=likelihood,
                fisher=fisher,
                mc_samples=mc_samples,
                sigma_noise=sigma_noise,
                generator=generator,
                batch_index=index,
            )
            yield BatchPasses(
                index=index,
                n_examples=int(logits.shape[0]),
                inputs=dict(rec.inputs),
                mask=None if mask is None else mask.bool(),
                passes=_backward_passes(logits, dict(rec.outputs), vectors),
            )
            del logits
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
