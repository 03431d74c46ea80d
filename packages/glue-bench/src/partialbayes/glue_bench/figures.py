"""The report's figures (matplotlib, Agg backend): strategy ranks, calibration curves, UCI selection.

Each function draws from plain rows (see :mod:`partialbayes.glue_bench.tables` and
:func:`partialbayes.glue_bench.report.summarise`), writes one PNG atomically and returns whether it drew
anything.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partialbayes.glue_bench.store import temp_path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> None:
    """Save ``fig`` as PNG at ``path`` through a unique temporary file and ``os.replace``, then close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    finally:
        pyplot().close(fig)
        if tmp.exists():
            tmp.unlink()


def rank_plot(rank_rows: Sequence[dict[str, Any]], task: str, path: Path) -> bool:
    """Rank of every module strategy against the number of modules (the paper's Fig. 4).

    One panel per family (KFAC, SWAG). Rank 0 is the lowest NLL; see
    :func:`partialbayes.glue_bench.tables.strategy_ranks` for the rule.

    Returns:
        Whether a figure was written (``False`` when ``task`` has no rank rows).
    """
    mine = [r for r in rank_rows if r["task"] == task]
    if not mine:
        return False
    plt = pyplot()
    families = sorted({r["family"] for r in mine})
    fig, axes = plt.subplots(
        1, len(families), figsize=(5.2 * len(families), 3.8), squeeze=False, sharey=True
    )
    for ax, family in zip(axes[0], families, strict=True):
        by_strategy: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in mine:
            if r["family"] == family:
                by_strategy[r["strategy"]].append(r)
        for strategy, rs in sorted(by_strategy.items()):
            rs.sort(key=lambda r: r["modules"])
            ax.plot([r["modules"] for r in rs], [r["rank"] for r in rs], marker="o", label=strategy)
        ax.set_xscale("log")
        counts = sorted({r["modules"] for r in mine if r["family"] == family})
        ax.set_xticks(counts, [str(k) for k in counts])
        ax.minorticks_off()
        ax.set_xlabel("number of stochastic modules")
        ax.set_title(f"{task}: {family.upper()} strategies")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("rank by median test NLL (0 = best)")
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    save_figure(fig, path)
    return True


def calibration_plot(curve_rows: Sequence[dict[str, Any]], task: str, path: Path) -> bool:
    """Reliability diagram of ``task`` (the paper's Fig. 6): accuracy against confidence per bin.

    One line per (method, size) of ``curve_rows``; the diagonal is perfect calibration.

    Returns:
        Whether a figure was written (``False`` when ``task`` has no curve rows).
    """
    mine = [r for r in curve_rows if r["task"] == task]
    if not mine:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    lo = min(min(r["confidence"], r["accuracy"]) for r in mine)
    lo = max(0.0, min(lo, 0.5) - 0.02)
    ax.plot([lo, 1], [lo, 1], color="0.5", linestyle=":", linewidth=1, label="perfect calibration")
    curves: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        curves[(r["method"], r["size"])].append(r)
    for (method, size), rs in curves.items():
        rs.sort(key=lambda r: r["bin"])
        label = method if size == "-" else f"{method} {size}"
        style = "--" if method in ("map", "temperature") else "-"
        ax.plot(
            [r["confidence"] for r in rs],
            [r["accuracy"] for r in rs],
            marker=".",
            linestyle=style,
            label=label,
        )
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.0)
    ax.set_xlabel("confidence (mean per equal-mass bin)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{task}: calibration, 20 equal-mass bins, pooled over splits", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    return True


def uci_selection_plot(
    rows: Sequence[dict[str, Any]],
    dataset: str,
    path: Path,
    methods: Sequence[str] = ("subnet-norm", "subnet-variance"),
    metrics: Sequence[str] = ("nll", "rmse"),
) -> bool:
    """Norm- vs variance-based subnetwork selection on a UCI dataset (the paper's Figs. 9, 10).

    One panel per metric (test NLL, RMSE) against percent stochastic: medians over splits with IQR bands,
    the MAP as a horizontal line when present.

    Args:
        rows: UCI summary rows (:func:`partialbayes.glue_bench.report.summarise`).
        dataset: UCI dataset name (the records' task).
        path: PNG path.
        methods: The ramping methods to compare.
        metrics: Record fields to draw (those missing from the rows are skipped).

    Returns:
        Whether a figure was written (``False`` when none of ``methods`` has rows for ``dataset``).
    """
    mine = [r for r in rows if r["task"] == dataset]
    ramps = {
        m: sorted((r for r in mine if r["method"] == m), key=lambda r: r["percent_stochastic"])
        for m in methods
    }
    ramps = {m: rs for m, rs in ramps.items() if rs}
    if not ramps:
        return False
    metrics = [k for k in metrics if any(k in r for rs in ramps.values() for r in rs)]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.8), squeeze=False)
    map_row = next((r for r in mine if r["method"] == "map"), None)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for method, rs in ramps.items():
            rs = [r for r in rs if metric in r]
            x = [r["percent_stochastic"] for r in rs]
            line = ax.plot(x, [r[metric] for r in rs], marker="o", label=method)[0]
            ax.fill_between(
                x,
                [r[f"{metric}_q25"] for r in rs],
                [r[f"{metric}_q75"] for r in rs],
                alpha=0.2,
                color=line.get_color(),
            )
        if map_row is not None and metric in map_row:
            ax.axhline(map_row[metric], linestyle="--", color="0.3", linewidth=1.2, label="map")
        ax.set_xscale("log")
        ax.set_xlabel("percent of parameters stochastic")
        ax.set_ylabel(f"test {metric.upper()}")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{dataset}: norm- vs variance-based selection (median, IQR over splits)", fontsize=10
    )
    fig.tight_layout()
    save_figure(fig, path)
    return True
