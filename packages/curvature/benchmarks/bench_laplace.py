"""Laplace posteriors: linearised predictive against laplace-torch's KronLaplace; floats per posterior type.

Throughput and peak memory are compared with laplace-torch (curvlinops backend) on the same MLP, posterior
and data.

To compare the predictive alone, our KronLaplace is built from laplace-torch's own Kronecker factors
(``fit_curvature``), so both sides hold the same posterior; the largest difference of their functional
variances is reported as a check. The MLP has no biases (laplace-torch keeps biases as separate blocks, we
fold them into A).
"""

from __future__ import annotations

import math

import torch
from benchharness import Bench
from torch import nn

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace
from partialbayes.selection import KronBlock, Subset, linear_modules


def _setup(b: Bench):
    d_in, width, classes, n_train, batch = (
        (16, 32, 4, 64, 16) if b.quick else (128, 512, 10, 512, 64)
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(d_in, width, bias=False),
        nn.Tanh(),
        nn.Linear(width, width, bias=False),
        nn.Tanh(),
        nn.Linear(width, classes, bias=False),
    ).to(b.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train, d_in, generator=g).to(b.device)
    y = torch.randint(0, classes, (n_train,), generator=g).to(b.device)
    loader = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n_train, batch)]
    x_test = torch.randn(batch, d_in, generator=g).to(b.device)
    return model, loader, x_test


def _all_weights(model: nn.Module) -> Subset:
    return Subset.from_model(model, {f"{n}.weight": KronBlock() for n in linear_modules(model)})


def _skfac(model: nn.Module, percent: float) -> Subset:
    blocks = {}
    for n, m in linear_modules(model).items():
        n_out, n_in = m.weight.shape
        blocks[f"{n}.weight"] = KronBlock(
            rows=torch.arange(math.ceil(percent * n_out / 100)),
            cols=torch.arange(math.ceil(percent * n_in / 100)),
        )
    return Subset.from_model(model, blocks)


def bench_predictive(b: Bench) -> None:
    model, loader, x_test = _setup(b)
    size = "tiny MLP" if b.quick else "MLP 128-512-512-10"
    group = f"Linearised probit predictive, {size}, batch {x_test.shape[0]}"
    subset = _all_weights(model)
    ours = KronLaplace(model, subset, prior_precision=1.0, dtype=torch.float32)
    b.time("forward", lambda: model(x_test), group=group)
    if not b.has("laplace"):
        b.skip("laplace-torch KronLaplace", group=group, reason="laplace-torch not installed")
        ours.fit(loader)
        b.time(
            "partialbayes KronLaplace",
            lambda: ours.predict(x_test),
            group=group,
            reference="forward",
            floats=ours.num_floats,
        )
        return
    from laplace import KronLaplace as PeerKron
    from laplace.curvature import CurvlinopsGGN

    peer = PeerKron(model, "classification", backend=CurvlinopsGGN, prior_precision=1.0)
    x_all = torch.cat([x for x, _ in loader])
    y_all = torch.cat([y for _, y in loader])
    peer_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_all, y_all), batch_size=len(loader[0][1])
    )
    peer.fit(peer_loader, progress_bar=False)
    factors = {
        m: type("F", (), {"G": kf[0], "A": kf[1]})()
        for m, kf in zip(ours.modules, peer.H_facs.kfacs, strict=True)
    }
    n = sum(len(y) for _, y in loader)
    ours.fit_curvature(
        factors, map_loss=float(peer.loss), n_data=n, n_outputs=int(model(x_test).shape[1])
    )

    def peer_fn():
        return peer(x_test, pred_type="glm", link_approx="probit")

    t_peer = b.time(
        "laplace-torch KronLaplace",
        peer_fn,
        group=group,
        reference="forward",
        floats=sum(f.numel() for kf in peer.H_facs.kfacs for f in kf),
    )
    t_ours = b.time(
        "partialbayes KronLaplace",
        lambda: ours.predict(x_test),
        group=group,
        reference="laplace-torch KronLaplace",
        floats=ours.num_floats,
    )
    b.metric("throughput ratio (ours / laplace-torch)", t_peer / t_ours, unit="x", group=group)
    _, f_var = peer._glm_predictive_distribution(x_test)
    _, cov = ours.logit_mean_cov(x_test)
    b.metric(
        "max |Σ_f ours - Σ_f laplace-torch| / max |Σ_f|",
        float((cov - f_var).abs().max() / f_var.abs().max()),
        unit="",
        group=group,
        note="same factors, same prior: agreement check",
    )
    b.metric(
        "|log det P ours - laplace-torch| / |log det P|",
        float(abs(ours.log_det() - peer.log_det_posterior_precision) / abs(ours.log_det())),
        unit="",
        group=group,
    )
    with torch.no_grad():
        theirs = peer_fn()
        mine = ours.predict(x_test)
    b.metric(
        "max |probit ours - laplace-torch|",
        float((theirs - mine).abs().max()),
        unit="",
        group=group,
    )


def bench_memory(b: Bench) -> None:
    """Floats stored by each posterior type on the same MLP (all weights; S-KFAC 10 %; last layer dense)."""
    model, loader, _ = _setup(b)
    group = f"Posterior memory, {'tiny MLP' if b.quick else 'MLP 128-512-512-10'}"
    all_w = _all_weights(model)
    n_params = all_w.num_entries()
    b.metric("parameters (all weights)", n_params, unit="floats", group=group)
    last = Subset.from_model(model, {"4.weight": KronBlock()})
    cases = [
        ("KronLaplace, all weights (KFAC)", KronLaplace, all_w),
        ("KronLaplace, S-KFAC p=10", KronLaplace, _skfac(model, 10)),
        ("DiagLaplace, all weights", DiagLaplace, all_w),
        ("DenseLaplace, last layer", DenseLaplace, last),
    ]
    for name, cls, subset in cases:
        try:
            post = cls(model, subset, dtype=torch.float32).fit(loader)
        except ImportError as err:  # the curvature routine is not available in this checkout
            b.skip(name, group=group, reason=str(err))
            continue
        b.metric(
            name, post.num_floats, unit="floats", group=group, note=f"{subset.num_entries()} params"
        )


class _DictLogits(nn.Module):
    """laplace-torch calls ``model(X)`` with the whole dict batch: drop the labels, return the logits."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, batch: dict) -> torch.Tensor:
        return self.hf(**{k: v for k, v in batch.items() if k != "labels"}).logits


def bench_predictive_transformer(b: Bench) -> None:
    """DistilBERT-style classifier, every linear map stochastic (what laplace-torch can do on HF models)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from partialbayes.selection import modules

    if b.quick:
        dims, n_layers, batch, length = (32, 64), 2, 4, 16
    else:
        dims, n_layers, batch, length = (128, 512), 2, 16, 64
    config = DistilBertConfig(
        vocab_size=1000, dim=dims[0], n_layers=n_layers, n_heads=4, hidden_dim=dims[1]
    )
    config.num_labels = 2
    torch.manual_seed(0)
    hf = DistilBertForSequenceClassification(config).to(b.device).eval()
    g = torch.Generator().manual_seed(0)

    def make_batch():
        return {
            "input_ids": torch.randint(0, 1000, (batch, length), generator=g).to(b.device),
            "attention_mask": torch.ones(batch, length, dtype=torch.long, device=b.device),
            "labels": torch.randint(0, 2, (batch,), generator=g).to(b.device),
        }

    loader = [make_batch() for _ in range(2)]
    test = make_batch()
    group = (
        f"Linearised probit predictive, DistilBERT-style d={dims[0]}, {n_layers} layers, "
        f"batch {batch}x{length}, all linear maps"
    )
    subset = modules(hf, list(linear_modules(hf)))
    ours = KronLaplace(hf, subset, dtype=torch.float32).fit(loader)
    with torch.no_grad():
        b.time(
            "forward", lambda: hf(**{k: v for k, v in test.items() if k != "labels"}), group=group
        )
    b.time(
        "partialbayes KronLaplace",
        lambda: ours.predict(test),
        group=group,
        reference="forward",
        floats=ours.num_floats,
        repeat=3,
    )
    if not b.has("laplace"):
        b.skip("laplace-torch KronLaplace", group=group, reason="laplace-torch not installed")
        return
    from laplace import KronLaplace as PeerKron
    from laplace.curvature import CurvlinopsGGN

    wrapped = _DictLogits(hf)
    linear_params = set(subset.names)
    for name, p in wrapped.hf.named_parameters():
        p.requires_grad_(name in linear_params)  # laplace-torch refuses embeddings and LayerNorm
    try:
        peer = PeerKron(wrapped, "classification", backend=CurvlinopsGGN, prior_precision=1.0)

        class _Loader(list):
            dataset = range(sum(len(x["labels"]) for x in loader))

        peer.fit(_Loader(loader), progress_bar=False)
        b.time(
            "laplace-torch KronLaplace",
            lambda: peer(test, pred_type="glm", link_approx="probit"),
            group=group,
            reference="partialbayes KronLaplace",
            repeat=1 if not b.quick else 2,
            warmup=0 if not b.quick else 1,
            note="ratio = laplace-torch / ours",
        )
    finally:
        for p in hf.parameters():
            p.requires_grad_(True)
