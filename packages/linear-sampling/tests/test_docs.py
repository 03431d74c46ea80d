"""The code blocks of the linear-sampling README and the concept page's SampledLaplace block run as written."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "packages" / "linear-sampling" / "README.md"
CONCEPT = ROOT / "docs" / "pages" / "concepts" / "linear-sampling.md"


def blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for code in blocks(README):  # the blocks build on each other, as a reader runs them
        exec(compile(code, str(README), "exec"), scope)
    assert scope["probs"].shape == (5, 3)
    assert scope["samples"].shape == (32, 5, 3)


@pytest.mark.skipif(not CONCEPT.exists(), reason="docs are not in this checkout")
def test_concept_page_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = blocks(CONCEPT)
    scope: dict = {}
    exec(compile(code, str(CONCEPT), "exec"), scope)
    torch.testing.assert_close(scope["probs"].sum(-1), torch.ones(5))
    assert scope["logits"].shape == (20, 5, 3)
    assert torch.equal(scope["again"].samples, scope["la"].samples)
