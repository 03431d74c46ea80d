"""The report's figures: bin merging, axis limits and what each figure draws (checked on the figure)."""

from __future__ import annotations

import pytest

from partialbayes.glue_bench import figures


@pytest.fixture
def drawn(monkeypatch):
    """The figures passed to save_figure, kept open instead of written."""
    kept = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path, dpi=120: kept.append(fig))
    yield kept
    for fig in kept:
        figures.pyplot().close(fig)


def test_merged_bins_by_hand():
    rows = [
        {"confidence": 0.6, "accuracy": 0.5, "count": 10},
        {"confidence": 0.7, "accuracy": 1.0, "count": 30},
        {"confidence": 0.8, "accuracy": 0.5, "count": 20},
        {"confidence": 0.9, "accuracy": 1.0, "count": 20},
    ]
    got = figures.merged_bins(list(reversed(rows)), 2)  # order of the rows does not matter
    assert [b["count"] for b in got] == [40, 40]
    assert got[0]["confidence"] == pytest.approx((0.6 * 10 + 0.7 * 30) / 40)
    assert got[0]["accuracy"] == pytest.approx((5 + 30) / 40)
    assert got[1]["accuracy"] == pytest.approx((10 + 20) / 40)
    (one,) = figures.merged_bins(rows, 1)
    assert one["count"] == 80
    assert one["accuracy"] == pytest.approx((5 + 30 + 10 + 20) / 80)
    assert figures.merged_bins(rows, 10) == [
        {"confidence": r["confidence"], "accuracy": r["accuracy"], "count": r["count"]}
        for r in rows
    ]
    with pytest.raises(ValueError, match="n_bins"):
        figures.merged_bins(rows, 0)


def test_calibration_bins_hold_about_per_bin_examples():
    assert figures.calibration_bins(277, 20) == 6  # RTE dev set: 6 bins of about 46
    assert figures.calibration_bins(872, 20) == 20  # SST-2 dev set: the 20 stored bins
    assert figures.calibration_bins(50, 20) == 3  # never fewer than 3 ...
    assert figures.calibration_bins(50, 2) == 2  # ... unless fewer are stored


def test_value_limits():
    assert figures.value_limits([1.0, 2.0], pad=0.1) == pytest.approx((0.9, 2.1))
    assert figures.value_limits([0.403, 0.403]) == pytest.approx((0.403 * 0.99, 0.403 * 1.01))
    assert figures.is_constant([0.403, 0.403 * (1 + 1e-12)])
    assert not figures.is_constant([0.403, 0.404])


def _curve(method, n_bins=20, per_bin=42, splits=3):
    return [
        {
            "task": "rte",
            "method": method,
            "size": "-",
            "bin": b,
            "confidence": 0.5 + 0.5 * (b + 0.5) / n_bins,
            "accuracy": 0.5 + 0.4 * (b + 0.5) / n_bins,
            "count": per_bin,
            "n_splits": splits,
        }
        for b in range(n_bins)
    ]


def test_calibration_plot_merges_bins_and_shows_counts(drawn, tmp_path):
    rows = _curve("map") + _curve("temperature")  # 280 test examples per split, 20 stored bins
    assert figures.calibration_plot(rows, "rte", tmp_path / "c.png")
    assert not figures.calibration_plot(rows, "sst2", tmp_path / "c.png")
    (fig,) = drawn
    top, counts = fig.axes
    curves = {c.get_label(): c.lines[0] for c in top.containers}  # one error-bar plot per curve
    assert {label: len(line.get_xdata()) for label, line in curves.items()} == {
        "map": 7,
        "temperature": 7,
    }
    per_bin = [list(line.get_ydata()) for line in counts.lines]
    assert per_bin
    assert all(sum(ys) == pytest.approx(280) for ys in per_bin)


def test_calibration_plot_writes_a_png(tmp_path):
    path = tmp_path / "rte_calibration.png"
    assert figures.calibration_plot(_curve("map"), "rte", path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_memory_plot_draws_the_map_baseline(drawn, tmp_path):
    rows = [
        {"task": "rte", "method": "map", "size": "-", "floats": 0, "nll": 0.69},
        {"task": "rte", "method": "temperature", "size": "-", "floats": 1, "nll": 0.66},
        {"task": "rte", "method": "kfac", "size": "4", "floats": 1e5, "nll": 0.65},
        {"task": "rte", "method": "kfac", "size": "8", "floats": 2e5, "nll": 0.64},
    ]
    assert figures.memory_plot(rows, "rte", tmp_path / "m.png")
    (fig,) = drawn
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines["map (no posterior)"] == [0.69, 0.69]
    assert lines["temperature"] == [0.66, 0.66]
    assert lines["kfac"] == [0.65, 0.64]
    assert not figures.memory_plot(
        rows[:2], "rte", tmp_path / "m.png"
    )  # no posterior stores floats


def test_uci_panel_is_scaled_to_the_medians(drawn, tmp_path):
    def row(method, pct, nll, rmse):
        return {
            "task": "yacht",
            "method": method,
            "size": str(pct),
            "percent_stochastic": pct,
            "nll": nll,
            "nll_q25": nll - 0.3,
            "nll_q75": nll + 0.3,
            "rmse": rmse,
            "rmse_q25": 0.355,
            "rmse_q75": 0.434,
        }

    rows = [
        row("map", 0, 0.74, 0.403),
        row("subnet-norm", 1, 0.38, 0.403),
        row("subnet-norm", 100, 0.2, 0.403),
        row("subnet-variance", 1, 0.74, 0.403),
        row("subnet-variance", 100, 0.2, 0.403),
    ]
    assert figures.uci_selection_plot(rows, "yacht", tmp_path / "u.png")
    (fig,) = drawn
    nll_ax, rmse_ax = fig.axes
    lo, hi = nll_ax.get_ylim()
    assert lo > 0.2 - 0.3
    assert hi < 0.74 + 0.3
    assert rmse_ax.get_ylim() == pytest.approx((0.403 * 0.99, 0.403 * 1.01))
    assert not rmse_ax.collections  # no bands for a metric that is the same everywhere
    assert any("the same at every size" in t.get_text() for t in rmse_ax.texts)
