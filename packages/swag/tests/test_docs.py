"""The code blocks of the SWAG README, the SWAG concept page and the Posteriors page run as written."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "packages" / "swag" / "README.md"
CONCEPT = ROOT / "docs" / "pages" / "concepts" / "swag.md"
POSTERIORS = ROOT / "docs" / "pages" / "concepts" / "posteriors.md"


def blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run(code, path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(path), "exec"), scope)
    return scope


def test_readme_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    (code,) = blocks(README)
    scope = run(code, README, tmp_path, monkeypatch)
    assert scope["probs"].shape == (8, 3)
    assert scope["logits"].shape == (10, 8, 3)
    assert (tmp_path / "swag.safetensors").exists()


@pytest.mark.skipif(not CONCEPT.exists(), reason="docs are not in this checkout")
def test_concept_page_runs(tmp_path, monkeypatch):
    (code,) = blocks(CONCEPT)
    scope = run(code, CONCEPT, tmp_path, monkeypatch)
    torch.testing.assert_close(scope["probs"].sum(-1), torch.ones(5))
    assert scope["logits"].shape == (50, 5, 3)


@pytest.mark.skipif(not POSTERIORS.exists(), reason="docs are not in this checkout")
def test_posteriors_page_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("partialbayes.ivon")
    pytest.importorskip("partialbayes.linear_sampling")
    short, complete = blocks(POSTERIORS)
    assert len([line for line in short.splitlines() if line.strip()]) <= 10
    run(complete, POSTERIORS, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    for name in ("SWAG", "SampledLaplace", "IVON"):
        assert name in out
        assert (tmp_path / f"{name}.safetensors").exists()
