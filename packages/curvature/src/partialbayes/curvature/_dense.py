"""Dense GGN / Fisher of a small subset (the last layer, a few thousand entries)."""

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


def dense_curvature(
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
) -> Tensor:
    r"""Dense summed GGN / Fisher ``H`` ``[P, P]`` of the subset's entries.

    $$ H = \sum_n \sum_s g_{n,s} g_{n,s}^\top, \qquad g_{n,s} = J_n^\top v_{n,s}, $$

    with the per-example gradients from linear-map hooks, one ``[S·B, P]`` matmul per batch. Entries are
    ordered parameter by parameter in ``subset.names`` order, each in ``subset.gather`` order.

    Token-level outputs (logits ``[B, T, C]``) count one output per kept position (attention mask 1, label
    not -100; causal LMs: see ``shift_labels``), with exact per-position gradients: ``fisher="exact"`` costs
    ``C`` backward passes per kept position (and ``"empirical"`` one), ``"mc"`` ``mc_samples`` passes per
    batch (all positions' sampled vectors at once, an unbiased estimate).

    Args:
        model: Network returning logits ``[B, C]`` or ``[B, T, C]``; evaluated in eval mode.
        loader: Iterable of batches: tensors, pairs ``(inputs, labels)`` or mappings (``dict``,
            ``BatchEncoding``) with ``"labels"`` / ``"label"``.
        subset: Subset of weights / biases of ``nn.Linear`` / HF ``Conv1D`` (mask or Kronecker blocks).
        likelihood: ``"classification"`` or ``"regression"``.
        fisher: ``"exact"`` (GGN), ``"mc"`` or ``"empirical"``.
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
        ``H`` ``[P, P]``, ``P = subset.num_entries()``, summed over examples (and ranks).

    Raises:
        ValueError: Parameters outside linear maps, bad options, empty loader, bad labels (whenever a
            batch has them) / logits, non-finite curvature (naming the batch).
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
    device = dict(model.named_parameters())[targets[0].name].device
    p = sum(t.index.numel() for t in targets)
    H = torch.zeros(p, p, dtype=dtype, device=device)
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
            rows = [
                torch.cat(
                    [entry_grads(t, bp.inputs[t.module], grads[t.module]) for t in targets], dim=1
                )
                for grads in bp.passes
            ]
            if not rows:  # token-level batch without a kept position: no backward pass
                continue
            g = torch.cat(rows).to(dtype)
            inc = g.T @ g
            if not bool(torch.isfinite(inc).all()):
                ok = torch.isfinite(g).all(0)
                start, bad = 0, targets[0].name
                for t in targets:
                    k = t.index.numel()
                    if not bool(ok[start : start + k].all()):
                        bad = t.name
                        break
                    start += k
                raise ValueError(f"non-finite curvature in parameter {bad!r} at batch {bp.index}")
            H += inc
    return all_reduce_sum(H)
