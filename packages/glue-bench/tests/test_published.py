"""The records published in the repository's ``results/`` regenerate their report in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from partialbayes.glue_bench.report import write_report
from partialbayes.glue_bench.store import iter_records, unit_states

RESULTS = Path(__file__).resolve().parents[3] / "results"


@pytest.mark.parametrize(
    ("folder", "task"),
    [
        ("glue", "mrpc"),
        ("glue-sst2-3k", "sst2"),
    ],  # the full-size MRPC units; SST-2 on 3,000 sentences
)
def test_published_glue_records_make_table_2(tmp_path, folder, task):
    root = RESULTS / folder
    if not root.is_dir():
        pytest.skip(f"no GLUE records published under results/{folder}")
    records = list(iter_records(root))
    assert records, f"results/{folder} holds no records"
    report = write_report(root, tmp_path)
    md = report["markdown"]
    assert "## Table 2" in md
    units = unit_states(root)
    for unit in units:  # published units are finished: no claim, no fine-tuning progress
        assert unit["state"] == "done", unit
    methods = {r["method"] for r in report["rows"] if r["task"] == task}
    assert {"map", "temperature", "last-layer", "skfac", "kfac-full"} <= methods
    assert not (root / "checkpoints").exists(), "checkpoints are not published"
