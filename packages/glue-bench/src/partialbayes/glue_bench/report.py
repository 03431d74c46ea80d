"""Summaries of a results folder: median / IQR tables (markdown, CSV) and ramping plots (PNG)."""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialbayes.glue_bench.store import iter_records

METRICS = ("accuracy", "nll", "ece", "brier")
COLUMNS = (*METRICS, "percent_stochastic", "floats", "fit_seconds", "predict_seconds")


def _size_key(size: str) -> tuple[int, float, str]:
    try:
        return (1, float(size), size)
    except ValueError:
        return (0, 0.0, size)


def summarise(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and interquartile range over splits for each (task, method, size).

    Returns:
        One row per (task, method, size) with ``n_splits`` and ``<col>``, ``<col>_q25``, ``<col>_q75``
        for every column of :data:`COLUMNS`; sorted by task, method, size.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"], r["size"])].append(r)
    rows = []
    for (task, method, size), recs in groups.items():
        row: dict[str, Any] = {"task": task, "method": method, "size": size, "n_splits": len(recs)}
        for col in COLUMNS:
            values = np.array([float(r[col]) for r in recs])
            q25, med, q75 = np.percentile(values, [25, 50, 75])
            row[col], row[f"{col}_q25"], row[f"{col}_q75"] = float(med), float(q25), float(q75)
        rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["method"], _size_key(r["size"])))
    return rows


def _fmt(row: dict[str, Any], col: str) -> str:
    value = row[col]
    if col == "floats":
        return f"{value:,.0f}"
    if row["n_splits"] > 1:
        return f"{value:.3f} [{row[f'{col}_q25']:.3f}, {row[f'{col}_q75']:.3f}]"
    return f"{value:.3f}"


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    """A markdown table: median over splits, and [q25, q75] when there are several splits."""
    head = ["task", "method", "size", "splits", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["task"], r["method"], r["size"], str(r["n_splits"])]
        cells += [_fmt(r, c) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Write the summary rows as CSV."""
    if not rows:
        path.write_text("")
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def ramping_plot(
    rows: Sequence[dict[str, Any]], task: str, path: Path, metric: str = "nll"
) -> bool:
    """NLL (or ``metric``) against percent stochastic for every method of ``task`` with several sizes.

    Single-size methods (MAP, temperature, ...) are drawn as horizontal lines. Medians with IQR bands.

    Returns:
        Whether a figure was written (``False`` when ``task`` has no rows).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == task]
    if not mine:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        by_method[r["method"]].append(r)
    flat_styles = iter(["--", ":", "-.", (0, (5, 1)), (0, (1, 3))])
    for method, rs in sorted(by_method.items()):
        pts = sorted(rs, key=lambda r: r["percent_stochastic"])
        x = [max(r["percent_stochastic"], 1e-4) for r in pts]
        y = [r[metric] for r in pts]
        if len(pts) == 1 and pts[0]["percent_stochastic"] == 0:
            style = next(flat_styles, "--")
            ax.axhline(y[0], linestyle=style, linewidth=1.2, label=method, color="0.3")
            continue
        line = ax.plot(x, y, marker="o", label=method)[0]
        ax.fill_between(
            x,
            [r[f"{metric}_q25"] for r in pts],
            [r[f"{metric}_q75"] for r in pts],
            alpha=0.2,
            color=line.get_color(),
        )
    ax.set_xscale("log")
    ax.set_xlabel("percent of parameters stochastic")
    ax.set_ylabel(f"test {metric.upper() if metric in ('nll', 'ece') else metric}")
    ax.set_title(f"{task}: {metric} vs stochastic subset size (median, IQR over splits)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def memory_plot(rows: Sequence[dict[str, Any]], task: str, path: Path, metric: str = "nll") -> bool:
    """``metric`` against the floats each posterior stores (the paper's Fig. 5), one point per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["task"] == task and r["floats"] > 0]
    if not mine:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        by_method[r["method"]].append(r)
    for method, rs in sorted(by_method.items()):
        pts = sorted(rs, key=lambda r: r["floats"])
        ax.plot([r["floats"] for r in pts], [r[metric] for r in pts], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("floats stored by the posterior")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(f"{task}: {metric} vs memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(results: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write ``summary.md``, ``summary.csv`` and per-task PNG plots for a results folder.

    Args:
        results: The results folder.
        out: Output folder (default ``<results>/report``).

    Returns:
        ``{"rows": summary rows, "markdown": text, "files": [written paths]}``.

    Raises:
        FileNotFoundError: No records under ``results``.
    """
    rows = summarise(iter_records(results))
    if not rows:
        raise FileNotFoundError(f"no result records under {Path(results) / 'records'}")
    out = Path(out) if out is not None else Path(results) / "report"
    out.mkdir(parents=True, exist_ok=True)
    text = markdown_table(rows)
    files = [out / "summary.md", out / "summary.csv"]
    files[0].write_text(text)
    write_csv(rows, files[1])
    for task in sorted({r["task"] for r in rows}):
        for kind, fn in (("ramping", ramping_plot), ("memory", memory_plot)):
            path = out / f"{task}_{kind}_nll.png"
            if fn(rows, task, path):
                files.append(path)
    return {"rows": rows, "markdown": text, "files": [str(f) for f in files]}


def short_table(rows: Sequence[dict[str, Any]]) -> str:
    """A compact markdown table (accuracy, NLL, ECE, floats, % stochastic) for the terminal."""
    head = "| method | size | % stoch. | accuracy | NLL | ECE | floats |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = r["percent_stochastic"]
        lines.append(
            f"| {r['method']} | {r['size']} | {pct:.3g} | {r['accuracy']:.3f} | {r['nll']:.3f} | "
            f"{r['ece']:.3f} | {r['floats']:,.0f} |"
        )
    return "\n".join(lines) + "\n"
