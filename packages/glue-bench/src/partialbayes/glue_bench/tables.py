"""The report's tables, computed from results records: Table 2 (≈ 10 % budget), strategy ranks, calibration.

Functions take records or ``report.summarise`` rows and return plain rows, which the report writes as
markdown (:func:`markdown`, the one renderer, with column specs) and CSV (:func:`write_csv`, atomically).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialbayes.glue_bench.store import atomic_write
from partialbayes.predictive.internal import check_number

# Module-ramping strategies of the paper's Fig. 4: <family>-<strategy>, sizes = module counts.
STRATEGY_PATTERN = re.compile(
    r"^(?P<family>kfac|swag)-(?P<strategy>random|(?:max|min)(?:-(?:mlp|attn))?)$"
)

BASELINES = ("map", "temperature")


Column = tuple[str, Callable[[dict[str, Any]], str], str]
"""One column of a markdown table: ``(header, cell(row) -> text, alignment "l" or "r")``."""


def markdown(rows: Iterable[dict[str, Any]], columns: Sequence[Column]) -> str:
    """The one markdown renderer of glue-bench: a header, an alignment rule and one line per row."""
    lines = [
        "| " + " | ".join(head for head, _, _ in columns) + " |",
        "|" + "".join("---:|" if align == "r" else "---|" for _, _, align in columns),
    ]
    for r in rows:
        cells = (c(r) for _, c, _ in columns)
        lines.append("|" + "|".join(f" {text} " if text else " " for text in cells) + "|")
    return "\n".join(lines) + "\n"


def col(header: str, key: str, fmt: str = "{}", align: str = "l") -> Column:
    """A column that shows ``row[key]`` formatted with ``fmt`` (a ``str.format`` pattern)."""
    return header, lambda row: fmt.format(row[key]), align


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write ``rows`` as CSV (header = union of the keys, in first-seen order), atomically."""
    fields: dict[str, None] = {}
    for r in rows:
        fields.update(dict.fromkeys(r))
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(fields), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    atomic_write(path, buf.getvalue())


def size_key(size: str) -> tuple[int, float, str]:
    """Sort key of a size label: ``"-"`` first, then numeric sizes by value."""
    try:
        return (1, float(size), size)
    except ValueError:
        return (0, 0.0, size)


# ------------------------------------------------------------------------------------------ Table 2
# "≈ 10 %": a level is within the budget when its median percent stochastic is at most target · (1 +
# BUDGET_TOLERANCE): the paper's ≈ 10 % cells (S-KFAC p = 33, two MLP maps of MiniLM) hold about 11 %.
BUDGET_TOLERANCE = 0.15


def budget_table(
    rows: Sequence[dict[str, Any]], target: float = 10.0, tolerance: float = BUDGET_TOLERANCE
) -> list[dict[str, Any]]:
    """The paper's Table 2: per (task, method) the level chosen by validation NLL within the budget.

    Among a method's sizes with median percent stochastic ``<= target · (1 + tolerance)``, the lowest mean
    validation NLL (ties: smaller percentage, then size; rule ``val_nll``), or without one the size closest to
    ``target`` (``closest``); one-size methods give their cell (``single``). Rows gain ``target``, ``limit``,
    ``candidates``, ``rule``.
    """
    check_number("target", target, "[0, 100]")
    check_number("tolerance", tolerance, "[0, inf)")
    limit = target * (1 + tolerance)
    by_method: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_method[(r["task"], r["method"])].append(r)
    out = []
    for key in sorted(by_method):
        sizes = by_method[key]
        if len(sizes) == 1 and sizes[0]["size"] == "-":
            chosen, rule, n = sizes[0], "single", 1
        else:
            within = [r for r in sizes if r["percent_stochastic"] <= limit + 1e-12]
            if not within:
                continue
            n = len(within)
            scored = [r for r in within if "val_nll_mean" in r]
            rule = "val_nll" if scored else "closest"

            def key(r: dict[str, Any], by_val: bool = bool(scored)) -> tuple:
                first = r["val_nll_mean"] if by_val else abs(r["percent_stochastic"] - target)
                return first, r["percent_stochastic"], size_key(r["size"])

            chosen = min(scored or within, key=key)
        out.append({**chosen, "target": float(target), "limit": limit, "candidates": n})
        out[-1]["rule"] = rule
    return out


# ------------------------------------------------------------------------------------------ Fig. 4
def average_ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n of ``values`` in ascending order, ties sharing the mean of their positions.

    >>> average_ranks([0.3, 0.1, 0.3])
    [2.5, 1.0, 2.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def strategy_ranks(records: Iterable[dict[str, Any]], metric: str = "nll") -> list[dict[str, Any]]:
    """Ranks of the module-selection strategies (``<kfac|swag>-<random|max|min>[-mlp|-attn]``), Fig. 4.

    Per (task, family, module count) the strategies are ranked by median ``metric`` over splits (0 = lowest,
    ties share the mean rank), ``"all"`` rows (last) by the median of the per-task ranks; ``split_rank``: the
    mean of per-split ranks over the splits every strategy has. One-strategy groups are left out.
    """
    values: dict[tuple[str, str, int], dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for r in records:
        m = STRATEGY_PATTERN.match(str(r.get("method", "")))
        if m is None or metric not in r or not str(r["size"]).isdigit():
            continue
        group = values[(r["task"], m["family"], int(r["size"]))]
        group[m["strategy"]][int(r["split"])] = float(r[metric])
    rows = []
    per_task: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    split_count: dict[tuple[str, int, str], int] = defaultdict(int)
    n_strat_all: dict[tuple[str, int], int] = {}
    for (task, family, k), by_strategy in sorted(values.items()):
        strategies = sorted(by_strategy)
        if len(strategies) < 2:
            continue
        medians = [float(np.median(list(by_strategy[s].values()))) for s in strategies]
        ranks = [rk - 1 for rk in average_ranks(medians)]
        complete = set.intersection(*(set(by_strategy[s]) for s in strategies))
        split_ranks: dict[str, list[float]] = defaultdict(list)
        for split in sorted(complete):
            ranked = average_ranks([by_strategy[s][split] for s in strategies])
            for s, rk in zip(strategies, ranked, strict=True):
                split_ranks[s].append(rk - 1)
        for s, rk, med in zip(strategies, ranks, medians, strict=True):
            cell = {"task": task, "family": family, "modules": k, "strategy": s, "rank": rk}
            cell.update(n_splits=len(by_strategy[s]), n_tasks=1, n_strategies=len(strategies))
            cell["split_rank"] = float(np.mean(split_ranks[s])) if split_ranks[s] else math.nan
            rows.append({**cell, f"{metric}_median": med})
            per_task[(family, k, s)].append(rk)
            split_count[(family, k, s)] += len(by_strategy[s])
        n_strat_all[(family, k)] = max(n_strat_all.get((family, k), 0), len(strategies))
    for (family, k, s), ranks_ in per_task.items():
        cell = {"task": "all", "family": family, "modules": k, "strategy": s}
        cell.update(rank=float(np.median(ranks_)), n_splits=split_count[(family, k, s)])
        cell.update(n_tasks=len(ranks_), n_strategies=n_strat_all[(family, k)], split_rank=math.nan)
        rows.append({**cell, f"{metric}_median": math.nan})
    rows.sort(
        key=lambda r: (r["task"] == "all", r["task"], r["family"], r["modules"], r["strategy"])
    )
    return rows


# ------------------------------------------------------------------------------------------ Fig. 6
def has_reliability(record: dict[str, Any]) -> bool:
    """Whether a record carries reliability-diagram bins (older records do not)."""
    rel = record.get("reliability")
    return isinstance(rel, dict) and all(k in rel for k in ("confidence", "accuracy", "count"))


def calibration_curves(
    records: Iterable[dict[str, Any]], cells: Iterable[tuple[str, str, str]]
) -> list[dict[str, Any]]:
    """Reliability points of the chosen (task, method, size) cells, bins pooled over splits by count (empty ones dropped)."""
    wanted = list(dict.fromkeys(cells))
    found: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = (r["task"], r["method"], str(r["size"]))
        if key in wanted and has_reliability(r):
            found[key].append(r["reliability"])
    rows = []
    for key in wanted:
        rels = found.get(key)
        if not rels:
            continue
        n_bins = max(len(rel["count"]) for rel in rels)
        count, conf, acc = np.zeros(n_bins), np.zeros(n_bins), np.zeros(n_bins)
        for rel in rels:
            c = np.asarray(rel["count"], dtype=float)
            count[: len(c)] += c
            conf[: len(c)] += c * np.asarray(rel["confidence"], dtype=float)
            acc[: len(c)] += c * np.asarray(rel["accuracy"], dtype=float)
        cell = dict(zip(("task", "method", "size"), key, strict=True))
        for b in np.flatnonzero(count).tolist():
            pooled = {"confidence": float(conf[b] / count[b]), "accuracy": float(acc[b] / count[b])}
            rows.append({**cell, "bin": b, **pooled, "count": int(count[b]), "n_splits": len(rels)})
    return rows


def calibration_cells(
    budget_rows: Sequence[dict[str, Any]], methods: Sequence[str] | None = None, n_best: int = 4
) -> list[tuple[str, str, str]]:
    """The calibration figure's Table 2 cells per task: of ``methods``, or MAP, temperature and the ``n_best`` lowest-NLL others."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in budget_rows:
        by_task[r["task"]].append(r)
    cells = []
    for task in sorted(by_task):
        rows = by_task[task]
        if methods is not None:
            chosen = [r for m in methods for r in rows if r["method"] == m]
        else:
            base = [r for m in BASELINES for r in rows if r["method"] == m]
            others = sorted(
                [r for r in rows if r["method"] not in BASELINES], key=lambda r: r["nll"]
            )
            chosen = base + others[:n_best]
        cells += [(task, r["method"], r["size"]) for r in chosen]
    return cells
