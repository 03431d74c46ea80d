"""Summaries of a results folder: median / IQR tables (markdown, CSV) and figures (PNG).

:func:`write_report` (``glue-bench report``) writes everything; the tables are computed in
:mod:`partialbayes.glue_bench.tables` and the figures drawn in :mod:`partialbayes.glue_bench.figures`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from partialbayes.glue_bench.figures import memory_plot, pyplot, save_figure
from partialbayes.glue_bench.store import iter_records
from partialbayes.glue_bench.tables import BUDGET_TOLERANCE, size_key, write_csv

METRICS = ("accuracy", "nll", "ece", "brier")
COLUMNS = (*METRICS, "val_nll", "percent_stochastic", "floats", "fit_seconds", "predict_seconds")
UCI_COLUMNS = ("nll", "rmse", "percent_stochastic", "floats", "fit_seconds", "predict_seconds")

__all__ = [
    "COLUMNS",
    "METRICS",
    "UCI_COLUMNS",
    "markdown_table",
    "memory_plot",
    "ramping_plot",
    "short_table",
    "summarise",
    "write_csv",
    "write_report",
]


def summarise(
    records: Iterable[dict[str, Any]], columns: Sequence[str] = COLUMNS
) -> list[dict[str, Any]]:
    """Median, interquartile range, mean and standard error over splits for each (task, method, size).

    Args:
        records: Results records.
        columns: Numeric record fields to summarise; a field missing (or ``None``) in some record of a group
            is left out of that group's row.

    Returns:
        One row per (task, method, size) with ``n_splits`` and, for every column, ``<col>`` (median),
        ``<col>_q25``, ``<col>_q75`` (``numpy.percentile``, linear interpolation), ``<col>_mean`` and
        ``<col>_se`` (sample standard deviation / √n; NaN for one split); sorted by task, method, size.
        Laplace cells also get ``prior_edge_splits`` (how many splits tuned the prior precision to an end
        of its grid) and ``prior_edge`` (which ends: ``"lowest"``, ``"highest"``, both, or ``""``).
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"], str(r["size"]))].append(r)
    rows = []
    for (task, method, size), recs in groups.items():
        row: dict[str, Any] = {"task": task, "method": method, "size": size, "n_splits": len(recs)}
        for col in columns:
            if not all(r.get(col) is not None for r in recs):
                continue
            values = np.array([float(r[col]) for r in recs])
            q25, med, q75 = np.percentile(values, [25, 50, 75])
            row[col], row[f"{col}_q25"], row[f"{col}_q75"] = float(med), float(q25), float(q75)
            row[f"{col}_mean"] = float(values.mean())
            row[f"{col}_se"] = (
                float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            )
        edges = [
            (r.get("extra") or {}).get("prior_at_grid_edge")
            for r in recs
            if "prior_at_grid_edge" in (r.get("extra") or {})
        ]
        if edges:
            row["prior_edge_splits"] = sum(e is not None for e in edges)
            row["prior_edge"] = ",".join(sorted({e for e in edges if e is not None}))
        rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["method"], size_key(r["size"])))
    return rows


def _fmt(row: dict[str, Any], col: str) -> str:
    if col not in row:
        return "–"
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


def ramping_plot(
    rows: Sequence[dict[str, Any]], task: str, path: Path, metric: str = "nll"
) -> bool:
    """NLL (or ``metric``) against percent stochastic for every method of ``task`` (Figs. 2, 3).

    Single-size methods with nothing stochastic (MAP, temperature) are drawn as horizontal lines. Medians
    with IQR bands.

    Returns:
        Whether a figure was written (``False`` when ``task`` has no rows).
    """
    mine = [r for r in rows if r["task"] == task and metric in r]
    if not mine:
        return False
    plt = pyplot()
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
    save_figure(fig, path)
    return True


def _records(results: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(GLUE records, UCI records) of a results folder; UCI ones also from ``<results>/uci``."""
    recs = list(iter_records(results))
    if (results / "uci" / "records").is_dir():
        recs += list(iter_records(results / "uci"))
    uci = [r for r in recs if "rmse" in r]
    glue = [r for r in recs if "rmse" not in r]
    return glue, uci


def _section(title: str, body: str) -> str:
    return f"## {title}\n\n{body}\n"


def _num(value: float, digits: int = 3) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _rank_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| task | family | modules | strategy | rank | tasks | splits | strategies | "
        "NLL (median) | mean split rank |"
    )
    lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['family']} | {r['modules']} | {r['strategy']} | "
            f"{_num(r['rank'], 1)} | {r['n_tasks']} | {r['n_splits']} | {r['n_strategies']} | "
            f"{_num(r['nll_median'])} | {_num(r['split_rank'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def _mean_se(row: dict[str, Any], col: str) -> str:
    if f"{col}_mean" not in row:
        return "–"
    se = row[f"{col}_se"]
    return f"{row[f'{col}_mean']:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def budget_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Table 2 as markdown: mean ± standard error over splits (the paper's), median [IQR] as extras."""
    head = (
        "| task | method | size | splits | % stoch. | val NLL | NLL | ECE | accuracy | "
        "NLL median [IQR] | ECE median [IQR] | rule | prior at grid edge |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        edge = (
            f"{r['prior_edge']} in {r['prior_edge_splits']}/{r['n_splits']}"
            if r.get("prior_edge_splits")
            else ""
        )
        lines.append(
            f"| {r['task']} | {r['method']} | {r['size']} | {r['n_splits']} | "
            f"{r['percent_stochastic']:.3g} | {_mean_se(r, 'val_nll')} | {_mean_se(r, 'nll')} | "
            f"{_mean_se(r, 'ece')} | {_mean_se(r, 'accuracy')} | {_fmt(r, 'nll')} | "
            f"{_fmt(r, 'ece')} | {r['rule']} | {edge} |"
        )
    return "\n".join(lines) + "\n"


def edge_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The cells whose tuned prior precision sat at an end of its grid in some split."""
    lines = ["| task | method | size | splits at the edge | which end |", "|---|---|---|---:|---|"]
    for r in rows:
        if r.get("prior_edge_splits"):
            lines.append(
                f"| {r['task']} | {r['method']} | {r['size']} | "
                f"{r['prior_edge_splits']}/{r['n_splits']} | {r['prior_edge']} |"
            )
    return "\n".join(lines) + "\n"


def write_report(
    results: str | Path,
    out: str | Path | None = None,
    budget: float = 10.0,
    calibration_methods: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
    budget_tolerance: float = BUDGET_TOLERANCE,
) -> dict[str, Any]:
    """Write every table and figure of a results folder (PNG, markdown, CSV; each file atomically).

    Outputs (in ``out``; a figure or table whose records are missing is skipped with its reason):

    * ``report.md``: all tables below in one markdown file (printed by ``glue-bench report``).
    * ``summary.md`` / ``.csv``: every (task, method, size) cell, median and [q25, q75] over splits.
    * ``table1_map.md`` / ``.csv``: the MAP network per task (the paper's Table 1).
    * ``table2_budget.md`` / ``.csv``: per task and method the level chosen by validation NLL among those
      within ``budget`` % stochastic (:func:`partialbayes.glue_bench.tables.budget_table`; the paper's
      Table 2), mean ± standard error over splits.
    * ``prior_edges.md``: the cells whose tuned prior precision sat at an end of its grid.
    * ``ranks.md`` / ``.csv``, ``<task>_ranks.png``, ``all_ranks.png``: mean rank by NLL of the module
      strategies against the module count (:func:`~partialbayes.glue_bench.tables.strategy_ranks`; Fig. 4).
    * ``<task>_ramping_nll.png``: NLL against percent stochastic (Figs. 2, 3).
    * ``<task>_memory_nll.png``, ``<task>_memory_ece.png``: NLL and ECE against floats stored (Fig. 5).
    * ``calibration.csv``, ``<task>_calibration.png``: reliability diagrams of MAP, temperature scaling and
      selected methods at their Table 2 cell (:func:`~partialbayes.glue_bench.tables.calibration_cells`;
      Fig. 6).
    * ``uci_summary.md`` / ``.csv``, ``uci_<dataset>_selection.png``: UCI cells and norm- vs variance-based
      subnetwork selection, NLL and RMSE against percent stochastic (Figs. 9, 10).

    Args:
        results: The results folder (GLUE records under ``records/``, UCI records under ``uci/records/``).
        out: Output folder (default ``<results>/report``).
        budget: Stochastic budget of Table 2, in percent.
        budget_tolerance: Relative slack of the budget ("≈ 10 %"), see ``tables.budget_table``.
        calibration_methods: Methods of the calibration figure (default: see ``calibration_cells``).
        log: Called with one line per written file and per skipped output.

    Returns:
        ``{"rows": GLUE summary rows, "markdown": report.md text, "files": [written paths],
        "skipped": [reasons]}``.

    Raises:
        FileNotFoundError: No records under ``results``.
    """
    from partialbayes.glue_bench import figures, tables

    results = Path(results)
    glue, uci = _records(results)
    if not glue and not uci:
        raise FileNotFoundError(
            f"no result records under {results / 'records'} or {results / 'uci' / 'records'}"
        )
    out = Path(out) if out is not None else results / "report"
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    skipped: list[str] = []
    say = log or (lambda _: None)

    def wrote(path: Path) -> None:
        files.append(path)
        say(f"wrote {path}")

    def skip(what: str, why: str) -> None:
        skipped.append(f"{what}: {why}")
        say(f"skipped {what}: {why}")

    def text(name: str, body: str) -> None:
        tables.atomic_write_text(out / name, body)
        wrote(out / name)

    def csv_(name: str, rows: Sequence[dict[str, Any]]) -> None:
        tables.write_csv(rows, out / name)
        wrote(out / name)

    parts = [
        "# glue-bench report\n",
        f"Results: `{results}`. Medians over splits, [q25, q75] in brackets.\n",
    ]
    rows = summarise(glue)
    if rows:
        tasks = sorted({r["task"] for r in rows})
        summary_md = markdown_table(rows)
        text("summary.md", summary_md)
        csv_("summary.csv", rows)
        table1 = [r for r in rows if r["method"] == "map"]
        if table1:
            md = markdown_table(table1, METRICS)
            text("table1_map.md", md)
            csv_("table1_map.csv", table1)
            parts.append(_section("Table 1: MAP", md))
        else:
            skip("table1_map", "no 'map' records")
        table2 = tables.budget_table(rows, budget, budget_tolerance)
        md = budget_markdown(table2)
        text("table2_budget.md", md)
        csv_("table2_budget.csv", table2)
        limit = budget * (1 + budget_tolerance)
        parts.append(
            _section(
                f"Table 2: ≈ {budget:g} % stochastic budget",
                "Per task and method, among the sizes whose median percent stochastic is at most "
                f"{limit:.3g} % ({budget:g} % plus {100 * budget_tolerance:g} % slack for '≈'), the one "
                "with the lowest mean validation NLL over splits (rule `val_nll`; the paper's §5.4); "
                "methods with one size contribute it (rule `single`). Test metrics: mean ± standard "
                "error over splits, as the paper's Table 2; median [q25, q75] as extras.\n\n" + md,
            )
        )
        flagged = [r for r in rows if r.get("prior_edge_splits")]
        if flagged:
            md = edge_markdown(flagged)
            text("prior_edges.md", md)
            parts.append(
                _section(
                    "Prior precision at the grid's edge",
                    "Cells whose validation-tuned (or evidence-tuned) prior precision was the smallest or "
                    "largest value of the grid in some split: the optimum may lie beyond the grid "
                    "(`Settings.prior_grid`, `--prior-grid`). At the highest prior the posterior is "
                    "closest to the MAP.\n\n" + md,
                )
            )
        ranks = tables.strategy_ranks(glue)
        if ranks:
            md = _rank_markdown(ranks)
            text("ranks.md", md)
            csv_("ranks.csv", ranks)
            parts.append(
                _section(
                    "Module-strategy ranks (Fig. 4)",
                    "As the paper's Fig. 4: per task and module count, the strategies ranked by their "
                    "median test NLL over splits (0 = best, ties share the mean rank); `all`: the median "
                    "of a strategy's per-task ranks. Extra: the mean over splits of the per-split ranks "
                    "(splits where every strategy of the group has a record).\n\n" + md,
                )
            )
            for task in [*tasks, "all"]:
                path = out / f"{task}_ranks.png"
                if figures.rank_plot(ranks, task, path):
                    wrote(path)
        else:
            skip(
                "ranks",
                "needs module-ramping records of at least two strategies of one family "
                "(kfac-random, kfac-max-mlp, kfac-min-mlp, kfac-max-attn, kfac-min-attn, swag-random, ...)",
            )
        for task in tasks:
            for name, fn, metric, why in (
                ("ramping_nll", ramping_plot, "nll", "no cells with an NLL"),
                ("memory_nll", memory_plot, "nll", "no posterior stores floats (MAP only)"),
                ("memory_ece", memory_plot, "ece", "no posterior stores floats (MAP only)"),
            ):
                path = out / f"{task}_{name}.png"
                if fn(rows, task, path, metric):
                    wrote(path)
                else:
                    skip(path.name, why)
        cells = tables.calibration_cells(table2, calibration_methods)
        curves = tables.calibration_curves(glue, cells)
        if curves:
            csv_("calibration.csv", curves)
            for task in tasks:
                path = out / f"{task}_calibration.png"
                if figures.calibration_plot(curves, task, path):
                    wrote(path)
                else:
                    skip(path.name, "no reliability bins for the chosen cells of this task")
        else:
            skip(
                "calibration",
                "no record of the chosen cells has reliability bins (records written before "
                "glue-bench stored them: rerun those cells in a fresh results folder)",
            )
        parts.append(_section("All cells", summary_md))
    else:
        skip("GLUE tables and figures", f"no GLUE records under {results / 'records'}")
    uci_rows = summarise(uci, UCI_COLUMNS)
    if uci_rows:
        md = markdown_table(uci_rows, UCI_COLUMNS)
        text("uci_summary.md", md)
        csv_("uci_summary.csv", uci_rows)
        parts.append(_section("UCI", md))
        for dataset in sorted({r["task"] for r in uci_rows}):
            path = out / f"uci_{dataset}_selection.png"
            if figures.uci_selection_plot(uci_rows, dataset, path):
                wrote(path)
            else:
                skip(
                    path.name,
                    "no subnet-norm / subnet-variance records (UCI methods of partialbayes.glue_bench.run_uci)",
                )
    else:
        skip("UCI tables and figures", f"no UCI records under {results / 'uci' / 'records'}")
    figs = [f.name for f in files if f.suffix == ".png"]
    parts.append(_section("Figures", "\n".join(f"* `{f}`" for f in figs) or "none"))
    if skipped:
        parts.append(_section("Skipped", "\n".join(f"* {s}" for s in skipped)))
    markdown = "\n".join(parts)
    text("report.md", markdown)
    return {
        "rows": rows,
        "markdown": markdown,
        "files": [str(f) for f in files],
        "skipped": skipped,
    }


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
