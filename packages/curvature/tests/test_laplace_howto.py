"""The S-KFAC how-to keeps its promise of ten lines (the doc-block collector runs the page's blocks)."""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[3] / "docs" / "pages" / "howto" / "skfac-huggingface.md"


@pytest.mark.skipif(not PAGE.exists(), reason="docs are not in this checkout")
def test_the_ten_lines_are_ten_lines():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 2
    code = [line for line in blocks[0].splitlines() if line.strip() and not line.startswith("#")]
    assert len(code) <= 10
    ten = "\n".join(code)
    assert "DataCollatorWithPadding" in ten
    assert "la.predict(" in ten
    assert "sqrt" not in ten
    assert "torch.pi" not in ten
