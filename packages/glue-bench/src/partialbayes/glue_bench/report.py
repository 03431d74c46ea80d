"""Summaries of a results folder: median / IQR tables (markdown, CSV) and figures (PNG).

:func:`write_report` (``glue-bench report``) writes everything; the tables are computed in
:mod:`partialbayes.glue_bench.tables` (which also renders them) and the figures drawn in
:mod:`partialbayes.glue_bench.figures`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partialbayes.glue_bench import figures, tables
from partialbayes.glue_bench.store import atomic_write, iter_records, unit_states
from partialbayes.glue_bench.tables import BUDGET_TOLERANCE, Column, col, markdown, size_key

logger = logging.getLogger(__name__)
METRICS = ("accuracy", "nll", "ece", "brier")
COLUMNS = (*METRICS, "val_nll", "percent_stochastic", "floats", "fit_seconds", "predict_seconds")
UCI_COLUMNS = ("nll", "rmse", "val_nll", "sigma", "prior_precision", *COLUMNS[5:8])
# Published results on the same 20 standard splits (test RMSE, its ±, test NLL, its ±; original units).
# PBP (Hernández-Lobato & Adams, 2015) and deep ensembles as printed in Lakshminarayanan et al. (2017),
# Table 1; MC dropout from Gal & Ghahramani (2016), Table 1, with standard errors as corrected in the
# authors' repository (yaringal/DropoutUncertaintyExps, commit a6259f1); its grid-search re-run (10x
# epochs, dropout rate and precision tuned on an 80/20 split of each training split) from the same
# repository's README (commit 6eb4497). See the how-to for their protocols.
PUBLISHED: dict[str, list[tuple[str, float, float, float, float]]] = {
    "boston": [
        ("PBP (2015)", 3.01, 0.18, 2.57, 0.09),
        ("MC dropout (2016)", 2.97, 0.19, 2.46, 0.06),
        ("MC dropout, grid search (2018)", 2.90, 0.18, 2.40, 0.04),
        ("Deep ensembles (2017)", 3.28, 1.00, 2.41, 0.25),
    ],
    "energy": [
        ("PBP (2015)", 1.80, 0.05, 2.04, 0.02),
        ("MC dropout (2016)", 1.66, 0.04, 1.99, 0.02),
        ("MC dropout, grid search (2018)", 0.54, 0.06, 1.21, 0.01),
        ("Deep ensembles (2017)", 2.09, 0.29, 1.38, 0.22),
    ],
    "yacht": [
        ("PBP (2015)", 1.02, 0.05, 1.63, 0.02),
        ("MC dropout (2016)", 1.11, 0.09, 1.55, 0.03),
        ("MC dropout, grid search (2018)", 0.67, 0.05, 1.25, 0.01),
        ("Deep ensembles (2017)", 1.58, 0.48, 1.18, 0.21),
    ],
}


def summarise(
    records: Iterable[dict[str, Any]], columns: Sequence[str] = COLUMNS
) -> list[dict[str, Any]]:
    """Median, IQR, mean and standard error over splits for each (task, method, size), sorted.

    Per column ``<col>``, ``<col>_q25``, ``<col>_q75``, ``<col>_mean``, ``<col>_se`` (NaN for one split), left out
    of a group where a record lacks it; Laplace cells also ``prior_edge_splits`` and ``prior_edge``.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"], str(r["size"]))].append(r)
    rows = []
    for (task, method, size), recs in groups.items():
        row: dict[str, Any] = {"task": task, "method": method, "size": size, "n_splits": len(recs)}
        for column in columns:
            if not all(r.get(column) is not None for r in recs):
                continue
            values = np.array([float(r[column]) for r in recs])
            q25, med, q75 = (float(v) for v in np.percentile(values, [25, 50, 75]))
            row[column], row[f"{column}_q25"], row[f"{column}_q75"] = med, q25, q75
            row[f"{column}_mean"] = float(values.mean())
            se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else math.nan
            row[f"{column}_se"] = float(se)
        extras = [r.get("extra") or {} for r in recs]
        if edges := [e["prior_at_grid_edge"] for e in extras if "prior_at_grid_edge" in e]:
            row["prior_edge_splits"] = sum(e is not None for e in edges)
            row["prior_edge"] = ",".join(sorted({e for e in edges if e is not None}))
        rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["method"], size_key(r["size"])))
    return rows


# ------------------------------------------------------------------------------------------ cells
def _median_iqr(row: dict[str, Any], column: str) -> str:
    """``0.500 [0.400, 0.600]`` (median and interquartile range over splits; the median alone for one)."""
    if column not in row:
        return "–"
    value = row[column]
    if column == "floats":
        return f"{value:,.0f}"
    if row["n_splits"] > 1:
        return f"{value:.3f} [{row[f'{column}_q25']:.3f}, {row[f'{column}_q75']:.3f}]"
    return f"{value:.3f}"


def _mean_se(row: dict[str, Any], column: str) -> str:
    """``0.600 ± 0.058`` (mean and standard error over splits)."""
    if f"{column}_mean" not in row:
        return "–"
    se = row[f"{column}_se"]
    return f"{row[f'{column}_mean']:.3f}" + ("" if math.isnan(se) else f" ± {se:.3f}")


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _edge(row: dict[str, Any]) -> str:
    if not row.get("prior_edge_splits"):
        return ""
    return f"{row['prior_edge']} in {row['prior_edge_splits']}/{row['n_splits']}"


CELL = [col("task", "task"), col("method", "method"), col("size", "size")]


def _mean_col(head: str, column: str) -> Column:
    """A column of the mean ± standard error of ``column``."""
    return head, lambda r: _mean_se(r, column), "r"


def _iqr_col(head: str, column: str) -> Column:
    """A column of the median [IQR] of ``column``."""
    return head, lambda r: _median_iqr(r, column), "r"


def summary_columns(columns: Sequence[str] = COLUMNS) -> list[Column]:
    """The columns of the summary tables: the cell, the number of splits, median [IQR] of ``columns``."""
    stats = [(c, lambda r, c=c: _median_iqr(r, c), "l") for c in columns]
    return [*CELL, col("splits", "n_splits"), *stats]


BUDGET_COLUMNS: list[Column] = [
    *CELL,
    col("splits", "n_splits", align="r"),
    col("% stoch.", "percent_stochastic", "{:.3g}", "r"),
    _mean_col("val NLL", "val_nll"),
    _mean_col("NLL", "nll"),
    _mean_col("ECE", "ece"),
    _mean_col("accuracy", "accuracy"),
    _iqr_col("NLL median [IQR]", "nll"),
    _iqr_col("ECE median [IQR]", "ece"),
    col("rule", "rule"),
    ("prior at grid edge", _edge, "l"),
]
EDGE_COLUMNS: list[Column] = [
    *CELL,
    ("splits at the edge", lambda r: f"{r['prior_edge_splits']}/{r['n_splits']}", "r"),
    col("which end", "prior_edge"),
]
RANK_COLUMNS: list[Column] = [
    col("task", "task"),
    col("family", "family"),
    col("modules", "modules", align="r"),
    col("strategy", "strategy"),
    ("rank", lambda r: _num(r["rank"], 1), "r"),
    col("tasks", "n_tasks", align="r"),
    col("splits", "n_splits", align="r"),
    col("strategies", "n_strategies", align="r"),
    ("NLL (median)", lambda r: _num(r["nll_median"]), "r"),
    ("mean split rank", lambda r: _num(r["split_rank"], 2), "r"),
]
SHORT_COLUMNS: list[Column] = [
    col("method", "method"),
    col("size", "size"),
    col("% stoch.", "percent_stochastic", "{:.3g}", "r"),
    col("accuracy", "accuracy", "{:.3f}", "r"),
    col("NLL", "nll", "{:.3f}", "r"),
    col("ECE", "ece", "{:.3f}", "r"),
    col("floats", "floats", "{:,.0f}", "r"),
]


def short_table(rows: Sequence[dict[str, Any]]) -> str:
    """A compact markdown table (accuracy, NLL, ECE, floats, % stochastic) for the terminal."""
    return markdown(rows, SHORT_COLUMNS)


# ------------------------------------------------------------------------------------------ the report
@dataclass
class _Report:
    """The outputs of one :func:`write_report` call, written one by one (each atomically)."""

    out: Path
    files: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    def wrote(self, path: Path) -> None:
        self.files.append(path)
        logger.debug(f"wrote {path}")

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        logger.debug(f"skipped {what}: {why}")

    def text(self, name: str, body: str) -> None:
        self.wrote(atomic_write(self.out / name, body))

    def csv(self, name: str, rows: Sequence[dict[str, Any]]) -> None:
        tables.write_csv(rows, self.out / name)
        self.wrote(self.out / name)

    def table(self, name: str, rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
        """``<name>.md`` and ``<name>.csv`` of ``rows``; returns the markdown."""
        self.text(f"{name}.md", md := markdown(rows, columns))
        self.csv(f"{name}.csv", rows)
        return md

    def section(self, title: str, body: str) -> None:
        self.parts.append(f"## {title}\n\n{body}\n")

    def figure(self, drawn: bool, path: Path, why: str | None = None) -> None:
        """Count the figure at ``path`` if it was drawn; skip it with ``why`` if one is given."""
        if drawn:
            self.wrote(path)
        elif why is not None:
            self.skip(path.name, why)


def _records(results: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(GLUE records, UCI records) of a results folder; UCI ones also from ``<results>/uci``."""
    recs = [*iter_records(results), *iter_records(results / "uci")]  # a missing folder holds none
    return [r for r in recs if "rmse" not in r], [r for r in recs if "rmse" in r]


def write_report(
    results: str | Path,
    out: str | Path | None = None,
    budget: float = 10.0,
    calibration_methods: Sequence[str] | None = None,
    budget_tolerance: float = BUDGET_TOLERANCE,
) -> dict[str, Any]:
    """Write every table and figure of a results folder (PNG, markdown, CSV; each file atomically).

    ``report.md`` (all tables in one page), ``summary`` (every cell: median [q25, q75] over splits),
    ``table1_map`` (Table 1), ``table2_budget`` (Table 2, :func:`~partialbayes.glue_bench.tables.budget_table`),
    ``prior_edges.md``, ``ranks`` and ``<task>_ranks.png`` (Fig. 4), ``<task>_ramping_nll.png`` (Figs. 2,
    3), ``<task>_memory_nll.png`` / ``_ece.png`` (Fig. 5), ``calibration.csv`` and
    ``<task>_calibration.png`` (Fig. 6), ``uci_summary`` and ``uci_<dataset>_selection.png`` (Figs. 9,
    10), ``units`` (each unit's state: done, running, or partial with the epoch its fine-tuning reached,
    ``store.unit_states``): tables as ``.md`` and ``.csv``; the how-to lists what each holds. An output
    whose records are missing is skipped with its reason; each written file and skip is logged (DEBUG).

    Args:
        results: The results folder (GLUE records under ``records/``, UCI records under ``uci/records/``).
        out: Output folder (default ``<results>/report``).
        budget: Stochastic budget of Table 2, in percent.
        budget_tolerance: Relative slack of the budget ("≈ 10 %"), see ``tables.budget_table``.
        calibration_methods: Methods of the calibration figure (default: see ``calibration_cells``).

    Returns:
        ``{"rows": GLUE summary rows, "markdown": report.md text, "files": [written paths],
        "skipped": [reasons]}``.

    Raises:
        FileNotFoundError: No records under ``results``.
    """
    results = Path(results)
    glue, uci = _records(results)
    if not glue and not uci:
        raise FileNotFoundError(
            f"no result records under {results / 'records'} or {results / 'uci' / 'records'}"
        )
    report = _Report(Path(out) if out is not None else results / "report")
    report.parts += [
        "# glue-bench report\n",
        f"Results: `{results}`. Medians over splits, [q25, q75] in brackets.\n",
    ]
    rows = summarise(glue)
    if rows:
        _glue_outputs(report, rows, glue, budget, budget_tolerance, calibration_methods)
    else:
        report.skip("GLUE tables and figures", f"no GLUE records under {results / 'records'}")
    _uci_outputs(report, uci, results)
    units = unit_states(results)
    if units:
        names = ("task", "split", "state", "map", "records")
        report.section("Units", report.table("units", units, [col(n, n) for n in names]))
    figs = [f.name for f in report.files if f.suffix == ".png"]
    report.section("Figures", "\n".join(f"* `{f}`" for f in figs) or "none")
    if report.skipped:
        report.section("Skipped", "\n".join(f"* {s}" for s in report.skipped))
    report.text("report.md", text := "\n".join(report.parts))
    files = [str(f) for f in report.files]
    return {"rows": rows, "markdown": text, "files": files, "skipped": report.skipped}


def _glue_outputs(
    report: _Report,
    rows: list[dict[str, Any]],
    records: list[dict[str, Any]],
    budget: float,
    tolerance: float,
    calibration_methods: Sequence[str] | None,
) -> None:
    """The GLUE tables (summary, Tables 1 and 2, prior edges, ranks) and figures of the report."""
    tasks = sorted({r["task"] for r in rows})
    summary = report.table("summary", rows, summary_columns())
    table1 = [r for r in rows if r["method"] == "map"]
    if table1:
        report.section("Table 1: MAP", report.table("table1_map", table1, summary_columns(METRICS)))
    else:
        report.skip("table1_map", "no 'map' records")
    table2 = tables.budget_table(rows, budget, tolerance)
    md = report.table("table2_budget", table2, BUDGET_COLUMNS)
    report.section(
        f"Table 2: ≈ {budget:g} % stochastic budget",
        "Per task and method, among the sizes whose median percent stochastic is at most "
        f"{budget * (1 + tolerance):.3g} % ({budget:g} % plus {100 * tolerance:g} % slack for '≈'), the "
        "one with the lowest mean validation NLL over splits (rule `val_nll`; the paper's §5.4); methods "
        "with one size contribute it (rule `single`). Test metrics: mean ± standard error over splits, as "
        "the paper's Table 2; median [q25, q75] as extras.\n\n" + md,
    )
    flagged = [r for r in rows if r.get("prior_edge_splits")]
    if flagged:
        md = markdown(flagged, EDGE_COLUMNS)
        report.text("prior_edges.md", md)
        report.section(
            "Prior precision at the grid's edge",
            "Cells whose validation-tuned (or evidence-tuned) prior precision was the smallest or largest "
            "value of the grid in some split: the optimum may lie beyond the grid (`Settings.prior_grid`, "
            "`--prior-grid`). At the highest prior the posterior is closest to the MAP.\n\n" + md,
        )
    ranks = tables.strategy_ranks(records)
    if ranks:
        report.section(
            "Module-strategy ranks (Fig. 4)",
            "As the paper's Fig. 4: per task and module count, the strategies ranked by their median test "
            "NLL over splits (0 = best, ties share the mean rank); `all`: the median of a strategy's "
            "per-task ranks. Extra: the mean over splits of the per-split ranks (splits where every "
            "strategy of the group has a record).\n\n" + report.table("ranks", ranks, RANK_COLUMNS),
        )
        for task in [*tasks, "all"]:
            path = report.out / f"{task}_ranks.png"
            report.figure(figures.rank_plot(ranks, task, path), path)
    else:
        report.skip(
            "ranks",
            "needs module-ramping records of at least two strategies of one family "
            "(kfac-random, kfac-max-mlp, kfac-min-mlp, kfac-max-attn, kfac-min-attn, swag-random, ...)",
        )
    memory_why = "no posterior stores floats (MAP only)"
    for task in tasks:
        for name, draw, metric, why in (
            ("ramping_nll", figures.ramping_plot, "nll", "no cells with an NLL"),
            ("memory_nll", figures.memory_plot, "nll", memory_why),
            ("memory_ece", figures.memory_plot, "ece", memory_why),
        ):
            path = report.out / f"{task}_{name}.png"
            report.figure(draw(rows, task, path, metric), path, why)
    curves = tables.calibration_curves(
        records, tables.calibration_cells(table2, calibration_methods)
    )
    if not curves:
        report.skip(
            "calibration",
            "no record of the chosen cells has reliability bins (records written before "
            "glue-bench stored them: rerun those cells in a fresh results folder)",
        )
    else:
        report.csv("calibration.csv", curves)
        for task in tasks:
            path = report.out / f"{task}_calibration.png"
            why = "no reliability bins for the chosen cells of this task"
            report.figure(figures.calibration_plot(curves, task, path), path, why)
    report.section("All cells", summary)


UCI_SUMMARY_COLUMNS: list[Column] = [
    *CELL,
    col("splits", "n_splits", align="r"),
    col("% stoch.", "percent_stochastic", "{:.3g}", "r"),
    _mean_col("test NLL", "nll"),
    _mean_col("test RMSE", "rmse"),
    _iqr_col("NLL median [IQR]", "nll"),
    _mean_col("val NLL", "val_nll"),
    ("σ median", lambda r: _num(r.get("sigma")), "r"),
    col("σ by", "sigma_rule"),
    (
        "prior median",
        lambda r: f"{r['prior_precision']:.3g}" if "prior_precision" in r else "",
        "r",
    ),
    col("prior by", "prior_rule"),
    ("prior at grid edge", _edge, "l"),
]
PUBLISHED_COLUMNS: list[Column] = [
    col("dataset", "task"),
    col("method", "method"),
    col("splits", "n_splits", align="r"),
    _mean_col("test NLL", "nll"),
    _mean_col("test RMSE", "rmse"),
    col("chosen by", "rule"),
]
LAPLACE = ("last-layer", "kfac-", "diag-", "subnet-")


def _uci_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summary rows of UCI records, with σ / prior (from ``extra``) and how they were chosen."""
    by_cell = defaultdict(list)
    for r in records:
        by_cell[(r["task"], r["method"], str(r["size"]))].append(r.get("extra") or {})
    chosen = ("sigma", "prior_precision")
    flat = [{**r, **{k: (r.get("extra") or {}).get(k) for k in chosen}} for r in records]
    rows = summarise(flat, UCI_COLUMNS)
    for row in rows:
        extras = by_cell[(row["task"], row["method"], row["size"])]
        for rule in ("sigma_rule", "prior_rule"):
            counts = Counter(e[rule] for e in extras if e.get(rule))
            n = len(extras)
            row[rule] = ", ".join(
                k if c == n else f"{k} {c}/{n}" for k, c in sorted(counts.items())
            )
    return rows


def published_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dataset: the :data:`PUBLISHED` baselines beside ours.

    Ours: the single-size cells, and the Laplace and SWAG cells with the lowest mean validation NLL among those
    run on the most splits.
    """
    out: list[dict[str, Any]] = []
    for task in sorted({r["task"] for r in rows}):
        for name, rmse, rmse_se, nll, nll_se in PUBLISHED.get(task, []):
            pub = {"task": task, "method": name, "n_splits": 20, "rule": "published"}
            out.append(
                {**pub, "nll_mean": nll, "nll_se": nll_se, "rmse_mean": rmse, "rmse_se": rmse_se}
            )
        mine = [r for r in rows if r["task"] == task]
        single = [r for r in mine if r["size"] == "-"]
        out += [{**r, "method": f"ours: {r['method']}", "rule": "single cell"} for r in single]
        for family, prefixes in (("Laplace", LAPLACE), ("SWAG", ("swag-",))):
            cand = [r for r in mine if r["method"].startswith(prefixes) and "val_nll_mean" in r]
            most = max((r["n_splits"] for r in cand), default=0)
            cand = [r for r in cand if r["n_splits"] == most]  # means over the same splits only
            if cand:
                best = min(cand, key=lambda r: r["val_nll_mean"])
                name = f"ours: best {family} ({best['method']} {best['size']})"
                out.append({**best, "method": name, "rule": "lowest mean val NLL"})
    return out


def _uci_outputs(report: _Report, records: list[dict[str, Any]], results: Path) -> None:
    """The UCI summary, the table beside the published results and the ramp figures (Figs. 9, 10)."""
    rows = _uci_rows(records)
    if not rows:
        report.skip("UCI tables and figures", f"no UCI records under {results / 'uci' / 'records'}")
        return
    report.section(
        "UCI",
        "Test NLL and RMSE in original units: mean ± standard error over splits (the literature's "
        "convention), the median [IQR] as the paper plots; the noise σ (original units) and the Laplace "
        "prior precision as chosen, with the rule that chose them.\n\n"
        + report.table("uci_summary", rows, UCI_SUMMARY_COLUMNS),
    )
    report.section(
        "UCI beside published results",
        "Published baselines on the same 20 splits (see the how-to for their protocols and sources), and "
        "ours; the best Laplace / SWAG cell is the one with the lowest mean validation NLL.\n\n"
        + report.table("uci_published", published_table(rows), PUBLISHED_COLUMNS),
    )
    figs = {
        "selection": (
            ("subnet-norm", "subnet-variance"),
            "norm- vs variance-based subnetwork Laplace (Fig. 10)",
        ),
        "ramp": (
            ("subnet-norm", "swag-l1"),
            "Laplace and SWAG on the p % largest weights (Fig. 9)",
        ),
    }
    for dataset in sorted({r["task"] for r in rows}):
        for name, (methods, title) in figs.items():
            path = report.out / f"uci_{dataset}_{name}.png"
            drawn = figures.uci_selection_plot(rows, dataset, path, methods, title=title)
            report.figure(drawn, path, f"no {' / '.join(methods)} records")
