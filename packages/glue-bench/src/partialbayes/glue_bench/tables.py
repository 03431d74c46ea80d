"""The report's tables, computed from results records: Table 2 (≈ 10 % budget), strategy ranks, calibration.

Every function takes plain records (dicts as written by the results store) or the rows of
:func:`partialbayes.glue_bench.report.summarise`, and returns plain rows (lists of dicts) that the report
writes as markdown and CSV and the figures draw. Outputs are written atomically.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialbayes.glue_bench.store import temp_path

# Module-ramping strategies of the paper's Fig. 4: <family>-<strategy>, sizes = module counts.
STRATEGY_PATTERN = re.compile(
    r"^(?P<family>kfac|swag)-(?P<strategy>random|(?:max|min)(?:-(?:mlp|attn))?)$"
)
BASELINES = ("map", "temperature")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a unique temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
    atomic_write_text(path, buf.getvalue())


def size_key(size: str) -> tuple[int, float, str]:
    """Sort key of a size label: ``"-"`` first, then numeric sizes by value."""
    try:
        return (1, float(size), size)
    except ValueError:
        return (0, 0.0, size)


# ------------------------------------------------------------------------------------------ Table 2
def budget_table(rows: Sequence[dict[str, Any]], target: float = 10.0) -> list[dict[str, Any]]:
    """The paper's Table 2: one cell per (task, method), the one closest to ``target`` % stochastic.

    Rule: for every method of a task, among its sizes take the one whose **median** percent stochastic over
    splits is closest to ``target`` in absolute difference (``|p − target|``); ties go to the smaller
    percentage, then to the smaller size. Methods with one size (MAP, temperature scaling, last-layer,
    full KFAC / SWAG, IVON) contribute their only cell, so the table also shows the baselines.

    Args:
        rows: Summary rows (:func:`partialbayes.glue_bench.report.summarise`).
        target: The stochastic budget in percent of the countable parameters.

    Returns:
        The selected summary rows (every metric's median and quartiles kept) with ``target`` and
        ``distance`` (``|median percent − target|``) added, sorted by task then method.

    Raises:
        ValueError: ``target`` outside [0, 100].
    """
    if not 0 <= target <= 100 or math.isnan(target):
        raise ValueError(f"target must be a percentage in [0, 100], got {target}")
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["task"], r["method"])
        rank = (abs(r["percent_stochastic"] - target), r["percent_stochastic"], size_key(r["size"]))
        if key not in best or rank < best[key]["_rank"]:
            best[key] = {**r, "_rank": rank}
    out = []
    for key in sorted(best):
        row = {k: v for k, v in best[key].items() if k != "_rank"}
        row["target"] = float(target)
        row["distance"] = abs(row["percent_stochastic"] - target)
        out.append(row)
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
    """Ranks of the module-selection strategies (the paper's Fig. 4), per task and over all tasks.

    Strategies are the module-ramping methods ``<family>-<strategy>`` with ``family`` ``kfac`` or ``swag``
    and ``strategy`` ``random``, ``max``/``min`` (``-mlp`` / ``-attn``), whose sizes are module counts.
    Rule: for every (task, family, module count, split) the strategies are ranked by ``metric`` (1 = lowest;
    ties share the mean rank); a split counts only when **every** strategy of that (task, family, module
    count) has a record in it, so all ranks of a group come from the same comparisons. The mean rank is
    the average over those splits (task ``"all"``: over every task's splits). Groups with one strategy
    are left out.

    Args:
        records: Results records.
        metric: Record field to rank by (lower is better).

    Returns:
        Rows ``task, family, modules, strategy, mean_rank, n_splits, n_strategies, <metric>_median``
        sorted by task (``"all"`` last), family, module count, strategy.
    """
    values: dict[tuple[str, str, int], dict[int, dict[str, float]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for r in records:
        m = STRATEGY_PATTERN.match(str(r.get("method", "")))
        if m is None or metric not in r or not str(r["size"]).isdigit():
            continue
        key = (r["task"], m["family"], int(r["size"]))
        values[key][int(r["split"])][m["strategy"]] = float(r[metric])
    per_task: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    metric_values: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    n_strat: dict[tuple[str, str, int], int] = {}
    for (task, family, k), by_split in values.items():
        strategies = sorted(set().union(*by_split.values()))
        if len(strategies) < 2:
            continue
        for split in sorted(by_split):
            vals = by_split[split]
            if set(vals) != set(strategies):
                continue
            ranks = average_ranks([vals[s] for s in strategies])
            for s, rk in zip(strategies, ranks, strict=True):
                for t in (task, "all"):
                    per_task[(t, family, k, s)].append(rk)
                    metric_values[(t, family, k, s)].append(vals[s])
            n_strat[(task, family, k)] = len(strategies)
            n_strat[("all", family, k)] = max(n_strat.get(("all", family, k), 0), len(strategies))
    rows = []
    for (task, family, k, s), ranks in per_task.items():
        rows.append(
            {
                "task": task,
                "family": family,
                "modules": k,
                "strategy": s,
                "mean_rank": float(np.mean(ranks)),
                "n_splits": len(ranks),
                "n_strategies": n_strat[(task, family, k)],
                f"{metric}_median": float(np.median(metric_values[(task, family, k, s)])),
            }
        )
    rows.sort(
        key=lambda r: (r["task"] == "all", r["task"], r["family"], r["modules"], r["strategy"])
    )
    return rows


# ------------------------------------------------------------------------------------------ Fig. 6
def has_reliability(record: dict[str, Any]) -> bool:
    """Whether a record carries reliability-diagram bins (records written before they existed do not)."""
    rel = record.get("reliability")
    return isinstance(rel, dict) and all(k in rel for k in ("confidence", "accuracy", "count"))


def calibration_curves(
    records: Iterable[dict[str, Any]], cells: Iterable[tuple[str, str, str]]
) -> list[dict[str, Any]]:
    """Reliability-diagram points of the chosen (task, method, size) cells, pooled over splits.

    Bin ``b`` of a cell pools bin ``b`` (the ``b``-th equal-mass bin by confidence) of every split:
    ``confidence = Σ_s n_sb conf_sb / Σ_s n_sb``, the same for accuracy, ``count = Σ_s n_sb``. With the GLUE
    dev set as the test set of every split, bin ``b`` covers the same share of the test set in each split.
    Empty pooled bins are dropped.

    Args:
        records: Results records (those without reliability bins are ignored).
        cells: (task, method, size) triples to draw.

    Returns:
        Rows ``task, method, size, bin, confidence, accuracy, count, n_splits`` in the order of ``cells``.
    """
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
        count = np.zeros(n_bins)
        conf = np.zeros(n_bins)
        acc = np.zeros(n_bins)
        for rel in rels:
            c = np.asarray(rel["count"], dtype=float)
            count[: len(c)] += c
            conf[: len(c)] += c * np.asarray(rel["confidence"], dtype=float)
            acc[: len(c)] += c * np.asarray(rel["accuracy"], dtype=float)
        for b in range(n_bins):
            if count[b] == 0:
                continue
            rows.append(
                {
                    "task": key[0],
                    "method": key[1],
                    "size": key[2],
                    "bin": b,
                    "confidence": float(conf[b] / count[b]),
                    "accuracy": float(acc[b] / count[b]),
                    "count": int(count[b]),
                    "n_splits": len(rels),
                }
            )
    return rows


def calibration_cells(
    budget_rows: Sequence[dict[str, Any]],
    methods: Sequence[str] | None = None,
    n_best: int = 4,
) -> list[tuple[str, str, str]]:
    """Which cells the calibration figure draws, per task.

    Args:
        budget_rows: Rows of :func:`budget_table` (one cell per task and method).
        methods: Methods to draw (their Table 2 cells). ``None``: MAP, temperature scaling and the
            ``n_best`` other methods with the lowest median test NLL in Table 2.
        n_best: Number of Bayesian methods drawn when ``methods`` is ``None``.

    Returns:
        (task, method, size) triples, baselines first.
    """
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
                (r for r in rows if r["method"] not in BASELINES), key=lambda r: r["nll"]
            )
            chosen = base + others[:n_best]
        cells += [(task, r["method"], r["size"]) for r in chosen]
    return cells
