"""Module-level strategies: whole linear maps (weight and bias) become stochastic."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from partialbayes.selection._blocks import Block, KronBlock
from partialbayes.selection._modules import (
    Grouping,
    grouped_linear_modules,
    linear_modules,
)
from partialbayes.selection._norms import operator_norms
from partialbayes.selection._subset import Subset
from partialbayes.selection._validate import as_generator, check_count, check_names, check_type

PAPER_COUNTS: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 8, 11, 17, 38)
"""Module counts of the ramping experiments of Kampen et al."""


def whole_modules(model: nn.Module, names: Iterable[str]) -> Subset:
    """Subset making every parameter of the named (valid) modules stochastic; refuses tied weights."""
    all_modules = dict(model.named_modules())
    owner = {id(p): n for n, p in model.named_parameters()}
    blocks: dict[str, Block] = {}
    for name in names:
        prefix = f"{name}." if name else ""
        for pname, p in all_modules[name].named_parameters():
            full = prefix + pname
            if owner[id(p)] != full:
                raise ValueError(
                    f"parameter {full!r} of module {name!r} is the same tensor as {owner[id(p)]!r} (tied "
                    "weights, e.g. a head tied to the token embedding, never stochastic); select the "
                    "module that owns it or other modules, or untie the weights"
                )
            blocks[full] = KronBlock()
    return Subset.from_model(model, blocks)


def rank_by_operator_norm(
    model: nn.Module,
    group: str = "mlp",
    descending: bool = True,
    method: str = "svd",
    grouping: Grouping | None = None,
    modules: Iterable[str] | None = None,
) -> list[tuple[str, float]]:
    """``[(module name, operator norm), ...]`` of ``group``'s linear maps, largest first if ``descending``.

    Ties keep model order; the arguments are :func:`max_operator_norm`'s.
    """
    norms = operator_norms(model, group=group, method=method, grouping=grouping, modules=modules)
    position = {n: i for i, n in enumerate(norms)}
    sign = -1.0 if descending else 1.0
    order = sorted(norms, key=lambda n: (sign * norms[n], position[n]))
    return [(n, norms[n]) for n in order]


def max_operator_norm(
    model: nn.Module,
    k: int,
    group: str = "mlp",
    method: str = "svd",
    grouping: Grouping | None = None,
    modules: Iterable[str] | None = None,
) -> Subset:
    """The ``k`` linear maps of ``group`` with the largest operator norm (weight and bias stochastic).

    Args:
        model: The model.
        k: Number of modules (0 gives the empty subset).
        group: ``"mlp"``, ``"attention"``, ``"other"``, ``"all"`` or a group of the user ``grouping``.
        method: ``"svd"`` (exact), ``"gram"`` (exact, faster) or ``"power"`` (power iteration).
        grouping: Optional user grouping (see :func:`module_groups`).
        modules: Only these linear maps are candidates (``lora_modules(model)``: the LoRA adapters, with
            ``group="all"``); default every linear map not tied to another module.

    Raises:
        ValueError: If ``k`` exceeds the number of modules in ``group`` (the message gives the count);
            unknown or tied names in ``modules``.
    """
    ranked = rank_by_operator_norm(model, group, True, method, grouping, modules)
    check_count(k, len(ranked), f"linear maps in group {group!r}")
    return whole_modules(model, [n for n, _ in ranked[:k]])


def min_operator_norm(
    model: nn.Module,
    k: int,
    group: str = "mlp",
    method: str = "svd",
    grouping: Grouping | None = None,
    modules: Iterable[str] | None = None,
) -> Subset:
    """The ``k`` linear maps of ``group`` with the smallest operator norm (see :func:`max_operator_norm`)."""
    ranked = rank_by_operator_norm(model, group, False, method, grouping, modules)
    check_count(k, len(ranked), f"linear maps in group {group!r}")
    return whole_modules(model, [n for n, _ in ranked[:k]])


def random_modules(
    model: nn.Module,
    k: int,
    seed: int | torch.Generator = 0,
    group: str = "all",
    grouping: Grouping | None = None,
    modules: Iterable[str] | None = None,
) -> Subset:
    """``k`` linear maps of ``group`` (default ``"all"``) drawn uniformly without replacement.

    The first ``k`` of a random permutation drawn with ``seed`` (an int or a cpu ``torch.Generator``), so
    for a fixed seed the subsets are nested in ``k``. ``grouping`` and ``modules`` as in
    :func:`max_operator_norm`.

    Raises:
        ValueError: If ``k`` exceeds the number of modules in ``group``; unknown or tied names in
            ``modules``.
    """
    names = list(grouped_linear_modules(model, group, grouping, modules))
    check_count(k, len(names), f"linear maps in group {group!r}")
    perm = torch.randperm(len(names), generator=as_generator(seed))
    return whole_modules(model, [names[i] for i in perm[:k].tolist()])


def last_layer(model: nn.Module) -> Subset:
    """The last linear map of ``model`` (in registration order; the classification head of HF models).

    Raises:
        ValueError: If that map's weight is tied to another module (a language-model head sharing the
            token embedding, which is never stochastic), as :func:`modules` does.
    """
    return whole_modules(model, [list(linear_modules(model))[-1]])


def modules(model: nn.Module, names: Sequence[str]) -> Subset:
    """Every parameter of the named modules is stochastic (any module, not only linear maps).

    Raises:
        ValueError: Unknown module names (listing close matches), a name given twice, a module without
            parameters.
    """
    all_modules = dict(model.named_modules())
    picked = check_names(names, all_modules, "module")
    for n in picked:
        if next(all_modules[n].parameters(), None) is None:
            raise ValueError(f"module {n!r} has no parameters")
    return whole_modules(model, picked)


def ramp(
    strategy: Callable[[int], Subset], counts: Sequence[int] = PAPER_COUNTS
) -> Iterator[Subset]:
    """Yield ``strategy(k)`` for each ``k`` in ``counts``, checking that the subsets are nested.

    ``strategy`` maps a module count to a Subset, e.g. ``lambda k: max_operator_norm(model, k)``;
    ``counts`` are non-decreasing (default the paper's ``PAPER_COUNTS``).

    Raises:
        ValueError: If ``counts`` is not non-decreasing, or a subset is not contained in the next one.
    """
    counts = list(counts)
    for a, b in itertools.pairwise(counts):
        if b < a:
            raise ValueError(f"counts must be non-decreasing, got {a} before {b}")
    prev: Subset | None = None
    prev_k = None
    for k in counts:
        s = check_type(f"strategy({k})", strategy(k), Subset, "a Subset (what strategy returns)")
        if prev is not None and not prev <= s:
            raise ValueError(f"strategy is not nested: subset for k={prev_k} is not within k={k}")
        prev, prev_k = s, k
        yield s
