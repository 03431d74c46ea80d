"""Parameter-level strategies: individual entries become stochastic (elementwise MaskBlocks)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from partialbayes.selection._blocks import Block, MaskBlock
from partialbayes.selection._subset import (
    EMBEDDINGS,
    Subset,
    countable_named_parameters,
    countable_parameters,
)
from partialbayes.selection._validate import (
    as_generator,
    ceil_fraction,
    check_finite,
    check_names,
    check_percent,
    check_type,
)


def _countable(model: nn.Module, exclude: str | Iterable[str] | None) -> dict[str, Tensor]:
    params = countable_named_parameters(model, exclude)
    if not params:
        countable_parameters(model, exclude)  # raises the clear error
    return {n: p.detach() for n, p in params.items()}


def _masks_from_flat(
    model: nn.Module, params: Mapping[str, torch.Size], flat_index: Tensor
) -> Subset:
    """Subset of MaskBlocks from indices into the concatenation (in ``params`` order) of flattened params."""
    sizes = [int(s.numel()) for s in params.values()]
    flat = torch.zeros(sum(sizes), dtype=torch.bool)
    flat[flat_index.cpu()] = True
    blocks: dict[str, Block] = {}
    for (name, shape), chunk in zip(params.items(), torch.split(flat, sizes), strict=True):
        if bool(chunk.any()):
            blocks[name] = MaskBlock(chunk.reshape(shape))
    return Subset.from_model(model, blocks)


def _top_scores(
    model: nn.Module, scores: Mapping[str, Tensor], percent: float, total: int
) -> Subset:
    """Top ``ceil(percent·total/100)`` entries of the concatenated scores (ties by flat index)."""
    k = ceil_fraction(percent, total)
    n_scores = sum(int(s.numel()) for s in scores.values())
    if k > n_scores:
        raise ValueError(
            f"percent={percent} asks for {k} entries but only {n_scores} are given scores"
        )
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in scores.values()))
    flat = torch.cat([s.detach().reshape(-1).to("cpu", dtype) for s in scores.values()])
    return _masks_from_flat(model, {n: s.shape for n, s in scores.items()}, top_k_stable(flat, k))


def top_k_stable(flat: Tensor, k: int) -> Tensor:
    """Sorted indices of the ``k`` largest entries of ``flat`` (no NaN), ties by lower index, in O(n).

    The set of ``torch.sort(flat, descending=True, stable=True).indices[:k]``: every entry above the k-th
    largest value ``t`` (``kthvalue``), then the first entries equal to ``t``.
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n)
    t = torch.kthvalue(flat, n - k + 1).values
    above = (flat > t).nonzero().flatten()
    ties = (flat == t).nonzero().flatten()[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


def largest_magnitude(
    model: nn.Module, percent: float, exclude: str | Iterable[str] | None = EMBEDDINGS
) -> Subset:
    """The ``percent`` % of countable parameters with the largest absolute value (ties by position).

    Nested in ``percent``. Countable = every parameter except token / position embeddings by default.

    Raises:
        ValueError: Percent outside (0, 100]; non-finite weights (naming the parameter).
    """
    p = check_percent(percent)
    params = _countable(model, exclude)
    for n, w in params.items():
        check_finite(f"parameter {n!r}", w)
    total = sum(w.numel() for w in params.values())
    return _top_scores(model, {n: w.abs() for n, w in params.items()}, p, total)


def random_parameters(
    model: nn.Module,
    percent: float,
    seed: int | torch.Generator = 0,
    exclude: str | Iterable[str] | None = EMBEDDINGS,
) -> Subset:
    """``percent`` % of the countable parameter entries, uniformly without replacement.

    The draw is a prefix of one seeded permutation of all countable entries, so for a fixed seed the
    subsets are nested in ``percent``.
    """
    p = check_percent(percent)
    params = _countable(model, exclude)
    total = sum(w.numel() for w in params.values())
    perm = torch.randperm(total, generator=as_generator(seed))
    return _masks_from_flat(
        model, {n: w.shape for n, w in params.items()}, perm[: ceil_fraction(p, total)]
    )


def largest_marginal_variance(
    model: nn.Module,
    variances: Mapping[str, Tensor],
    percent: float,
    exclude: str | Iterable[str] | None = EMBEDDINGS,
) -> Subset:
    """Entries with the largest marginal posterior variance (Daxberger et al., 2021).

    Args:
        model: The model the variances belong to.
        variances: Parameter name -> variances in the parameter's storage shape, from any source (e.g. a
            diagonal Laplace or diagonal SWAG). Parameters left out are never selected.
        percent: Percentage of the model's countable parameters to select, in (0, 100].
        exclude: Denominator rule, as in :func:`countable_parameters`.

    Raises:
        ValueError: Unknown names (close matches), shape mismatch, negative or non-finite variances
            (naming the parameter), or more entries asked for than variances given.
    """
    p = check_percent(percent)
    if not isinstance(variances, Mapping) or not variances:
        raise ValueError("variances must be a non-empty mapping parameter name -> tensor")
    named = dict(model.named_parameters())
    check_names(list(variances), named, "parameter")
    scores: dict[str, Tensor] = {}
    for n in named:
        if n not in variances:
            continue
        v = variances[n]
        check_type(f"variances[{n!r}]", v, Tensor, "a tensor")
        if v.shape != named[n].shape:
            raise ValueError(
                f"variances[{n!r}] has shape {tuple(v.shape)}, parameter has {tuple(named[n].shape)}"
            )
        if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
            raise ValueError(f"variances[{n!r}] has negative or non-finite entries")
        scores[n] = v
    return _top_scores(model, scores, p, countable_parameters(model, exclude))
