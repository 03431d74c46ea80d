"""The quickstart's table order and the sentences that read its table, on hand-made records."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from partialbayes.glue_bench.quickstart import QUICKSTART_METHODS, order_rows, read_table


def rec(method: str, size: str, nll: float, ece: float, **kw: Any) -> dict[str, Any]:
    """A result record of split 0 of sst2 with the fields :func:`read_table` reads."""
    extra = kw.pop("extra", {})
    return {
        "task": "sst2",
        "split": 0,
        "method": method,
        "size": size,
        "nll": nll,
        "ece": ece,
        "val_nll": kw.pop("val_nll", nll),
        "floats": kw.pop("floats", 0),
        "percent_stochastic": kw.pop("percent_stochastic", 0.0),
        "extra": extra,
        **kw,
    }


def map_and_temperature(t: float = 1.8) -> list[dict[str, Any]]:
    return [
        rec("map", "-", 0.600, 0.120),
        rec("temperature", "-", 0.450, 0.040, floats=1, extra={"temperature": t}),
    ]


def test_improvement_is_read_with_its_size_memory_and_the_validation_chosen_level():
    records = [
        *map_and_temperature(),
        rec(
            "skfac",
            "1",
            0.500,
            0.060,
            val_nll=0.40,
            floats=5050,
            percent_stochastic=0.0129,
            extra={"prior_precision": 1.0, "prior_at_grid_edge": None},
        ),
        # better on the test set but worse on validation: must not be the level that is read
        rec("skfac", "6.8", 0.450, 0.030, val_nll=0.41, floats=184254, percent_stochastic=0.498),
        rec(
            "last-layer",
            "-",
            0.550,
            0.090,
            floats=593670,
            percent_stochastic=0.00713,
            extra={"prior_precision": 3.16, "prior_at_grid_edge": None},
        ),
    ]
    text = read_table(records)
    assert text.startswith("The MAP is over-confident: temperature scaling (T = 1.80)")
    assert "lowered the NLL by 0.150 (0.600 → 0.450) and lowered the ECE by 0.080" in text
    assert "S-KFAC at p = 1 (0.013 % of the weights, 5,050 floats)" in text
    assert "lowered the NLL by 0.100 (0.600 → 0.500) and lowered the ECE by 0.060" in text
    assert "lowest validation NLL" in text
    assert "p = 6.8" not in text
    assert "last-layer Laplace (0.0071 % of the weights, 593,670 floats) " in text
    assert "lowered the NLL by 0.050" in text
    assert "did not improve" not in text
    assert "grid" not in text
    assert 2 <= text.count(". ") + 1 <= 3


def test_no_improvement_is_said_plainly():
    records = [
        *map_and_temperature(t=1.05),
        rec("skfac", "1", 0.61, 0.125, extra={"prior_at_grid_edge": None}),
        rec("last-layer", "-", 0.6, 0.121),
    ]
    text = read_table(records)
    assert "S-KFAC at p = 1 (0 % of the weights, 0 floats) did not improve" in text
    assert "(NLL 0.610 vs 0.600, ECE 0.125 vs 0.120)" in text
    assert "last-layer Laplace (0 % of the weights, 0 floats) did not improve" in text
    assert "lowered" not in text.split(". ", 1)[1]


def test_mixed_change_says_which_way_each_metric_went():
    records = [*map_and_temperature(), rec("skfac", "1", 0.55, 0.13)]
    text = read_table(records)
    assert "lowered the NLL by 0.050 (0.600 → 0.550) and raised the ECE by 0.010" in text


@pytest.mark.parametrize(
    ("edge", "prior", "words"),
    [("highest", 1000.0, "so its posterior is nearly the MAP"), ("lowest", 0.1, "smaller prior")],
)
def test_prior_at_the_grid_edge_is_flagged(edge, prior, words):
    records = [
        *map_and_temperature(),
        rec("skfac", "1", 0.6, 0.12, extra={"prior_precision": 1.0, "prior_at_grid_edge": None}),
        rec(
            "last-layer",
            "-",
            0.6,
            0.12,
            extra={"prior_precision": prior, "prior_at_grid_edge": edge},
        ),
    ]
    text = read_table(records)
    last = text.split(". ")[-1]
    assert last.startswith(f"Last-layer Laplace tuned its prior precision to the {edge} value")
    assert f"({prior:g})" in last
    assert words in last
    assert "--prior-grid" in last
    assert "S-KFAC at p = 1 tuned" not in text


def test_under_confident_and_calibrated_maps():
    assert read_table(map_and_temperature(t=0.8)).startswith("The MAP is under-confident")
    calibrated = [
        rec("map", "-", 0.5, 0.05),
        rec("temperature", "-", 0.5, 0.05, extra={"temperature": 1.0}),
    ]
    text = read_table(calibrated)
    assert text.startswith("The MAP is close to calibrated")
    assert "left the NLL at 0.500" in text


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="no 'map' record"):
        read_table([rec("skfac", "1", 0.5, 0.1)])
    other = rec("map", "-", 0.5, 0.1, split=1)
    with pytest.raises(ValueError, match=r"one \(task, split\)"):
        read_table([*map_and_temperature(), other])


def test_order_puts_the_map_first_and_ramps_in_size_order():
    rows = [
        rec("skfac", "6.8", 0, 0),
        rec("temperature", "-", 0, 0),
        rec("swag-random", "1", 0, 0),
        rec("skfac", "1", 0, 0),
        rec("last-layer", "-", 0, 0),
        rec("map", "-", 0, 0),
    ]
    order = [(r["method"], r["size"]) for r in order_rows(rows)]
    assert order == [
        ("map", "-"),
        ("temperature", "-"),
        ("last-layer", "-"),
        ("skfac", "1"),
        ("skfac", "6.8"),
        ("swag-random", "1"),
    ]
    assert QUICKSTART_METHODS[0] == "map"


def test_negative_split_is_refused_before_any_work(capsys, tmp_path):
    from partialbayes.glue_bench.cli import main

    assert main(["quickstart", "--split", "-1", "--results", str(tmp_path / "q")]) == 2
    assert "--split must be an int >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_the_thread_count_leaves_the_busy_cores_alone_and_says_so(monkeypatch):
    # Issue 34: two threads per process on a shared 2-core machine spun for 57 minutes, silently.
    from partialbayes.glue_bench.cli import choose_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
        line = choose_threads()
        assert torch.get_num_threads() == 1
        assert line.startswith("threads: 1 (2 usable CPUs less the load average 1.2")
        assert "busy" not in line
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 3.0, 3.0))
        line = choose_threads()
        assert torch.get_num_threads() == 1
        assert "The machine is busy (load 3.5 on 2 CPUs)" in line
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
        assert choose_threads().startswith("threads: 2 (")  # idle: torch's default stays
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 3.0, 3.0))
        assert choose_threads().startswith("threads: 2 (OMP_NUM_THREADS)")  # the user's choice
    finally:
        torch.set_num_threads(before)
