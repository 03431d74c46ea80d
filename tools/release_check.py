"""Check that every package whose ``src/`` changed since its last release tag bumped its version.

A release of package ``<pkg>`` at version ``X`` is the git tag ``<pkg>-vX`` (e.g. ``selection-v0.1.0``).
For each package:

* its ``CHANGELOG.md`` must have a ``## [<version>]`` heading for the version in its ``pyproject.toml``;
* if a tag exists and ``src/`` changed since the newest one, the version must differ from every tagged version.

Exit status 1 on any failure, with one line per problem.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def check(pkg_dir: Path) -> list[str]:
    pkg = pkg_dir.name
    version = tomllib.loads((pkg_dir / "pyproject.toml").read_text())["project"]["version"]
    problems = []
    changelog = (pkg_dir / "CHANGELOG.md").read_text()
    if not re.search(rf"^## \[{re.escape(version)}\]", changelog, re.MULTILINE):
        problems.append(
            f"{pkg}: CHANGELOG.md has no '## [{version}]' entry for the current version"
        )
    tags = [t for t in git("tag", "--list", f"{pkg}-v*").split() if t]
    if tags:
        last = max(tags, key=lambda t: version_key(t.removeprefix(f"{pkg}-v")))
        changed = git("diff", "--name-only", last, "HEAD", "--", f"packages/{pkg}/src").split()
        tagged = {t.removeprefix(f"{pkg}-v") for t in tags}
        if changed and version in tagged:
            problems.append(
                f"{pkg}: src/ changed since {last} ({len(changed)} files) but version is still {version}"
            )
    return problems


def main() -> int:
    problems = []
    for pkg_dir in sorted((ROOT / "packages").iterdir()):
        if (pkg_dir / "pyproject.toml").exists():
            problems += check(pkg_dir)
    for p in problems:
        print(p)
    if not problems:
        print("release check: every package's version and changelog are consistent with its tags")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
