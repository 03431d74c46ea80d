"""KFAC / S-KFAC factor fitting on a DistilBERT-size classifier (random init) against a forward+backward pass.

Rows (one run, ratios only between rows of this run):

* KFAC fit time over the same batches relative to a plain forward+backward (loss summed, all parameter
  gradients): empirical and one-sample MC fisher with ``reduce`` (target ≤ 1.3×); the exact fisher per class
  count (one backward pass per class); ``expand``.
* Achieved FLOP/s of the factor accumulation (the ``δᵀδ`` and ``xᵀx`` matmuls of every linear map, at the sizes
  a fit meets) against the machine's own square-matmul throughput.
* S-KFAC at p = 10: factor floats relative to full KFAC (target ≤ 1/50) and fit time.
* laplace-torch ``KronLaplace`` (curvlinops EF backend) fit on the same model and batches as a peer.
"""

from __future__ import annotations

import time

import torch
from benchharness import Bench
from torch import nn

from partialbayes.curvature import kfac
from partialbayes.curvature._kfac import FactorAccumulator
from partialbayes.selection import linear_modules, modules, sparse_kfac


def _config(b: Bench, num_labels: int):
    from transformers import DistilBertConfig

    if b.quick:
        return DistilBertConfig(
            vocab_size=100,
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=64,
            num_labels=num_labels,
        )
    return DistilBertConfig(num_labels=num_labels)  # DistilBERT-base sizes: 768 / 3072, 6 layers


def _model(b: Bench, num_labels: int = 2) -> nn.Module:
    from transformers import DistilBertForSequenceClassification

    torch.manual_seed(0)
    return DistilBertForSequenceClassification(_config(b, num_labels)).to(b.device).eval()


def _loader(b: Bench, vocab: int, num_labels: int = 2) -> list[dict[str, torch.Tensor]]:
    n_batches, batch, length = (2, 4, 16) if b.quick else (1, 16, 128)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(1, vocab, (batch, length), generator=g)
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        out.append(
            {
                "input_ids": (ids * mask).to(b.device),
                "attention_mask": mask.to(b.device),
                "labels": torch.randint(0, num_labels, (batch,), generator=g).to(b.device),
            }
        )
    return out


def _fwd_bwd(model: nn.Module, loader) -> None:
    for batch in loader:
        model.zero_grad(set_to_none=True)
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        loss = nn.functional.cross_entropy(out.logits, batch["labels"], reduction="sum")
        loss.backward()
    model.zero_grad(set_to_none=True)


def _rep(b: Bench) -> int:
    """Fewer repeats for the slow fits in a quick run."""
    return 2 if b.quick else b.repeat


def _floats(subset) -> int:
    """Floats of the factors ``G [r, r]`` and ``A [c(+1), c(+1)]`` of a Kronecker subset."""
    return sum(
        k.n_rows**2 + (k.n_cols + (k.bias_name is not None)) ** 2
        for k in subset.kron_modules().values()
    )


def bench_kfac_fit(b: Bench) -> None:
    group = "KFAC fit, DistilBERT-size config" + (" (quick: tiny)" if b.quick else "")
    model = _model(b)
    loader = _loader(b, model.config.vocab_size)
    full = modules(model, list(linear_modules(model)))
    f32 = torch.float32
    b.time("forward+backward", lambda: _fwd_bwd(model, loader), group=group)
    for name, kw in [
        ("KFAC empirical, reduce", dict(fisher="empirical")),
        ("KFAC mc=1, reduce", dict(fisher="mc", generator=torch.Generator().manual_seed(0))),
        ("KFAC empirical, expand", dict(fisher="empirical", sharing="expand")),
        ("KFAC exact (2 classes), reduce", dict(fisher="exact")),
    ]:
        b.time(
            name,
            lambda kw=kw: kfac(model, loader, full, dtype=f32, **kw),
            group=group,
            reference="forward+backward",
            floats=_floats(full),
            repeat=_rep(b),
            warmup=1 if b.quick else 0,
        )
    model3 = _model(b, num_labels=3)
    loader3 = _loader(b, model3.config.vocab_size, 3)
    full3 = modules(model3, list(linear_modules(model3)))
    b.time("forward+backward (3 classes)", lambda: _fwd_bwd(model3, loader3), group=group)
    b.time(
        "KFAC exact (3 classes), reduce",
        lambda: kfac(model3, loader3, full3, dtype=f32, fisher="exact"),
        group=group,
        reference="forward+backward (3 classes)",
        repeat=_rep(b),
        warmup=1 if b.quick else 0,
    )

    sk = sparse_kfac(model, 10)
    b.time(
        "S-KFAC p=10 mc=1, reduce",
        lambda: kfac(
            model, loader, sk, dtype=f32, fisher="mc", generator=torch.Generator().manual_seed(0)
        ),
        group=group,
        reference="forward+backward",
        floats=_floats(sk),
        repeat=_rep(b),
        warmup=1 if b.quick else 0,
    )
    b.metric(
        "S-KFAC p=10 factor floats / full KFAC floats",
        _floats(sk) / _floats(full),
        unit="ratio (target ≤ 0.02)",
        group=group,
    )
    _peer(b, group, model, loader)


def _peer(b: Bench, group: str, model: nn.Module, loader) -> None:
    if not b.has("laplace") or not b.has("curvlinops"):
        b.skip(
            "laplace-torch KronLaplace (EF)",
            group=group,
            reason="laplace-torch / curvlinops not installed",
        )
        return
    from laplace import KronLaplace
    from laplace.curvature import CurvlinopsEF

    class Wrapped(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, data):
            return self.m(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits

    wrapped = Wrapped(model).eval()
    lin = {f"m.{n}" for n in linear_modules(model)}
    for (
        n,
        p,
    ) in (
        wrapped.named_parameters()
    ):  # laplace-torch cannot handle embeddings / LayerNorm: freeze them
        p.requires_grad_(n.rsplit(".", 1)[0] in lin)

    from torch.utils.data import DataLoader

    data = DataLoader(
        loader, batch_size=None
    )  # laplace-torch needs a DataLoader (it reads .dataset)

    def fit() -> None:
        la = KronLaplace(wrapped, "classification", backend=CurvlinopsEF)
        la.fit(data)

    try:
        b.time(
            "laplace-torch KronLaplace (EF)",
            fit,
            group=group,
            reference="KFAC empirical, reduce",
            repeat=_rep(b),
            warmup=1 if b.quick else 0,
        )
    except Exception as err:
        b.skip(
            "laplace-torch KronLaplace (EF)",
            group=group,
            reason=f"failed: {type(err).__name__}: {err}"[:200],
        )
    finally:
        for p in wrapped.parameters():
            p.requires_grad_(True)


def _matmul_flops(b: Bench, n: int) -> float:
    a = torch.randn(n, n, device=b.device)
    c = torch.randn(n, n, device=b.device)
    for _ in range(2):
        a @ c
    reps = 3 if b.quick else 5
    if b.device.type == "cuda":
        torch.cuda.synchronize(b.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ c
    if b.device.type == "cuda":
        torch.cuda.synchronize(b.device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def bench_accumulation_flops(b: Bench) -> None:
    group = "factor accumulation throughput" + (" (quick: tiny)" if b.quick else "")
    model = _model(b)
    batch, length = (4, 16) if b.quick else (16, 128)
    dims = [(m.weight.shape[0], m.weight.shape[1]) for m in linear_modules(model).values()]
    peak = _matmul_flops(b, 512 if b.quick else 2048)
    b.metric("square matmul (float32)", peak / 1e9, unit="GFLOP/s", group=group)
    for sharing, rows in [("reduce", batch), ("expand", batch * length)]:
        acc = [FactorAccumulator(r, c, torch.float32, b.device) for r, c in dims]
        xs = [torch.randn(rows, c, device=b.device) for _, c in dims]
        ds = [torch.randn(rows, r, device=b.device) for r, _ in dims]
        flops = sum(2 * rows * (r * r + c * c) for r, c in dims)

        def run(acc=acc, xs=xs, ds=ds, rows=rows) -> None:
            for a, x, d in zip(acc, xs, ds, strict=True):
                a.add(x, rows, d)

        t = b.time(f"accumulate factors, {sharing} ({rows} rows / map)", run, group=group)
        b.metric(f"achieved, {sharing}", flops / t / 1e9, unit="GFLOP/s", group=group)
        b.metric(f"achieved / matmul, {sharing}", flops / t / peak, unit="ratio", group=group)
