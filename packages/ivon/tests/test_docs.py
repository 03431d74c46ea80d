"""The code blocks of the IVON README and of the IVON concept page's usage section run as written."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "packages" / "ivon" / "README.md"
CONCEPT = ROOT / "docs" / "pages" / "concepts" / "ivon.md"


def run(path, index, tmp_path, monkeypatch):
    code = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)[index]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(path), "exec"), scope)
    return scope


def test_readme_runs(tmp_path, monkeypatch):
    scope = run(README, 0, tmp_path, monkeypatch)
    torch.testing.assert_close(scope["probs"].sum(-1), torch.ones(64))
    assert scope["logits"].shape == (8, 64, 3)


@pytest.mark.skipif(not CONCEPT.exists(), reason="docs are not in this checkout")
def test_concept_page_usage_runs(tmp_path, monkeypatch):
    scope = run(CONCEPT, 0, tmp_path, monkeypatch)
    assert scope["probs"].shape == (5, 3)
    assert scope["mix_probs"].shape == (5, 3)
    assert len(scope["again"].components) == 3
