"""Laplace-LoRA at GPT-2's vocabulary within its memory targets (issue #23; slow: fresh processes)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "llm_memory.py"


def _run(case: str) -> tuple[list[tuple[str, float, float]], str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--case", case, "--threads", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=3000,
    ).stdout
    steps = re.findall(r"(\S+): ([\d.]+) s, peak ([\d.]+) GiB", out)
    return [(step, float(s), float(peak)) for step, s, peak in steps], out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "limit"), [("mc", 3.0), ("empirical", 3.0), ("head-low-rank", 6.0)]
)
def test_fit_and_answer_only_predict_within_the_target(case, limit):
    steps, out = _run(case)
    assert [s for s, _, _ in steps] == ["fit", "predict"], out
    assert steps[-1][2] < limit, out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["exact", "head"])
def test_refused_at_the_first_batch_before_allocating(case):
    steps, out = _run(case)
    assert [s for s, _, _ in steps] == ["refused"], out
    assert steps[0][2] < 3.0, out  # nothing large was allocated
    assert "fisher='exact'" in out if case == "exact" else "G of 'base_model.model.lm_head'" in out
