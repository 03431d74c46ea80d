"""The runnable block of the S-KFAC how-to page runs as written."""

import re
from pathlib import Path

import pytest
import torch

PAGE = Path(__file__).resolve().parents[3] / "docs" / "pages" / "howto" / "skfac-huggingface.md"


@pytest.mark.skipif(not PAGE.exists(), reason="docs are not in this checkout")
def test_howto_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 2
    ten = blocks[0]
    assert len([line for line in ten.splitlines() if line.strip()]) <= 10
    assert "DataCollatorWithPadding" in ten
    assert "la.predict(" in ten
    assert "sqrt" not in ten
    assert "torch.pi" not in ten
    code = blocks[1].replace("/tmp/skfac-posterior.safetensors", str(tmp_path / "p.safetensors"))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(PAGE), "exec"), scope)
    assert "KronLaplace" in capsys.readouterr().out
    assert scope["probs"].shape == (5, 3)
    torch.testing.assert_close(scope["mc_probs"].sum(-1), torch.ones(5))
    torch.testing.assert_close(scope["bridge"].sum(-1), torch.ones(5))
    assert scope["samples"].shape == (200, 5, 3)
