"""The report's figures (matplotlib, Agg backend): ramping, ranks, calibration curves, memory, UCI selection.

Each function draws plain rows (``tables``, ``report.summarise``) into one PNG, written atomically, and
returns whether it drew anything (``False``: no rows for that task).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partialbayes.glue_bench.store import atomic_write
from partialbayes.predictive.internal import check_int


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay ``fig`` out, save it as PNG at ``path`` atomically and close it."""
    try:
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        pyplot().close(fig)


def _band(ax: Any, x: list[float], rows: list[dict[str, Any]], metric: str, line: Any) -> None:
    low, high = [r[f"{metric}_q25"] for r in rows], [r[f"{metric}_q75"] for r in rows]
    ax.fill_between(x, low, high, alpha=0.2, color=line.get_color())


def _by(rows: Sequence[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r[key]].append(r)
    return out


def ramping_plot(
    rows: Sequence[dict[str, Any]], task: str, path: Path, metric: str = "nll"
) -> bool:
    """``metric`` against percent stochastic per method of ``task`` (Figs. 2, 3): medians, IQR bands, flat baselines."""
    mine = [r for r in rows if r["task"] == task and metric in r]
    if not mine:
        return False
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    flat_styles = iter(["--", ":", "-.", (0, (5, 1)), (0, (1, 3))])
    for method, rs in sorted(_by(mine, "method").items()):
        pts = sorted(rs, key=lambda r: r["percent_stochastic"])
        x = [max(r["percent_stochastic"], 1e-4) for r in pts]
        y = [r[metric] for r in pts]
        if len(pts) == 1 and pts[0]["percent_stochastic"] == 0:
            style = next(flat_styles, "--")
            ax.axhline(y[0], linestyle=style, linewidth=1.2, label=method, color="0.3")
            continue
        _band(ax, x, pts, metric, ax.plot(x, y, marker="o", label=method)[0])
    ax.set_xscale("log")
    ax.set_xlabel("percent of parameters stochastic")
    ax.set_ylabel(f"test {metric.upper() if metric in ('nll', 'ece') else metric}")
    splits = max(int(r.get("n_splits", 1)) for r in mine)
    over = "median, IQR over splits" if splits > 1 else "one split"
    ax.set_title(f"{task}: {metric} vs stochastic subset size ({over})")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def rank_plot(rank_rows: Sequence[dict[str, Any]], task: str, path: Path) -> bool:
    """Rank (``tables.strategy_ranks``, 0 = lowest NLL) of each module strategy against the module count, per family (Fig. 4)."""
    mine = [r for r in rank_rows if r["task"] == task]
    if not mine:
        return False
    families = _by(mine, "family")
    size = (5.2 * len(families), 3.8)
    fig, axes = pyplot().subplots(1, len(families), figsize=size, squeeze=False, sharey=True)
    for ax, family in zip(axes[0], sorted(families), strict=True):
        for strategy, rs in sorted(_by(families[family], "strategy").items()):
            rs.sort(key=lambda r: r["modules"])
            ax.plot([r["modules"] for r in rs], [r["rank"] for r in rs], marker="o", label=strategy)
        ax.set_xscale("log")
        counts = sorted({r["modules"] for r in families[family]})
        ax.set_xticks(counts, [str(k) for k in counts])
        ax.minorticks_off()
        ax.set_xlabel("number of stochastic modules")
        ax.set_title(f"{task}: {family.upper()} strategies")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("rank by median test NLL (0 = best)")
    axes[0][0].invert_yaxis()
    save_figure(fig, path)
    return True


def merged_bins(rows: Sequence[dict[str, Any]], n_bins: int) -> list[dict[str, float]]:
    """One curve's reliability bins, in confidence order, merged (count-weighted) into at most ``n_bins`` of about equal count."""
    check_int("n_bins", n_bins)
    ordered = sorted(rows, key=lambda r: r["confidence"])
    total = sum(r["count"] for r in ordered)
    out: list[dict[str, float]] = []
    group: list[dict[str, Any]] = []
    for r in ordered:
        group.append(r)
        done = sum(g["count"] for g in group) + sum(o["count"] for o in out)
        if done * n_bins >= total * (len(out) + 1) or r is ordered[-1]:
            n = sum(g["count"] for g in group)
            merged = {
                k: sum(g["count"] * g[k] for g in group) / n for k in ("confidence", "accuracy")
            }
            out.append({**merged, "count": n})
            group = []
    return out


def calibration_bins(examples: float, stored: int, per_bin: int = 40) -> int:
    """Bins of a reliability curve of ``examples`` test points: about ``per_bin`` each, 3 to ``stored``."""
    return max(1, min(stored, max(3, int(examples // per_bin))))


def calibration_plot(
    curve_rows: Sequence[dict[str, Any]], task: str, path: Path, per_bin: int = 40
) -> bool:
    """Reliability diagram of ``task`` (Fig. 6), one line per (method, size), with binomial errors and bin counts.

    The pooled bins are merged to about ``per_bin`` test examples per split, so the accuracies are not noise.
    """
    mine = [r for r in curve_rows if r["task"] == task]
    if not mine:
        return False
    panels = {"figsize": (5.6, 6.4), "sharex": True, "gridspec_kw": {"height_ratios": [3, 1]}}
    fig, (ax, ax_n) = pyplot().subplots(2, 1, **panels)
    curves: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in mine:
        curves[(r["method"], r["size"])].append(r)
    drawn: list[tuple[str, str, list[dict[str, float]], int]] = []
    for (method, size), rs in curves.items():
        splits = max(1, int(rs[0].get("n_splits", 1)))
        per_split = sum(r["count"] for r in rs) / splits
        bins = merged_bins(rs, calibration_bins(per_split, len(rs), per_bin))
        drawn.append((method, size, bins, splits))
    values = [v for _, _, bins, _ in drawn for b in bins for v in (b["confidence"], b["accuracy"])]
    lo = max(0.0, min(min(values), 0.5) - 0.05)
    ax.plot([lo, 1], [lo, 1], color="0.5", linestyle=":", linewidth=1, label="perfect calibration")
    n_examples = 0.0
    for method, size, bins, splits in drawn:
        label = method if size == "-" else f"{method} {size}"
        style = "--" if method in ("map", "temperature") else "-"
        x = [b["confidence"] for b in bins]
        acc = [b["accuracy"] for b in bins]
        err = [(a * (1 - a) / (b["count"] / splits)) ** 0.5 for a, b in zip(acc, bins, strict=True)]
        options = {"marker": "o", "markersize": 4, "linestyle": style, "capsize": 2, "label": label}
        line = ax.errorbar(x, acc, yerr=err, **options)[0]
        per_split = [b["count"] / splits for b in bins]
        ax_n.plot(x, per_split, marker="o", markersize=3, linestyle=style, color=line.get_color())
        n_examples = max(n_examples, sum(b["count"] for b in bins) / splits)
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.0)
    ax.set_ylabel("accuracy (± binomial s.e.)")
    title = (
        f"{task}: calibration, {n_examples:.0f} test examples, equal-mass bins of about {per_bin}"
    )
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax_n.set_ylim(bottom=0)
    ax_n.set_xlabel("confidence (mean per bin)")
    ax_n.set_ylabel("examples per bin")
    save_figure(fig, path)
    return True


def memory_plot(rows: Sequence[dict[str, Any]], task: str, path: Path, metric: str = "nll") -> bool:
    """``metric`` against the floats each posterior stores (Fig. 5), MAP and temperature scaling as baselines."""
    mine = [r for r in rows if r["task"] == task and metric in r]
    posteriors = [r for r in mine if r.get("floats", 0) > 0 and r["method"] != "temperature"]
    if not posteriors:
        return False
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    for method, rs in sorted(_by(posteriors, "method").items()):
        pts = sorted(rs, key=lambda r: r["floats"])
        ax.plot([r["floats"] for r in pts], [r[metric] for r in pts], marker="o", label=method)
    for method, style in (("map", "--"), ("temperature", ":")):
        if (base := next((r for r in mine if r["method"] == method), None)) is not None:
            label = f"{method} (no posterior)" if method == "map" else method
            ax.axhline(base[metric], color="0.25", linestyle=style, linewidth=1.2, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("floats stored by the posterior")
    ax.set_ylabel(f"test {metric.upper()} (median over splits)")
    ax.set_title(f"{task}: {metric.upper()} vs memory")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def is_constant(values: Sequence[float]) -> bool:
    """Whether ``values`` are all equal up to 1e-9 relative."""
    scale = max(max(abs(v) for v in values), 1e-12)
    return max(values) - min(values) <= 1e-9 * scale


def value_limits(values: Sequence[float], pad: float = 0.15) -> tuple[float, float]:
    """Y-limits that fit ``values`` with ``pad`` of their range on each side (± 1 % when all are equal)."""
    lo, hi = min(values), max(values)
    scale = max(abs(lo), abs(hi), 1e-12)
    if is_constant(values):
        return lo - 0.01 * scale, hi + 0.01 * scale
    return lo - pad * (hi - lo), hi + pad * (hi - lo)


def uci_selection_plot(
    rows: Sequence[dict[str, Any]],
    dataset: str,
    path: Path,
    methods: Sequence[str] = ("subnet-norm", "subnet-variance"),
    metrics: Sequence[str] = ("nll", "rmse"),
    title: str = "norm- vs variance-based selection",
) -> bool:
    """Percent-of-parameters ramps of ``methods`` on a UCI dataset (Figs. 9, 10), one panel per metric.

    Medians with IQR bands and the MAP as a line; the y-axis fits the medians (bands clipped), and a metric that
    is the same at every size is drawn on a ±1 % axis that says so.
    """
    mine = [r for r in rows if r["task"] == dataset]
    mine.sort(key=lambda r: r["percent_stochastic"])
    ramps = {m: rs for m in methods if (rs := [r for r in mine if r["method"] == m])}
    if not ramps:
        return False
    metrics = [k for k in metrics if any(k in r for rs in ramps.values() for r in rs)]
    fig, axes = pyplot().subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.8), squeeze=False)
    map_row = next((r for r in mine if r["method"] == "map"), None)
    for ax, metric in zip(axes[0], metrics, strict=True):
        shown = [r[metric] for rs in ramps.values() for r in rs if metric in r]
        if map_row is not None and metric in map_row:
            shown.append(map_row[metric])
        same = is_constant(shown)
        for method, rs in ramps.items():
            rs = [r for r in rs if metric in r]
            x = [r["percent_stochastic"] for r in rs]
            line = ax.plot(x, [r[metric] for r in rs], marker="o", label=method)[0]
            if not same:  # a constant metric's bands would only fill the panel
                _band(ax, x, rs, metric, line)
        if map_row is not None and metric in map_row:
            ax.axhline(map_row[metric], linestyle="--", color="0.3", linewidth=1.2, label="map")
        ax.set_ylim(*value_limits(shown))  # the medians decide the scale; wider bands are clipped
        if same:
            note = "the same at every size"
            any_row = next(r for rs in ramps.values() for r in rs if metric in r)
            if f"{metric}_q25" in any_row:
                note += f" (IQR over splits {any_row[metric + '_q25']:.3g}–{any_row[metric + '_q75']:.3g})"
            ax.text(0.5, 0.92, note, transform=ax.transAxes, ha="center", fontsize=8, color="0.3")
        ax.set_xscale("log")
        ax.set_xlabel("percent of parameters stochastic")
        ax.set_ylabel(f"test {metric.upper()}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{dataset}: {title} (median, IQR over splits)", fontsize=10)
    save_figure(fig, path)
    return True
