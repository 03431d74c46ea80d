"""Warnings attributed to the user's call, however deep inside the package they are raised."""

from __future__ import annotations

import contextlib
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR) or path == _CONTEXTLIB


def user_stacklevel() -> int:
    """The ``stacklevel`` for `warnings.warn` that points at the first frame outside this package.

    Frames of ``partialbayes.curvature`` and of `contextlib` (the package's context managers) are skipped, so
    a warning raised from `kfac` and from ``KronLaplace.fit`` alike names the line of user code that called
    the package. Works on every supported Python (``warnings.warn(skip_file_prefixes=...)`` needs 3.12).

    Returns:
        ``stacklevel`` relative to the function that calls `user_stacklevel` and then ``warnings.warn``.
    """
    frame = sys._getframe(1)  # the function about to warn: stacklevel 1
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level
