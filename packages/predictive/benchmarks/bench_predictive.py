"""Throughput of the predictive approximations and of the metrics, with laplace-torch / torchmetrics peers.

Sizes: metrics over 10^6 predictions (C = 10), link approximations over 10^5 examples with C = 2 and
C = 10 (``b.quick``: 10x smaller). float32, as models produce.
"""

from __future__ import annotations

import torch
from benchharness import Bench

from partialbayes.predictive import (
    auroc,
    brier,
    decompose_classification,
    ece,
    fit_temperature,
    laplace_bridge,
    mc_predictive,
    nll,
    probit,
)

DT = torch.float32
N_MC = 100


def _gaussian_logits(n: int, c: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mu = 2 * torch.randn(n, c, generator=g, dtype=DT)
    a = torch.randn(n, c, c, generator=g, dtype=DT) / c**0.5
    cov = a @ a.mT + 0.05 * torch.eye(c, dtype=DT)
    return mu.to(device), cov.to(device)


class _LaplaceStub:
    """Feeds given (f_mu, f_var) to laplace-torch's own predictive code path (BaseLaplace methods)."""

    likelihood = "classification"

    def __init__(self, mu: torch.Tensor, cov: torch.Tensor) -> None:
        self._mu, self._cov = mu, cov
        self._device, self._dtype = mu.device, mu.dtype

    def _glm_predictive_distribution(self, x: object, joint: bool = False):
        return self._mu.clone(), self._cov.clone()


def _laplace_predictive(mu: torch.Tensor, cov: torch.Tensor, link: str) -> torch.Tensor:
    from laplace.baselaplace import BaseLaplace

    stub = _LaplaceStub(mu, cov)
    stub._glm_predictive_samples = BaseLaplace._glm_predictive_samples.__get__(stub)
    stub._glm_functional_samples = BaseLaplace._glm_functional_samples.__get__(stub)
    return BaseLaplace._glm_forward_call(
        stub, None, "classification", link_approx=link, n_samples=N_MC
    )


def _bench_links(b: Bench, c: int) -> None:
    n = 10_000 if b.quick else 100_000
    group = f"Gaussian-logit predictive, N={n:,} examples, C={c}, full covariance, float32"
    mu, cov = _gaussian_logits(n, c, b.device)
    gen = torch.Generator(device=b.device)
    t = b.time("partialbayes probit", lambda: probit(mu, cov), group=group)
    b.metric("probit throughput", n / t, unit="examples/s", group=group)
    b.time(
        "partialbayes Laplace bridge",
        lambda: laplace_bridge(mu, cov),
        group=group,
        reference="partialbayes probit",
    )
    t_mc = b.time(
        f"partialbayes MC (S={N_MC}, Cholesky)",
        lambda: mc_predictive(mu, cov, N_MC, generator=gen.manual_seed(0)),
        group=group,
        reference="partialbayes probit",
        repeat=3,
    )
    b.metric(f"MC (S={N_MC}) throughput", n / t_mc, unit="examples/s", group=group)
    if not b.has("laplace"):
        for name in ("probit", "bridge", "mc"):
            b.skip(f"laplace-torch {name}", group=group, reason="laplace-torch not installed")
    else:
        b.time(
            "laplace-torch probit",
            lambda: _laplace_predictive(mu, cov, "probit"),
            group=group,
            reference="partialbayes probit",
        )
        b.time(
            "laplace-torch bridge",
            lambda: _laplace_predictive(mu, cov, "bridge"),
            group=group,
            reference="partialbayes Laplace bridge",
        )
        b.time(
            f"laplace-torch MC (S={N_MC})",
            lambda: _laplace_predictive(mu, cov, "mc"),
            group=group,
            reference=f"partialbayes MC (S={N_MC}, Cholesky)",
            repeat=3,
        )
    # Accuracy of the deterministic links against a 20k-sample MC reference on 1000 examples.
    sub_mu, sub_cov = mu[:1000].double(), cov[:1000].double()
    sub_cov = 0.5 * (
        sub_cov + sub_cov.mT
    )  # float32 round-off asymmetry is beyond float64's tolerance
    ref = mc_predictive(sub_mu, sub_cov, 20_000, generator=gen.manual_seed(1))
    for name, p in (
        ("probit", probit(sub_mu, sub_cov)),
        ("bridge", laplace_bridge(sub_mu, sub_cov)),
    ):
        err = (p - ref).abs().sum(-1).mean().item()
        b.metric(f"{name}: mean L1 distance to MC (S=20k)", err, unit="", group=group)


def bench_links_c2(b: Bench) -> None:
    _bench_links(b, 2)


def bench_links_c10(b: Bench) -> None:
    _bench_links(b, 10)


def bench_metrics(b: Bench) -> None:
    n, c = (100_000 if b.quick else 1_000_000), 10
    group = f"metrics, N={n:,} predictions, C={c}, float32"
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(n, c, generator=g, dtype=DT)).to(b.device)
    probs = torch.softmax(logits, -1)
    labels = torch.multinomial(torch.softmax(logits.cpu() / 1.5, -1), 1, generator=g).squeeze(1)
    labels = labels.to(b.device)
    scores = -probs.max(-1).values
    wrong = probs.argmax(-1) != labels
    t = b.time(
        "partialbayes NLL + Brier", lambda: (nll(probs, labels), brier(probs, labels)), group=group
    )
    b.metric("NLL + Brier throughput", n / t, unit="predictions/s", group=group)
    b.time(
        "partialbayes ECE equal-width (20 bins)",
        lambda: ece(probs, labels, binning="equal_width"),
        group=group,
    )
    b.time(
        "partialbayes ECE equal-mass (20 bins)",
        lambda: ece(probs, labels, binning="equal_mass"),
        group=group,
        reference="partialbayes ECE equal-width (20 bins)",
    )
    b.time("partialbayes AUROC (misclassification)", lambda: auroc(scores, wrong), group=group)
    s, m = 10, n // 10
    samples = logits[:m] + 0.5 * torch.randn(s, m, c, generator=g, dtype=DT).to(b.device)
    b.time(
        f"partialbayes decomposition (S={s}, N={m:,})",
        lambda: decompose_classification(samples),
        group=group,
        repeat=3,
    )
    val = min(n, 100_000)
    b.time(
        f"partialbayes temperature fit (N={val:,})",
        lambda: fit_temperature(logits[:val], labels[:val]),
        group=group,
        repeat=3,
    )
    if not b.has("torchmetrics"):
        b.skip("torchmetrics ECE equal-width", group=group, reason="torchmetrics not installed")
        b.skip("torchmetrics binary AUROC", group=group, reason="torchmetrics not installed")
        return
    from torchmetrics.functional.classification import binary_auroc, multiclass_calibration_error

    b.time(
        "torchmetrics ECE equal-width (20 bins)",
        lambda: multiclass_calibration_error(probs, labels, num_classes=c, n_bins=20),
        group=group,
        reference="partialbayes ECE equal-width (20 bins)",
    )
    b.time(
        "torchmetrics binary AUROC",
        lambda: binary_auroc(scores, wrong.long()),
        group=group,
        reference="partialbayes AUROC (misclassification)",
    )
