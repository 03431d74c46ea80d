"""Cost of one grid cell per method on a random-init BERT, against one forward+backward pass.

Synthetic token batches (no data, no hub); quick mode uses a 2-layer, 64-wide model, full mode a
MiniLM-size one (6 layers, 384 wide, 12 heads). Every method fits on the training batches and predicts the
test batches, as a grid cell does.
"""

from __future__ import annotations

import torch
from benchharness import Bench

from partialbayes.glue_bench.context import Context, Settings
from partialbayes.glue_bench.methods import METHODS


def _model(quick: bool, device: torch.device):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if quick:
        cfg = BertConfig(
            vocab_size=200,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
            num_labels=2,
        )
    else:
        cfg = BertConfig(
            vocab_size=30522,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=1536,
            max_position_embeddings=512,
            num_labels=2,
        )
    return BertForSequenceClassification(cfg).to(device).eval(), cfg.vocab_size


def _batches(n_batches: int, vocab: int, length: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(5, vocab, (16, length), generator=g)
        out.append(
            {
                "input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device),
                "labels": torch.randint(0, 2, (16,), generator=g).to(device),
            }
        )
    return out


def bench_cells(b: Bench) -> None:
    length = 16 if b.quick else 32
    n_train, n_eval = (4, 2) if b.quick else (8, 4)
    model, vocab = _model(b.quick, b.device)
    settings = Settings(n_samples=4, swag_lrs=(1e-2,), swag_sweep_steps=10, swag_steps=20)
    ctx = Context(
        model=model,
        train=_batches(n_train, vocab, length, b.device, 0),
        val=_batches(n_eval, vocab, length, b.device, 1),
        test=_batches(n_eval, vocab, length, b.device, 2),
        num_labels=2,
        device=b.device,
        seed=0,
        settings=settings,
    )
    group = f"one grid cell, {'tiny' if b.quick else 'MiniLM-size'} BERT, {n_train} train / {n_eval} test batches of 16x{length}"

    def fwd_bwd():
        batch = ctx.train[0]
        model.zero_grad(set_to_none=True)
        out = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        torch.nn.functional.cross_entropy(out, batch["labels"]).backward()
        model.zero_grad(set_to_none=True)

    b.time("forward+backward (1 batch)", fwd_bwd, group=group)
    for name, size in (
        ("temperature", "-"),
        ("last-layer", "-"),
        ("skfac", "6.8"),
        ("kfac-max-mlp", "2"),
        ("kfac-full", "-"),
        ("swag-random", "2"),
        ("ls-last-layer", "-"),
        ("ls-skfac", "6.8"),
    ):
        method = METHODS[name]
        floats = method.run(ctx, size).floats
        b.time(
            f"{name} {size}",
            lambda m=method, s=size: m.run(ctx, s),
            group=group,
            reference="forward+backward (1 batch)",
            floats=floats,
            repeat=3,
            warmup=0,
        )

    # The same linearised-Laplace cell through linear_sampling's JVP operators instead of the dense
    # Jacobian (what ls-full and large subsets use): tiny model only, it is far slower on MiniLM.
    if b.quick:
        from dataclasses import replace

        ctx.settings = replace(
            settings, linear_sampling=replace(settings.linear_sampling, dense_max_floats=0)
        )
        method = METHODS["ls-skfac"]
        b.time(
            "ls-skfac 6.8 (JVP operators)",
            lambda: method.run(ctx, "6.8"),
            group=group,
            reference="forward+backward (1 batch)",
            floats=method.run(ctx, "6.8").floats,
            repeat=1,
            warmup=0,
        )
