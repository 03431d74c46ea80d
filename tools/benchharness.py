"""The shared benchmark harness: timing with warm-up and repeats, peak memory, peers in the same run.

A benchmark module lives in ``packages/<pkg>/benchmarks/bench_<topic>.py`` and defines functions named
``bench_*`` that take a :class:`Bench`. The runner (``tools/bench.py``) discovers them, calls each once, and
writes every measured row as JSON and as the markdown table included in ``docs/pages/benchmarks.md``.

Ratios are only ever taken between rows measured in the same process run (``reference=``), never against
numbers from another machine or run.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

try:  # psutil gives the resident set size for CPU peak memory; without it CPU memory is not reported.
    import psutil
except ImportError:  # pragma: no cover - psutil is in the bench group
    psutil = None


@dataclass
class Row:
    """One measured or skipped row of a benchmark table."""

    package: str
    group: str
    name: str
    kind: str  # "time", "metric" or "skip"
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    repeats: int = 0
    reference: str | None = None
    ratio: float | None = None
    peak_mb: float | None = None
    floats: int | None = None
    value: float | None = None
    unit: str = ""
    note: str = ""


class _PeakSampler:
    """Samples a peak of memory while a case runs: CUDA allocator peak, or process RSS on the CPU."""

    def __init__(self, device: torch.device, interval: float = 0.002) -> None:
        self.device = device
        self.interval = interval
        self.peak = 0
        self.base = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        return psutil.Process().memory_info().rss if psutil is not None else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> _PeakSampler:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = self._rss()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self.peak = max(self.peak, self._rss())

    @property
    def mb(self) -> float | None:
        if self.device.type != "cuda" and psutil is None:
            return None
        return max(self.peak - self.base, 0) / 2**20


@dataclass
class Bench:
    """What a ``bench_*`` function receives.

    Attributes:
        package: The package being benchmarked.
        device: Where to run (``cpu`` or ``cuda``).
        quick: Use small sizes (CI-sized smoke run); full sizes otherwise.
        repeat: Default number of timed repeats.
        warmup: Default number of untimed warm-up calls.
        rows: Everything recorded so far.
    """

    package: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    repeat: int = 5
    warmup: int = 1
    rows: list[Row] = field(default_factory=list)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _find(self, group: str, name: str) -> Row | None:
        for row in self.rows:
            if row.group == group and row.name == name and row.kind == "time":
                return row
        return None

    def time(
        self,
        name: str,
        fn: Callable[[], Any],
        *,
        group: str,
        reference: str | None = None,
        floats: int | None = None,
        repeat: int | None = None,
        warmup: int | None = None,
        note: str = "",
    ) -> float:
        """Time ``fn`` (warm-up, then repeats) and record median, quartiles and peak memory.

        Args:
            name: Row name, unique within ``group``.
            fn: The work to time; called with no arguments.
            group: The table the row belongs to.
            reference: Name of an earlier row of the same group; the ratio ``median / median(reference)`` is
                reported.
            floats: Floats the method stores (its memory in the project's unit), if meaningful.
            repeat: Timed calls (default ``self.repeat``).
            warmup: Untimed calls before timing (default ``self.warmup``).
            note: Free text shown in the table.

        Returns:
            The median time in seconds.
        """
        repeat = self.repeat if repeat is None else repeat
        warmup = self.warmup if warmup is None else warmup
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        for _ in range(warmup):
            fn()
        self._sync()
        times = []
        with _PeakSampler(self.device) as sampler:
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                self._sync()
                times.append(time.perf_counter() - t0)
        times.sort()
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        row = Row(
            package=self.package,
            group=group,
            name=name,
            kind="time",
            median_s=statistics.median(times),
            q1_s=q[0],
            q3_s=q[2],
            repeats=repeat,
            reference=reference,
            peak_mb=sampler.mb,
            floats=floats,
            note=note,
        )
        if reference is not None:
            ref = self._find(group, reference)
            if ref is None:
                raise ValueError(
                    f"reference row {reference!r} not measured earlier in group {group!r}"
                )
            row.ratio = row.median_s / ref.median_s if ref.median_s else None
        self.rows.append(row)
        print(
            f"  [{group}] {name}: {row.median_s * 1e3:.2f} ms"
            + (f" ({row.ratio:.2f}x {reference})" if row.ratio else "")
        )
        return row.median_s

    def metric(self, name: str, value: float, *, unit: str, group: str, note: str = "") -> None:
        """Record a number that is not a time (throughput, floats stored, a ratio computed by hand)."""
        self.rows.append(
            Row(
                package=self.package,
                group=group,
                name=name,
                kind="metric",
                value=float(value),
                unit=unit,
                note=note,
            )
        )
        print(f"  [{group}] {name}: {value:.4g} {unit}")

    def skip(self, name: str, *, group: str, reason: str) -> None:
        """Record that a row (typically a peer) could not be measured, and why."""
        self.rows.append(
            Row(package=self.package, group=group, name=name, kind="skip", note=reason)
        )
        print(f"  [{group}] {name}: skipped ({reason})")

    @staticmethod
    def has(module: str) -> bool:
        """Whether an optional peer (by import name: ``laplace``, ``curvlinops``, ``ivon``, ``posteriors``) is installed."""
        return importlib.util.find_spec(module) is not None


def rows_to_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    """JSON-ready rows."""
    return [asdict(r) for r in rows]


def _fmt_time(s: float | None) -> str:
    if s is None:
        return ""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Render rows grouped by (package, group) as markdown tables."""
    out: list[str] = []
    seen: list[tuple[str, str]] = []
    for r in rows:
        key = (r["package"], r["group"])
        if key not in seen:
            seen.append(key)
    for package, group in seen:
        out.append(f"#### {package}: {group}\n")
        out.append("| case | median | IQR | ratio | peak MB | floats | note |")
        out.append("|---|---:|---:|---:|---:|---:|---|")
        for r in rows:
            if (r["package"], r["group"]) != (package, group):
                continue
            if r["kind"] == "time":
                iqr = f"{_fmt_time(r['q1_s'])} – {_fmt_time(r['q3_s'])}"
                ratio = f"{r['ratio']:.2f}× {r['reference']}" if r["ratio"] is not None else ""
                peak = f"{r['peak_mb']:.0f}" if r["peak_mb"] is not None else ""
                floats = f"{r['floats']:,}" if r["floats"] is not None else ""
                out.append(
                    f"| {r['name']} | {_fmt_time(r['median_s'])} | {iqr} | {ratio} | {peak} | {floats} | {r['note']} |"
                )
            elif r["kind"] == "metric":
                out.append(
                    f"| {r['name']} | {r['value']:.4g} {r['unit']} |  |  |  |  | {r['note']} |"
                )
            else:
                out.append(f"| {r['name']} | skipped |  |  |  |  | {r['note']} |")
        out.append("")
    return "\n".join(out)
