"""The longer run of the continual-learning how-to, and its figure (as Fig. 6 of Duffield et al., 2024).

Run from the repository root, with the GLUE files under ``$PARTIALBAYES_DATA/glue``::

    PARTIALBAYES_DATA=/path/to/data OMP_NUM_THREADS=1 uv run --frozen python docs/scripts/continual_learning.py

It runs the page's code block (``docs/pages/howto/continual-learning.md``) with the sizes of the run the page
reports, which prints the page's table, and writes ``docs/pages/img/continual_learning.png``: the test loss
of each episode's sentences after every episode, plain AdamW against the Laplace posterior as the prior.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "pages" / "howto" / "continual-learning.md"
OUT = ROOT / "pages" / "img" / "continual_learning.png"
SIZES = "BASE, TRAIN, TEST, EPOCHS = 2000, 1000, 300, 4"


def page_block() -> str:
    """The page's first Python block, with the sizes of the longer run."""
    code = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    sizes = re.compile(r"^BASE, TRAIN, TEST, EPOCHS = .*$", re.MULTILINE)
    if code is None or not sizes.search(code.group(1)):
        raise SystemExit(f"the first Python block of {PAGE} does not set BASE, TRAIN, TEST, EPOCHS")
    return sizes.sub(SIZES, code.group(1))


def main() -> None:
    namespace: dict = {"__name__": "__continual__"}
    exec(compile(page_block(), str(PAGE), "exec"), namespace)  # the page's own code
    tasks, results = namespace["tasks"], namespace["results"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 2.8), sharex=True)
    after = range(1, len(tasks) + 1)
    for i, (ax, task) in enumerate(zip(axes, tasks, strict=True)):
        for name, rows in results.items():
            ax.plot(after, [row[i] for row in rows], marker="o", label=name)
        ax.axvline(i + 1, color="grey", lw=0.8, ls=":")  # the episode trained on this task
        ax.set_title(f"test loss on {task}")
        ax.set_xticks(list(after), [f"after\n{t}" for t in tasks])
    axes[0].set_ylabel("nats per token")
    axes[0].legend(frameon=False)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
