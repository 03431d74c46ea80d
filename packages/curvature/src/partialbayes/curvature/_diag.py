"""Diagonal GGN / Fisher of the entries of a (possibly elementwise) subset."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._distributed import all_reduce_sum, fail_together
from partialbayes.curvature._hooks import BatchObserver, prepared, stream
from partialbayes.curvature._jacobians import entry_grads, param_targets
from partialbayes.curvature._likelihood import check_options
from partialbayes.curvature._outputs import resolve_shift_labels, token_positions
from partialbayes.selection import Subset


def _weight_diag_2d(x: Tensor, d2: Tensor) -> Tensor:
    """``Σ_n (δ_n x_nᵀ)²`` ``[r, c]`` from ``x`` ``[B, c]`` and ``Σ_s δ_s²`` ``[B, r]``: one matmul."""
    return d2.T @ (x * x)


def diag_curvature(
    model: nn.Module,
    loader: Iterable[Any],
    subset: Subset,
    *,
    likelihood: str = "classification",
    fisher: str = "exact",
    mc_samples: int = 1,
    sigma_noise: float = 1.0,
    dtype: torch.dtype = torch.float64,
    generator: torch.Generator | None = None,
    progress: bool = False,
    num_classes: int | None = None,
    on_batch: BatchObserver | None = None,
    shift_labels: bool | None = None,
) -> dict[str, Tensor]:
    r"""Diagonal of the summed GGN / Fisher for every stochastic entry of ``subset``.

    $$ h = \sum_n \sum_s (J_n^\top v_{n,s})^{\odot 2}, $$

    the per-example gradients ``J_nᵀ v_{n,s}`` coming from hooked activations and output gradients of the
    linear maps (exact, every token counts). ``fisher="exact"`` gives the GGN diagonal (one backward pass per
    class), ``"mc"`` a sampled-label estimate, ``"empirical"`` the empirical Fisher.

    Token-level outputs (logits ``[B, T, C]``) count one output per kept position (attention mask 1, label
    not -100; causal LMs: see ``shift_labels``), with exact per-position gradients: ``fisher="exact"`` costs
    ``C`` backward passes per kept position (and ``"empirical"`` one), ``"mc"`` ``mc_samples`` passes per
    batch (all positions' sampled vectors at once, an unbiased estimate).

    Args:
        model: Network returning logits ``[B, C]`` or ``[B, T, C]``; evaluated in eval mode.
        loader: Iterable of batches: tensors, pairs ``(inputs, labels)`` or mappings (``dict``,
            ``BatchEncoding``) with ``"labels"`` / ``"label"``.
        subset: Any subset (mask or Kronecker blocks) of weights / biases of ``nn.Linear`` / HF ``Conv1D``.
        likelihood: ``"classification"`` or ``"regression"``.
        fisher: ``"exact"``, ``"mc"`` or ``"empirical"``.
        mc_samples: Sampled labels per example (``fisher="mc"``).
        sigma_noise: Gaussian noise standard deviation (regression).
        dtype: Accumulation dtype.
        generator: Random generator for ``fisher="mc"``.
        progress: Show a tqdm progress bar.
        num_classes: When given, the number of logits the model must output.
        on_batch: Called as ``on_batch(index, logits, labels)`` after each batch's forward pass, with the
            detached output rows ``[N, C]`` (``[B, C]`` logits, or the kept positions of token-level ones)
            and their validated labels (``None`` for a batch without labels); e.g. to accumulate the
            training loss in the same pass (``LaplaceBase.fit`` does). The loader is read once.
        shift_labels: Token-level outputs of a causal LM: the output at ``t`` is scored against
            ``labels[t + 1]`` (see `kfac`). ``None``: whether the model is a causal LM (class name).

    Returns:
        ``{param name: h}`` with ``h`` 1-D in ``subset.gather`` order (summed over examples and ranks).

    Raises:
        ValueError: Parameters outside linear maps, bad options, empty loader, bad labels (whenever a
            batch has them) / logits, non-finite curvature (naming the parameter and batch).
        RuntimeError: Under ``torch.distributed``, on every rank whose shard went through when another
            rank raised (all ranks fail instead of waiting for each other).
    """
    check_options(
        likelihood,
        fisher,
        mc_samples,
        sigma_noise,
        dtype=dtype,
        generator=generator,
        num_classes=num_classes,
    )
    targets, modules = param_targets(model, subset)
    shift = resolve_shift_labels(model, shift_labels)
    params = dict(model.named_parameters())
    device = params[targets[0].name].device
    out = {t.name: torch.zeros(t.index.numel(), dtype=dtype, device=device) for t in targets}
    # weight name -> logical [n_out, n_in] buffer (2-D activations fast path)
    full_2d: dict[str, Tensor] = {}
    with fail_together(device), prepared(model, modules):
        for bp in stream(
            model,
            loader,
            modules,
            dict.fromkeys(modules),
            likelihood=likelihood,
            fisher=fisher,
            mc_samples=mc_samples,
            sigma_noise=sigma_noise,
            generator=generator,
            num_classes=num_classes,
            shift_labels=shift,
            positions=token_positions(fisher),
            progress=progress,
            on_batch=on_batch,
        ):
            before = {n: v.sum() for n, v in out.items()}
            d2: dict[str, Tensor] = {}
            for grads in bp.passes:
                for t in targets:
                    x, d = bp.inputs[t.module], grads[t.module]
                    if t.role == "weight" and x.ndim == 2:
                        sq = d.to(dtype) ** 2
                        d2[t.name] = d2[t.name] + sq if t.name in d2 else sq
                    else:
                        out[t.name] += (entry_grads(t, x, d).to(dtype) ** 2).sum(0)
            for t in targets:
                if t.name in d2:
                    x = bp.inputs[t.module].to(dtype)
                    w = _weight_diag_2d(x, d2[t.name])
                    if t.name in full_2d:
                        full_2d[t.name] += w
                    else:
                        full_2d[t.name] = w
            for n, v in out.items():
                inc = v.sum() - before[n] if n not in full_2d else full_2d[n].sum()
                if not bool(torch.isfinite(inc)):
                    raise ValueError(f"non-finite curvature in parameter {n!r} at batch {bp.index}")
    for t in targets:
        if t.name in full_2d:
            w = full_2d[t.name]
            w = w.T if t.transposed else w
            out[t.name] = w.reshape(-1).index_select(0, t.index)
        all_reduce_sum(out[t.name])
    return out
