"""The records published in the repository's ``results/`` regenerate their report in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from partialbayes.glue_bench.report import write_report
from partialbayes.glue_bench.store import iter_records, unit_states

RESULTS = Path(__file__).resolve().parents[3] / "results"
GLUE = RESULTS / "glue"


@pytest.mark.skipif(not GLUE.is_dir(), reason="no GLUE records published under results/glue")
def test_published_glue_records_make_table_2(tmp_path):
    records = list(iter_records(GLUE))
    assert records, "results/glue holds no records"
    report = write_report(GLUE, tmp_path)
    md = report["markdown"]
    assert "## Table 2" in md
    units = unit_states(GLUE)
    for unit in units:  # published units are finished: no claim, no fine-tuning progress
        assert unit["state"] == "done", unit
    methods = {r["method"] for r in report["rows"] if r["task"] == "mrpc"}
    assert {"map", "temperature", "last-layer", "skfac", "kfac-full"} <= methods
    assert not (GLUE / "checkpoints").exists(), "checkpoints are not published"
