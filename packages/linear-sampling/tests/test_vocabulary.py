"""SampledLaplace at GPT-2's vocabulary stays under 3 GB of process memory (issue #23; slow)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "vocab_memory.py"


@pytest.mark.slow
def test_a_50k_vocabulary_fits_and_predicts_under_3_gb():
    # a fresh process, so that the peak resident memory is this fit's and predict's alone
    args = ["--n-samples", "8", "--max-iter", "1", "--threads", "1"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=3000,
    ).stdout
    peaks = [float(p) for p in re.findall(r"peak (\d+\.\d+) GiB", out)]
    assert len(peaks) == 3, out  # model, fit, predict
    assert peaks[-1] < 3.0, out
