"""The documentation reads offline and in print, and the README's set-up lines work as written (issue 34).

Math is rendered by a MathJax bundled into the site at build time (``docs/hooks.py``), never a CDN; no page
holds a control character (a TAB once replaced the ``\\t`` of ``\\times``: "C imes C"); the README names
commands that exist in a fresh clone, and ``.gitignore`` covers what the quickstart writes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = sorted(
    [
        *(ROOT / "docs" / "pages").rglob("*.md"),
        ROOT / "README.md",
        *(ROOT / "packages").glob("*/README.md"),
        *(ROOT / "packages").glob("*/CHANGELOG.md"),
    ]
)


def test_no_page_holds_a_control_character():
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"[\x00-\x08\x0b-\x1f\x7f]|\t", line):
                bad.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()[:60]!r}")
    assert not bad, "control characters (a TAB where \\t was meant?):\n" + "\n".join(bad)


def test_the_site_loads_nothing_from_elsewhere():
    config = (ROOT / "docs" / "mkdocs.yml").read_text()
    scripts = re.search(r"extra_javascript:\n((?:  - .*\n)+)", config)
    assert scripts is not None
    assert "http" not in scripts.group(1), "a script from a CDN: bundle it (docs/hooks.py)"
    assert re.search(r"^  font: false", config, re.M), "the theme would fetch Google Fonts"
    assert "hooks.py" in config


def test_the_mathjax_bundle_is_installed_with_its_fonts():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    root = hooks.mathjax_dir()
    assert (root / hooks.BUNDLE).stat().st_size > 500_000
    assert len(list((root / hooks.FONTS).glob("*.woff"))) >= 20


def test_the_readme_commands_exist_in_a_fresh_clone():
    readme = (ROOT / "README.md").read_text()
    for cmd in re.findall(r"`((?:nox|mkdocs|pytest)\b[^`]*)`", readme):
        pytest.fail(f"README says `{cmd}`: not on PATH in a fresh clone (prefix `uv run --frozen`)")


def test_gitignore_covers_what_the_quickstart_writes():
    from partialbayes.glue_bench.cli import build_parser

    args = build_parser().parse_args(["quickstart"])
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", f"{args.results}/records/x.json"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, f".gitignore does not cover the quickstart's {args.results}/"


def test_api_pages_show_inherited_methods_and_whole_returns():
    config = (ROOT / "docs" / "mkdocs.yml").read_text()
    assert (
        "returns_multiple_items: false" in config
    )  # else each Returns line renders as its own row
    curvature = (ROOT / "docs" / "pages" / "api" / "curvature.md").read_text()
    head = curvature.split("::: partialbayes.curvature.LaplaceBase")[0]
    assert "inherited_members: true" in head  # KronLaplace's fit, predict, optimize_prior_precision


def test_the_bias_convention_is_stated_one_way():
    # laplace-torch keeps each bias as a block of its own; folding it into A is ours (bias="fold").
    for page in PAGES:
        text = " ".join(page.read_text(encoding="utf-8").split())
        assert "folded into the input factor (laplace-torch's convention)" not in text, page
