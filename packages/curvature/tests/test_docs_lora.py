"""The how-to "Bayesian LoRA for a causal LM" runs as written: every Python block, in order, in one scope."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "pages" / "howto" / "bayesian-lora.md"

# peft calls a transformers method that transformers 5 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


def blocks(text: str) -> list[str]:
    """The page's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def outputs(text: str) -> list[str]:
    """The ```text block that follows each ```python block ("" where none does)."""
    return [
        m.group(2) or ""
        for m in re.finditer(r"```python\n(.*?)```\n(?:\n```text\n(.*?)```)?", text, flags=re.S)
    ]


@pytest.mark.skipif(not PAGE.exists(), reason="docs are not in this checkout")
def test_howto_runs_as_written(tmp_path, monkeypatch, capsys):
    text = PAGE.read_text()
    code = blocks(text)
    assert len(code) >= 6
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    scope: dict = {"__name__": "bayesian_lora_howto"}
    printed = []
    for i, block in enumerate(code):
        exec(compile(block, f"{PAGE}:block{i}", "exec"), scope)
        printed.append(capsys.readouterr().out)
    # what the page claims about the objects it builds
    la, probs, keep = scope["la"], scope["probs"], scope["scored"]
    assert la.n_data == 48
    assert probs.shape[-1] == len(scope["words"])
    assert scope["laplace"].shape == (200, 5)
    assert scope["head_probs"].shape == (200, 5)
    assert not torch.allclose(scope["laplace"], scope["f"][:, scope["ids"]].softmax(-1))
    assert int(keep.sum()) == 200
    assert (tmp_path / "lora-laplace.safetensors").exists()
    assert scope["sk"].num_floats < la.num_floats
    # the pasted outputs are those of a run (numbers may differ in the last digit across machines)
    for i, (got, shown) in enumerate(zip(printed, outputs(text), strict=True)):
        if shown:
            assert _shape(got) == _shape(shown), f"block {i}: output differs from the page"


def _shape(out: str) -> list[str]:
    """The output with every number replaced by '#': the words and layout must match the page."""
    return [
        re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", line).rstrip() for line in out.strip().splitlines()
    ]
