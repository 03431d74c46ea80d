"""Sparse-KFAC (S-KFAC) selection of Kampen et al., Section 4, and its percent bookkeeping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from partialbayes.selection._blocks import Block, KronBlock
from partialbayes.selection._modules import candidate_modules, linear_shape
from partialbayes.selection._norms import logical_weight
from partialbayes.selection._subset import EMBEDDINGS, Subset, countable_parameters
from partialbayes.selection._validate import ceil_fraction, check_finite, check_percent


def top_by_linf(norms: Tensor, k: int) -> Tensor:
    """Sorted indices of the ``k`` largest of the ``[n]`` ``norms``, ties broken by lower index."""
    order = torch.sort(norms, descending=True, stable=True).indices
    return torch.sort(order[:k].to("cpu", torch.int64)).values


def skfac_rows_cols(
    weight: Tensor, percent: float, sequential: bool = False
) -> tuple[Tensor, Tensor]:
    """S-KFAC rows and columns (sorted int64) of one ``(n_out, n_in)`` weight at ``percent`` in (0, 100].

    Independent rule: the ceil(p·n_out/100) rows and ceil(p·n_in/100) columns of largest l-inf norm, ties
    by index. Sequential rule: columns first, then rows by the l-inf norms of the rows of ``W[:, C]``.
    """
    a = weight.detach().abs()
    n_out, n_in = a.shape
    cols = top_by_linf(a.amax(dim=0), ceil_fraction(percent, n_in))
    row_norms = a.index_select(1, cols.to(a.device)).amax(dim=1) if sequential else a.amax(dim=1)
    rows = top_by_linf(row_norms, ceil_fraction(percent, n_out))
    return rows, cols


def sparse_kfac(
    model: nn.Module,
    percent: float,
    modules: Iterable[str] | None = None,
    sequential: bool = False,
    include_bias: bool = True,
) -> Subset:
    """Sparse-KFAC subset: in each linear map keep the top ``percent`` % rows and columns by l-inf norm.

    A map's stochastic entries are ``R x C`` plus the bias entries of ``R``. The default independent rule is
    nested in ``percent``; the ``sequential`` one (columns first, rows within ``W[:, C]``) in general is not.

    Args:
        model: The model (its current weights decide the selection).
        percent: Percentage p in (0, 100] of rows and of columns kept (stochastic fraction ≈ (p/100)²).
        modules: Restrict to these linear maps (Kampen et al. appendix A.3; ``lora_modules(model)`` for the
            LoRA adapters); default every linear map not tied to another module.
        sequential: Use the sequential variant.
        include_bias: Also make the bias entries of R stochastic.

    Raises:
        ValueError: Percent outside (0, 100] (naming the value), unknown module names (close matches), a
            named module with tied weights, non-finite weights (naming the module).
    """
    p = check_percent(percent)
    blocks: dict[str, Block] = {}
    for name, mod in candidate_modules(model, modules).items():
        weight = logical_weight(mod)
        check_finite(f"module {name!r}: weight", weight)
        rows, cols = skfac_rows_cols(weight, p, sequential)
        prefix = f"{name}." if name else ""
        blocks[prefix + "weight"] = KronBlock(rows, cols)
        if include_bias and getattr(mod, "bias", None) is not None:
            blocks[prefix + "bias"] = KronBlock(rows)
    return Subset.from_model(model, blocks)


def skfac_fraction(percent: float) -> float:
    """Approximate stochastic fraction of one map at S-KFAC percentage p: (p/100)² (bias ignored)."""
    return (check_percent(percent) / 100.0) ** 2


def skfac_percent_for_fraction(fraction: float) -> float:
    """Inverse of :func:`skfac_fraction`: the percentage p with (p/100)² = ``fraction`` in (0, 1]."""
    fraction = check_percent(fraction, "fraction", 1.0)
    return 100.0 * math.sqrt(fraction)


def skfac_count(
    model: nn.Module,
    percent: float,
    modules: Iterable[str] | None = None,
    include_bias: bool = True,
) -> int:
    """Exact number of stochastic entries of :func:`sparse_kfac` (from shapes only, no weights read)."""
    p = check_percent(percent)
    total = 0
    for mod in candidate_modules(model, modules).values():
        n_out, n_in = linear_shape(mod)
        r, c = ceil_fraction(p, n_out), ceil_fraction(p, n_in)
        total += r * c + (r if include_bias and getattr(mod, "bias", None) is not None else 0)
    return total


def skfac_percent_of_params(
    model: nn.Module,
    percent: float,
    modules: Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = EMBEDDINGS,
) -> float:
    """Percent of countable parameters made stochastic by S-KFAC at percentage ``percent``."""
    return 100.0 * skfac_count(model, percent, modules) / countable_parameters(model, exclude)


def skfac_percent_for_target(
    model: nn.Module,
    target: float,
    modules: Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = EMBEDDINGS,
    tol: float = 1e-6,
) -> float:
    """Smallest S-KFAC percentage p whose subset covers at least ``target`` % of countable parameters.

    Inverse of :func:`skfac_percent_of_params` (which is non-decreasing in p), found by bisection to
    ``tol``.

    Raises:
        ValueError: Target outside (0, 100], or above what S-KFAC on these modules can reach (the message
            gives the maximum).
    """
    t = check_percent(target, "target")
    check_percent(tol, "tol", math.inf)
    modules = None if modules is None else list(modules)  # read many times below
    best = skfac_percent_of_params(model, 100.0, modules, exclude)
    if t > best + 1e-12:
        raise ValueError(
            f"target={target}% is unreachable: S-KFAC on these modules covers at most {best:.4f}% of the "
            "countable parameters"
        )
    lo, hi = 0.0, 100.0  # f(lo) < t <= f(hi)
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if skfac_percent_of_params(model, mid, modules, exclude) >= t:
            hi = mid
        else:
            lo = mid
    return hi
