"""MkDocs hook: MathJax served from the site itself, so math renders offline (no CDN).

The renderer's files come from the ``django-static-mathjax`` wheel (MathJax 3, Apache-2.0; the ``docs``
dependency group) and are added to the site at build time: the TeX-to-HTML bundle and its web fonts, under
``javascripts/mathjax/`` (the bundle finds its fonts relative to itself).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

BUNDLE = "tex-mml-chtml.js"
FONTS = "output/chtml/fonts/woff-v2"


def mathjax_dir() -> Path:
    """The ``es5`` folder of the installed MathJax (``PluginError`` naming the fix when it is missing)."""
    try:
        root = Path(
            str(distribution("django-static-mathjax").locate_file("mathjax/static/mathjax/es5"))
        )
    except PackageNotFoundError:
        root = Path("/nonexistent")
    if not (root / BUNDLE).is_file():
        raise PluginError(
            "MathJax is not installed: the docs bundle it from the 'django-static-mathjax' package "
            "(uv sync --all-packages installs the docs group)"
        )
    return root


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add MathJax's bundle and fonts to the site's files."""
    root = mathjax_dir()
    for src in [root / BUNDLE, *sorted((root / FONTS).glob("*.woff"))]:
        uri = f"javascripts/mathjax/{src.relative_to(root).as_posix()}"
        files.append(File.generated(config, uri, abs_src_path=str(src)))
    return files
