"""The documentation collector (doc_blocks.py) on a fixture tree: what runs, what is skipped, what fails.

`doc_blocks_fixture/` is a miniature repository: a README whose blocks pass (one continues the previous
block, one is an illustration, a shown output matches with its floats masked), a page with a broken block,
a page whose shown output is stale, blocks that need the MiniLM or the data, a misplaced continuation
marker, a package README, and a Markdown file that is no documentation page. pytest runs on a copy of it
with the plugin loaded, as the root conftest loads it for this repository.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from doc_blocks import Block, output_difference, parse_blocks

FIXTURE = Path(__file__).parent / "doc_blocks_fixture"


@pytest.fixture
def tree(pytester: pytest.Pytester) -> pytest.Pytester:
    shutil.copytree(FIXTURE, pytester.path, dirs_exist_ok=True)
    return pytester


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """Node id -> outcome, from pytest's -rA summary lines."""
    found = {}
    for line in result.outlines:
        for word in ("PASSED", "FAILED", "SKIPPED"):
            if line.startswith(word + " ") and "::" in line:
                found[line.split()[1]] = word
    return found


def run(tree: pytest.Pytester, *args: str) -> pytest.RunResult:
    return tree.runpytest("-p", "doc_blocks", "-rA", "-p", "no:cacheprovider", *args)


def test_a_broken_block_fails_and_the_rest_of_its_chain_is_skipped(tree, monkeypatch):
    monkeypatch.delenv("PARTIALBAYES_DATA", raising=False)
    result = run(tree)
    got = outcomes(result)
    assert got["docs/pages/broken.md::block0-line4"] == "PASSED"
    assert got["docs/pages/broken.md::block1-line8"] == "FAILED"
    assert got["docs/pages/broken.md::block3-line18"] == "PASSED"  # self-contained: runs anyway
    # the traceback points at the page's own line
    result.stdout.fnmatch_lines(
        [
            "*broken.md*, line 9, in <module>*",
            "    y = x + undefined_name",
            "*NameError: name 'undefined_name' is not defined*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1[]] docs/pages/broken.md:13: continues the block at line 8, which failed"]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_passing_page(tree):
    result = run(tree, "README.md")
    got = outcomes(result)
    assert got == {"README.md::block0-line6": "PASSED", "README.md::block1-line17": "PASSED"}
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1[]] README.md:24: not run, as the page says: `model` is yours"]
    )
    result.assert_outcomes(passed=2, skipped=1)
    assert not (tree.path / "scratch.txt").exists()  # blocks write into a temporary folder


def test_stale_output_fails_with_both_outputs(tree):
    result = run(tree, "docs/pages/wrong_output.md")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the page shows the line*",
            "*accuracy # on 100 examples*",
            "*this run printed:*",
            "*accuracy 0.91 on 200 examples*",
        ]
    )


def test_blocks_needing_the_minilm_or_the_data_skip_with_a_reason(tree, monkeypatch):
    monkeypatch.delenv("PARTIALBAYES_DATA", raising=False)
    monkeypatch.setattr("doc_blocks.minilm_installed", lambda: False)
    result = run(tree, "docs/pages/needs.md")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs the packaged MiniLM*pip install*"])
    result.stdout.fnmatch_lines(["*needs the real data: $PARTIALBAYES_DATA is unset*"])


def test_data_blocks_run_when_the_data_is_there(tree, monkeypatch):
    monkeypatch.setenv("PARTIALBAYES_DATA", str(tree.path))
    result = run(tree, "docs/pages/needs.md", "-k", "block1")
    result.assert_outcomes(passed=1)


def test_a_continuation_marker_on_the_first_block_is_an_error(tree):
    result = run(tree, "docs/pages/bad_continuation.md")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*it is the page's first Python block*"])


def test_a_block_selected_alone_runs_the_blocks_it_continues(tree):
    result = run(tree, "README.md", "-k", "block1")
    result.assert_outcomes(passed=1)


def test_only_documentation_pages_are_collected(tree):
    result = run(tree, "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line]
    assert "packages/demo/README.md::block0-line4" in ids
    assert not [i for i in ids if "NOTES.md" in i]
    assert len(ids) == 12


def test_parse_reads_markers_outputs_and_snippets(tmp_path):
    (tmp_path / "script.py").write_text("print('from the script')\n")
    text = "\n".join(
        [
            "```python",
            '--8<-- "script.py"',
            "```",
            "",
            "```text",
            "from the script",
            "```",
            "    ```py",
            "    # continues the previous block",
            "    x = 1",
            "    ```",
            "````markdown",
            "```python",
            "inside a four-backtick fence: an example of Markdown, not a block",
            "```",
            "````",
        ]
    )
    first, second = parse_blocks(text, tmp_path / "page.md", tmp_path)
    assert first == Block(
        0,
        2,
        "print('from the script')\n",
        str(tmp_path / "script.py"),
        1,
        output="from the script",
        output_line=6,
    )
    assert second.continues
    assert second.code == "# continues the previous block\nx = 1\n"


def test_output_comparison_masks_floats_only():
    assert output_difference("loss 0.213 after 3 steps", "loss 0.2131 after 3 steps") is None
    assert output_difference("a\n...\nc", "a\nb\nc") is None
    assert output_difference("loss 0.2 after 3 steps", "loss 0.2 after 4 steps") is not None
    assert output_difference("b\na", "a\nb") is not None
