"""SWAG on a 10 % subset: collection overhead per snapshot against one SGD step, memory against full SWAG."""

from __future__ import annotations

import math

import torch
from benchharness import Bench
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from partialbayes.selection import KronBlock, Subset, linear_modules
from partialbayes.swag import SWAG, collect_swag

K = 20


def _model_and_batch(b: Bench) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    if b.quick:
        config = DistilBertConfig(
            vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
        )
        batch, length = 4, 16
    else:  # DistilBERT-base sizes
        config = DistilBertConfig(
            vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072
        )
        batch, length = 8, 128
    config.num_labels = 2
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(config).to(b.device)
    g = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, length), generator=g),
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }
    return model, {k: v.to(b.device) for k, v in data.items()}


def _ten_percent_subset(model: torch.nn.Module) -> Subset:
    """The first ⌈√0.1·n⌉ rows and columns of every linear map (≈10 % of each weight) plus those biases."""
    frac = math.sqrt(0.1)
    blocks = {}
    for name, mod in linear_modules(model).items():
        n_out, n_in = mod.weight.shape
        rows = torch.arange(math.ceil(frac * n_out))
        blocks[f"{name}.weight"] = KronBlock(rows=rows, cols=torch.arange(math.ceil(frac * n_in)))
        if mod.bias is not None:
            blocks[f"{name}.bias"] = KronBlock(rows=rows)
    return Subset.from_model(model, blocks)


def bench_collection(b: Bench) -> None:
    model, batch = _model_and_batch(b)
    subset = _ten_percent_subset(model)
    size = "tiny config" if b.quick else "DistilBERT-size config"
    group = f"SWAG collection, {size}, 10 % subset"
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    repeat = 5 if b.quick else 3

    def sgd_step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
            batch["labels"],
        )
        loss.backward()
        opt.step()

    model.train()
    b.time("torch SGD step (all weights)", sgd_step, group=group, repeat=repeat)
    opt.zero_grad(set_to_none=True)

    swag = SWAG(model, subset, max_rank=K)
    b.time(
        "snapshot (SWAG.collect)",
        lambda: swag.collect(model),
        group=group,
        reference="torch SGD step (all weights)",
        floats=swag.num_floats,
        repeat=repeat,
        note=f"K={K}, d={swag.num_entries}",
    )
    averaged = torch.optim.swa_utils.AveragedModel(model)
    b.time(
        "torch AveragedModel.update_parameters (SWA mean only, all weights)",
        lambda: averaged.update_parameters(model),
        group=group,
        reference="torch SGD step (all weights)",
        floats=n_params,
        repeat=repeat,
        note="first moment only, no variance or deviations",
    )
    c = 5
    b.time(
        f"collect_swag, {c} masked SGD steps + 1 snapshot",
        lambda: collect_swag(
            model, subset, [batch], lr=1e-4, n_steps=c, snapshot_every=c, max_rank=K, progress=False
        ),
        group=group,
        reference="torch SGD step (all weights)",
        floats=swag.num_floats,
        repeat=max(2, repeat - 1),
        note=f"ratio per {c} steps; divide by {c} for per step",
    )
    with torch.no_grad():
        swag.collect(model)
    b.time(
        "draw one sample (low rank + diagonal)",
        lambda: swag.sample_flat(generator=torch.Generator(device=b.device).manual_seed(0)),
        group=group,
        reference="torch SGD step (all weights)",
        repeat=repeat,
    )

    mem = f"SWAG memory (K={K}), {size}"
    b.metric("stochastic entries d", swag.num_entries, unit="entries", group=mem)
    b.metric("percent of parameters", subset.percent_of(model), unit="%", group=mem)
    b.metric("partialbayes subset SWAG", swag.num_floats, unit="floats", group=mem)
    b.metric(
        "full-model SWAG",
        (2 + K) * n_params,
        unit="floats",
        group=mem,
        note="(2 + K) x all parameters, embeddings included",
    )
    b.metric("subset / full", swag.num_floats / ((2 + K) * n_params), unit="ratio", group=mem)
    if not b.has("torch_uncertainty"):
        b.skip("torch-uncertainty SWAG", group=mem, reason="torch-uncertainty not installed")
