"""Every package says its version and ships its type information (issue 34)."""

from __future__ import annotations

import importlib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


@pytest.mark.parametrize("pkg", PACKAGES)
def test_version_from_the_package_metadata_and_py_typed(pkg):
    module = importlib.import_module(f"partialbayes.{pkg.replace('-', '_')}")
    assert module.__version__ == version(f"partialbayes-{pkg}")
    assert "__version__" in module.__all__
    assert (Path(module.__file__).parent / "py.typed").is_file(), "mypy: missing py.typed marker"
