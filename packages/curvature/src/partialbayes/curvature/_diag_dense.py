"""Diagonal and dense GGN / Fisher of the entries of any subset of linear-map weights (masks included)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import (
    BatchObserver,
    Run,
    all_reduce,
    entry_pass,
    fail_together,
    stream,
)
from partialbayes.curvature._jacobians import ParamTarget, entry_grads, param_targets
from partialbayes.curvature._likelihood import FISHERS, CurvatureOptions
from partialbayes.predictive.internal import check_finite
from partialbayes.selection import Subset


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

    ``fisher="exact"`` gives the GGN diagonal, ``"mc"`` a sampled-label estimate, ``"empirical"`` the
    empirical Fisher. Token-level outputs are exact per position (``C`` backward passes per kept position
    for ``"exact"``; ``"mc"`` samples all positions in one pass, unbiased). Label -100 as in `kfac`.

    ``model`` returns logits ``[B, C]`` or ``[B, T, C]`` and is evaluated in eval mode; ``subset`` is any
    subset (mask or Kronecker blocks) of weights / biases of ``nn.Linear`` / HF ``Conv1D``; ``dtype`` is the
    accumulation dtype (float32 or float64); ``loader`` and the other keywords are as in `kfac`.

    Returns:
        ``{param name: h}`` with ``h`` 1-D in ``subset.gather`` order (summed over examples and ranks).

    Raises:
        ValueError: Parameters outside linear maps, bad options, empty loader or batch, bad labels / logits,
            non-finite curvature (naming the parameter and batch).
        RuntimeError: Under ``torch.distributed``, when another rank failed on its shard.
    """
    return entry_pass(diagonal, locals(), subset)


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
    r"""Dense summed GGN / Fisher ``H`` ``[P, P]`` of the subset's entries (a small subset: the last layer).

    $$ H = \sum_n \sum_s g_{n,s} g_{n,s}^\top, \qquad g_{n,s} = J_n^\top v_{n,s}, $$

    one ``[S·B, P]`` matmul per batch; entries parameter by parameter in ``subset.names`` order, each in
    ``subset.gather`` order. Token-level outputs and label -100 as in `diag_curvature`.

    ``model``, ``loader``, ``dtype`` and the keywords as in `diag_curvature`; ``subset`` is a subset of
    weights / biases of ``nn.Linear`` / HF ``Conv1D`` (mask or Kronecker blocks).

    Returns:
        ``H`` ``[P, P]``, ``P = subset.num_entries()``, summed over examples (and ranks).

    Raises:
        ValueError: Parameters outside linear maps, bad options, empty loader or batch, bad labels / logits,
            non-finite curvature (naming the parameter and batch).
        RuntimeError: Under ``torch.distributed``, when another rank failed on its shard.
    """
    return entry_pass(dense, locals(), subset)


def _first_bad(targets: list[ParamTarget], finite: Tensor) -> str:
    """The first parameter with a non-finite entry, from ``finite [P]`` over the concatenated entries."""
    start = 0
    for t in targets:
        k = t.index.numel()
        if not bool(finite[start : start + k].all()):
            return t.name
        start += k
    return targets[0].name


def diagonal(
    model: nn.Module, loader: Iterable[Any], subset: Subset, options: CurvatureOptions, run: Run
) -> dict[str, Tensor]:
    """`diag_curvature`'s pass with the options already checked."""
    targets, modules = param_targets(model, subset)
    device = dict(model.named_parameters())[targets[0].name].device
    dtype = options.dtype
    out = {t.name: torch.zeros(t.index.numel(), dtype=dtype, device=device) for t in targets}
    # weights of [B, d] activations: Σ_n (δ_n x_nᵀ)² = (Σ_s δ_s²)ᵀ (x ⊙ x), one matmul into the full matrix
    full_2d: dict[str, Tensor] = {}
    positions = FISHERS[options.fisher].positions  # see the module notes
    with fail_together(device):
        for bp in stream(model, loader, modules, options, run, positions):
            d2: dict[str, Tensor] = {}
            inc: dict[str, Tensor] = {}
            for grads in bp.passes:
                for t in targets:
                    x, d = bp.inputs[t.module], grads[t.module]
                    if t.role == "weight" and x.ndim == 2:
                        sq = d.to(dtype) ** 2
                        d2[t.name] = d2[t.name] + sq if t.name in d2 else sq
                    else:
                        g2 = (entry_grads(t, x, d).to(dtype) ** 2).sum(0)
                        inc[t.name] = inc[t.name] + g2 if t.name in inc else g2
            for t in targets:
                if t.name in d2:
                    x = bp.inputs[t.module].to(dtype)
                    inc[t.name] = d2[t.name].T @ (x * x)
            for name, v in inc.items():
                check_finite(v, f"non-finite curvature of {name!r} at batch {bp.index}")
                if name in d2:
                    full_2d[name] = full_2d[name] + v if name in full_2d else v
                else:
                    out[name] += v
    for t in targets:
        if t.name in full_2d:
            w = full_2d[t.name].T if t.transposed else full_2d[t.name]
            out[t.name] = w.reshape(-1).index_select(0, t.index)
        all_reduce(out[t.name])
    return out


def dense(
    model: nn.Module, loader: Iterable[Any], subset: Subset, options: CurvatureOptions, run: Run
) -> Tensor:
    """`dense_curvature`'s pass with the options already checked."""
    targets, modules = param_targets(model, subset)
    device = dict(model.named_parameters())[targets[0].name].device
    p = sum(t.index.numel() for t in targets)
    H = torch.zeros(p, p, dtype=options.dtype, device=device)
    positions = FISHERS[options.fisher].positions  # see the module notes
    with fail_together(device):
        for bp in stream(model, loader, modules, options, run, positions):
            rows = [
                torch.cat(
                    [entry_grads(t, bp.inputs[t.module], grads[t.module]) for t in targets], dim=1
                )
                for grads in bp.passes
            ]
            g = torch.cat(rows).to(options.dtype)
            inc = g.T @ g
            if not bool(torch.isfinite(inc).all()):
                bad = _first_bad(targets, torch.isfinite(g).all(0))
                raise ValueError(f"non-finite curvature in parameter {bad!r} at batch {bp.index}")
            H += inc
    return all_reduce(H)
