"""Figure of S-KFAC masks on one weight matrix at p = 40, 50, 80, 90 (as Fig. 7 of Kampen et al.).

Run from the repository root::

    uv run --frozen python docs/scripts/selection_masks.py

It writes ``docs/pages/img/skfac_masks.png``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from partialbayes.selection._skfac import skfac_rows_cols

OUT = Path(__file__).resolve().parent.parent / "pages" / "img" / "skfac_masks.png"
PERCENTS = (40, 50, 80, 90)


def weight(n_out: int = 24, n_in: int = 32, seed: int = 0) -> torch.Tensor:
    """A heavy-tailed random weight (Student-t entries), so that a few rows and columns stand out."""
    t = torch.distributions.StudentT(torch.tensor(3.0))
    torch.manual_seed(seed)
    return t.sample((n_out, n_in)) * 0.05


def main() -> None:
    w = weight()
    fig, axes = plt.subplots(1, len(PERCENTS), figsize=(10, 2.9), constrained_layout=True)
    for ax, p in zip(axes, PERCENTS, strict=True):
        rows, cols = skfac_rows_cols(w, p)
        mask = np.zeros(w.shape, dtype=bool)
        mask[np.ix_(rows.numpy(), cols.numpy())] = True
        shown = np.where(mask, np.abs(w.numpy()), np.nan)
        ax.set_facecolor("0.88")
        ax.imshow(shown, cmap="viridis", interpolation="nearest")
        frac = mask.mean()
        ax.set_title(f"p = {p}: {mask.sum()} of {mask.size} ({100 * frac:.0f} %)", fontsize=9)
        ax.set_xlabel("input j (columns)", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_ylabel("output i (rows)", fontsize=8)
    fig.suptitle(
        "S-KFAC: stochastic entries R x C (coloured by |W|), grey = kept at MAP", fontsize=10
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=80)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
