"""Selection on a DistilBERT-size random-init model.

Operator-norm ranking of every linear map (exact SVD, exact Gram eigenvalues, power iteration) and S-KFAC /
magnitude selection over every linear map.
"""

from __future__ import annotations

import torch
from benchharness import Bench
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from partialbayes.selection import largest_magnitude, linear_modules, sparse_kfac
from partialbayes.selection._norms import operator_norms


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
    size = "small DistilBERT" if b.quick else "DistilBERT-size"
    group = f"Operator-norm ranking of all {n_maps} linear maps, {size} random init"
    # Full size: one exact SVD pass takes minutes on a small CPU, so time single calls there.
    opts = {} if b.quick else {"repeat": 1, "warmup": 0}
    ref = "exact SVD (batched svdvals)"
    out: dict[str, dict[str, float]] = {}

    def run(name: str, **kw: object) -> None:
        out[name] = operator_norms(
            model, **kw
        )  # keep the last result: no extra pass for the metrics

    b.time(ref, lambda: run(ref, method="svd"), group=group, **opts)
    exact = out[ref]
    cases = {"exact Gram eigenvalues (eigvalsh)": {"method": "gram"}}
    for n_iter in (30, 100, 300):
        cases[f"power iteration, {n_iter} iterations"] = {
            "method": "power",
            "n_iter": n_iter,
            "tol": 0.0,
        }
    for name, kw in cases.items():
        b.time(name, lambda name=name, kw=kw: run(name, **kw), group=group, reference=ref, **opts)
        got = out[name]
        rel = max(abs(got[n] - exact[n]) / exact[n] for n in exact)
        top5 = len(set(_rank(got)[:5]) & set(_rank(exact)[:5]))
        same = sum(a == c for a, c in zip(_rank(got), _rank(exact), strict=True))
        b.metric(f"{name}: max relative error vs SVD", rel, unit="", group=group)
        b.metric(
            f"{name}: ranks equal to SVD's",
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
    opts = {} if b.quick else {"repeat": 3}
    ref = "sparse_kfac(p=50), all modules"
    b.time(ref, lambda: sparse_kfac(model, 50), group=group, **opts)
    b.time(
        "sparse_kfac(p=50, sequential=True)",
        lambda: sparse_kfac(model, 50, sequential=True),
        group=group,
        reference=ref,
        **opts,
    )
    b.time(
        "largest_magnitude(10 %) (global top-k)",
        lambda: largest_magnitude(model, 10),
        group=group,
        reference=ref,
        repeat=1 if not b.quick else None,
        warmup=0 if not b.quick else None,
    )
    s = sparse_kfac(model, 50)
    b.metric(
        "sparse_kfac(p=50): percent of countable parameters",
        s.percent_of(model),
        unit="%",
        group=group,
    )
