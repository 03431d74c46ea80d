"""Selection on a DistilBERT-size random-init model.

Operator-norm ranking (exact SVD vs power iteration) and S-KFAC / magnitude selection over every linear map.
"""

from __future__ import annotations

import torch
from benchharness import Bench
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from partialbayes.selection import (
    largest_magnitude,
    linear_modules,
    operator_norms,
    sparse_kfac,
)


def _model(b: Bench) -> torch.nn.Module:
    if b.quick:
        config = DistilBertConfig(
            vocab_size=100,
            dim=64,
            n_layers=2,
            n_heads=2,
            hidden_dim=128,
            max_position_embeddings=64,
        )
    else:  # DistilBERT-base sizes: dim 768, 6 layers, 38 linear maps
        config = DistilBertConfig(
            vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072
        )
    torch.manual_seed(0)
    return DistilBertForSequenceClassification(config).eval().to(b.device)


def _rank(norms: dict[str, float]) -> list[str]:
    return sorted(norms, key=lambda n: -norms[n])


def bench_operator_norm(b: Bench) -> None:
    model = _model(b)
    n_maps = len(linear_modules(model))
    group = f"Operator-norm ranking of all {n_maps} linear maps, DistilBERT-size random init"
    if b.quick:
        group = group.replace("DistilBERT-size", "small DistilBERT")
    b.time("exact SVD (batched svdvals)", lambda: operator_norms(model, method="svd"), group=group)
    exact = operator_norms(model, method="svd")
    for n_iter in (20, 100, 300):
        name = f"power iteration, {n_iter} iterations"
        b.time(
            name,
            lambda n_iter=n_iter: operator_norms(model, method="power", n_iter=n_iter, tol=0.0),
            group=group,
            reference="exact SVD (batched svdvals)",
        )
        power = operator_norms(model, method="power", n_iter=n_iter, tol=0.0)
        rel = max(abs(power[n] - exact[n]) / exact[n] for n in exact)
        b.metric(f"{name}: max relative error", rel, unit="", group=group)
        top5 = len(set(_rank(power)[:5]) & set(_rank(exact)[:5]))
        same = sum(a == c for a, c in zip(_rank(power), _rank(exact), strict=True))
        b.metric(
            f"{name}: ranks equal to exact",
            same,
            unit=f"of {n_maps}",
            group=group,
            note=f"top-5 overlap {top5}/5",
        )


def bench_skfac_selection(b: Bench) -> None:
    model = _model(b)
    group = "Subset selection over every linear map" + (
        " (small config)" if b.quick else ", DistilBERT-size"
    )
    b.time("sparse_kfac(p=50), all modules", lambda: sparse_kfac(model, 50), group=group)
    b.time(
        "sparse_kfac(p=50, sequential=True)",
        lambda: sparse_kfac(model, 50, sequential=True),
        group=group,
        reference="sparse_kfac(p=50), all modules",
    )
    b.time(
        "largest_magnitude(10 %) (global sort)",
        lambda: largest_magnitude(model, 10),
        group=group,
        reference="sparse_kfac(p=50), all modules",
        repeat=3,
    )
    s = sparse_kfac(model, 50)
    b.metric(
        "sparse_kfac(p=50): percent of countable parameters",
        s.percent_of(model),
        unit="%",
        group=group,
    )
