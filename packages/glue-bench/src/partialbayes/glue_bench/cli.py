"""Command-line entry point ``glue-bench``."""

from __future__ import annotations

import argparse

from partialbayes.glue_bench import __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``glue-bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="glue-bench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``glue-bench``; returns the process exit status."""
    build_parser().parse_args(argv)
    return 0
