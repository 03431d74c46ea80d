"""The ``glue-bench quickstart`` demo: its settings, its table order and the sentences that read the table.

The settings were chosen by measuring candidates over splits 0, 1 and 2 (docs: "How the quickstart was
chosen" in the GLUE how-to); :func:`read_table` turns the records of one run into two or three sentences,
so that what the quickstart says about the methods is computed from its own numbers, never hard-coded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from partialbayes.glue_bench.tables import size_key

QUICKSTART_METHODS = ("map", "temperature", "last-layer", "skfac")
"""The methods of the quickstart, in table order (MAP first)."""

QUICKSTART_ARGS: dict[str, Any] = {
    "task": "sst2",
    "max_train_examples": 1024,
    "max_test_examples": 300,
    "epochs": 5,
    "n_samples": 8,
}
"""Defaults of the ``quickstart`` command line (each one can be overridden by its option)."""

QUICKSTART_TRAIN: dict[str, Any] = {"freeze_embeddings": True, "length_buckets": 4}
""":class:`~partialbayes.glue_bench.train.TrainConfig` fields the quickstart sets (CPU shortcuts: frozen token
embeddings, batches of similar-length sentences)."""

QUICKSTART_PRIOR_GRID = tuple(float(v) for v in torch.logspace(-3, 3, 13, dtype=torch.float64))
"""Prior precisions 10^-3 ... 10^3 in half decades: the paper's grid (10^-1 ... 10^3) extended down by two
decades, since with about 1,000 training sentences instead of 60,000 the S-KFAC cells tuned their prior
to the paper grid's lowest value (measured: see the how-to)."""

QUICKSTART_SETTINGS: dict[str, Any] = {
    "skfac_percents": (1.0, 6.8),
    "prior_grid": QUICKSTART_PRIOR_GRID,
}
""":class:`~partialbayes.glue_bench.context.Settings` fields the quickstart sets (two S-KFAC levels and the
wider prior grid)."""

LABELS = {"map": "MAP", "temperature": "temperature scaling", "last-layer": "last-layer Laplace"}
LABELS |= {"skfac": "S-KFAC", "swag-random": "SWAG on random linear maps"}


def _label(method: str) -> str:
    return LABELS.get(method, method)


def order_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows (or records) in the quickstart's table order: MAP, temperature, then the other methods.

    Methods named in :data:`QUICKSTART_METHODS` come in that order, any other after them by name; the
    sizes of a method in ramp order (``-`` first, then by percentage or count).
    """
    known = {m: i for i, m in enumerate(QUICKSTART_METHODS)}

    def key(r: Mapping[str, Any]) -> tuple:
        return known.get(r["method"], len(known)), r["method"], size_key(str(r["size"]))

    return sorted(rows, key=key)


def _pick(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The level of a method with the lowest validation NLL (ties: the smaller level)."""

    def key(r: Mapping[str, Any]) -> tuple[float, tuple[int, float, str]]:
        val = r.get("val_nll")
        return math.inf if val is None else float(val), size_key(str(r["size"]))

    return min(records, key=key)


def _change(name: str, before: float, after: float) -> str:
    """``"lowered the NLL by 0.031 (0.500 → 0.469)"`` / ``"raised ..."`` / ``"left ... at 0.500"``."""
    delta = after - before
    if round(delta, 3) == 0:
        return f"left the {name} at {after:.3f}"
    verb = "lowered" if delta < 0 else "raised"
    return f"{verb} the {name} by {abs(delta):.3f} ({before:.3f} → {after:.3f})"


def _memory(r: Mapping[str, Any]) -> str:
    pct = float(r.get("percent_stochastic") or 0.0)
    return f"{pct:.2g} % of the weights, {float(r.get('floats') or 0):,.0f} floats"


def _size(r: Mapping[str, Any]) -> str:
    if (size := str(r["size"])) == "-":
        return ""
    return f" at p = {size}" if r["method"] == "skfac" else f" at size {size}"


def _calibration_sentence(map_r: Mapping[str, Any], temp: Mapping[str, Any] | None) -> str:
    if temp is None:
        return f"The MAP has NLL {map_r['nll']:.3f} and ECE {map_r['ece']:.3f}."
    t = (temp.get("extra") or {}).get("temperature")
    t_text = f" (T = {float(t):.2f})" if t is not None else ""
    if t is not None and float(t) > 1 and temp["ece"] < map_r["ece"]:
        state = "The MAP is over-confident"
    elif t is not None and float(t) < 1:
        state = "The MAP is under-confident"
    else:
        state = "The MAP is close to calibrated"
    return (
        f"{state}: temperature scaling{t_text} {_change('NLL', map_r['nll'], temp['nll'])} and "
        f"{_change('ECE', map_r['ece'], temp['ece'])}."
    )


def _method_clause(map_r: Mapping[str, Any], r: Mapping[str, Any]) -> str:
    nll_better = r["nll"] < map_r["nll"] - 5e-4
    ece_better = r["ece"] < map_r["ece"] - 5e-4
    head = f"{_label(r['method'])}{_size(r)} ({_memory(r)})"
    if not nll_better and not ece_better:
        return (
            f"{head} did not improve (NLL {r['nll']:.3f} vs {map_r['nll']:.3f}, "
            f"ECE {r['ece']:.3f} vs {map_r['ece']:.3f})"
        )
    return f"{head} {_change('NLL', map_r['nll'], r['nll'])} and {_change('ECE', map_r['ece'], r['ece'])}"


def _edge_sentence(picked: Sequence[Mapping[str, Any]]) -> str | None:
    parts = []
    for r in picked:
        extra = r.get("extra") or {}
        if (edge := extra.get("prior_at_grid_edge")) is None:
            continue
        prior = extra.get("prior_precision")
        value = f" ({float(prior):g})" if prior is not None else ""
        what = "so its posterior is nearly the MAP"
        what = what if edge == "highest" else "so a smaller prior precision might fit better"
        parts.append(
            f"{_label(r['method'])}{_size(r)} tuned its prior precision to the {edge} value of the "
            f"grid{value}, {what}"
        )
    return "; ".join(parts) + " (widen it with --prior-grid)." if parts else None


def read_table(records: Iterable[Mapping[str, Any]]) -> str:
    """Two or three sentences that read a quickstart table (one task, one split) for the user.

    Args:
        records: The result records of one (task, split): ``method``, ``size``, ``nll``, ``ece``,
            ``val_nll``, ``floats``, ``percent_stochastic`` and ``extra`` (``temperature`` of temperature
            scaling; ``prior_precision`` and ``prior_at_grid_edge`` of the Laplace cells).

    Returns:
        The sentences: how over- or under-confident the MAP is (what temperature scaling changes); what
        each Bayesian method changed against the MAP, by how much and at what memory (for a ramp, the level
        with the lowest validation NLL, as Table 2 picks it: never the best on the test set), saying so
        when it did not improve; and, when a tuned prior precision sat at an end of its grid, which cell.

    Raises:
        ValueError: No MAP record, or records of more than one (task, split).
    """
    records = list(records)
    keys = {(r.get("task"), r.get("split")) for r in records}
    if len(keys) > 1:
        raise ValueError(f"read_table: records of one (task, split) expected, got {sorted(keys)}")
    by_method: dict[str, list[Mapping[str, Any]]] = {}
    for r in order_rows(records):
        by_method.setdefault(r["method"], []).append(r)
    if "map" not in by_method:
        raise ValueError("read_table: no 'map' record to compare with")
    map_r = by_method["map"][0]
    temp = by_method.get("temperature", [None])[0]
    sentences = [_calibration_sentence(map_r, temp)]
    picked = [_pick(rs) for m, rs in by_method.items() if m not in ("map", "temperature")]
    if picked:
        clauses = [_method_clause(map_r, r) for r in picked]
        ramps = [_label(r["method"]) for r in picked if len(by_method[r["method"]]) > 1]
        note = f" ({', '.join(ramps)}: the level with the lowest validation NLL)" if ramps else ""
        sentences.append(f"Against the MAP{note}, " + "; ".join(clauses) + ".")
    edge = _edge_sentence(picked)
    if edge is not None:
        sentences.append(edge[0].upper() + edge[1:])
    return " ".join(sentences)
