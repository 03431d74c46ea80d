"""Test infrastructure shared by every package: threads, device fixture, hypothesis profiles, markers.

This file sits at the repository root so that pytest loads it both in the workspace environment and in
nox's isolated per-package environments (which run the package's tests from this checkout). It also puts
its folder on ``sys.path`` so that every package's tests import the tiny Hugging Face model builders of
``tiny_models.py`` beside it (pytest's ``--import-mode=importlib`` adds nothing to ``sys.path`` itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=15,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

DATA_ENV = "PARTIALBAYES_DATA"
THREADS_ENV = "PARTIALBAYES_TEST_THREADS"
ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The documentation's Python blocks run as tests (README.md, packages/*/README.md, docs/pages): doc_blocks.py.
pytest_plugins = ["doc_blocks", "pytester"]
_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every numerical test runs on cpu, and on cuda whenever a GPU is present."""
    return torch.device(request.param)


@pytest.fixture
def float64_default() -> Iterator[None]:
    """Make float64 torch's default dtype for one test (restored afterwards).

    For float64 Hugging Face models under older transformers: 4.45 (our declared floor) builds GPT-2's
    causal mask with ``torch.full`` in the *default* dtype, which overflows for a float64 model otherwise.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture
def data_dir() -> Path:
    """Root of the real data (layout of ``shared/data``: ``glue/<task>/...``, ``uci/<name>/data/...``)."""
    root = os.environ.get(DATA_ENV)
    if not root:
        pytest.skip(
            f"{DATA_ENV} is unset: point it at a folder with glue/ and uci/ to run the data tests"
        )
    path = Path(root)
    if not path.is_dir():
        pytest.skip(f"{DATA_ENV}={root} is not a directory")
    return path


def pytest_configure(config: pytest.Config) -> None:
    """The one thread setting of the test process: one intra-op thread unless $PARTIALBAYES_TEST_THREADS.

    The tests use tiny tensors, where thread start-up and spin-waiting cost more than they save on the
    shared 2-core CI machine (about 30x on the Laplace tests). Test modules do not set threads themselves.
    """
    del config
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA and `data` tests without $PARTIALBAYES_DATA, saying why."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device; none is available")
    no_data = pytest.mark.skip(
        reason=f"{DATA_ENV} is unset: it names the folder holding glue/ and uci/"
    )
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "data" in item.keywords and not os.environ.get(DATA_ENV):
            item.add_marker(no_data)
