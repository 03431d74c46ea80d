"""Readable summary table of a Subset."""

from __future__ import annotations

from typing import Any

from partialbayes.selection._blocks import KronBlock
from partialbayes.selection._modules import Grouping, module_group
from partialbayes.selection._subset import Subset, check_subset


def summary_rows(subset: Subset, grouping: Grouping | None = None) -> list[dict[str, Any]]:
    """One row per selected parameter: name, group, storage shape, block kind, stochastic count, percent."""
    check_subset(subset)
    rows = []
    for n in subset.names:
        shape = tuple(subset.shape(n))
        size = 1
        for d in shape:
            size *= d
        count = subset.num_entries(n)
        b = subset.block(n)
        kind = "kron" if isinstance(b, KronBlock) else "mask"
        rows.append(
            {
                "parameter": n,
                "group": module_group(n, grouping) or "-",
                "shape": "x".join(map(str, shape)) + (" (T)" if subset.transposed(n) else ""),
                "block": kind,
                "stochastic": count,
                "percent": 100.0 * count / size,
            }
        )
    return rows


def summary(subset: Subset, grouping: Grouping | None = None) -> str:
    """Plain-text table of :func:`summary_rows` with a total line (``(T)`` marks Conv1D storage)."""
    rows = summary_rows(subset, grouping)
    head = ("parameter", "group", "shape", "block", "stochastic", "% of param")
    body = [
        (
            r["parameter"],
            r["group"],
            r["shape"],
            r["block"],
            str(r["stochastic"]),
            f"{r['percent']:.2f}",
        )
        for r in rows
    ]
    body.append(("total", "", "", "", str(subset.num_entries()), ""))
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    right = {4, 5}

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(head), rule, *map(fmt, body[:-1]), rule, fmt(body[-1])])
