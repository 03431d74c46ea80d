"""Accuracy of the minibatch solvers against the closed form, as the epoch budget and batch size vary.

The problem of the issue-#16 test: float64 regression with n = 400 Gaussian features, d = 60, β = 25,
α = 2.7, k = 2,000 samples of N(0, H⁻¹). For each solver, batch size and fixed epoch budget (``tol=0``) it
prints the trace of the sample covariance over ``tr(H⁻¹)`` (the sampling error of this ratio is about
±0.4 % at k = 2,000; the exact minimisers of the same draws give the reference ratio), and the relative
error of the samples in the norm of ``H`` against those exact minimisers. Then the epochs the default
solver needs to meet its default tolerance.

Usage::

    uv run --frozen python packages/linear-sampling/benchmarks/sgd_accuracy.py
"""

from __future__ import annotations

import math

import torch

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    posterior_samples,
)

N, D, BETA, ALPHA, K = 400, 60, 25.0, 2.7, 2000
BATCHES = (32, 100, 256, 400)
EPOCHS = (5, 10, 20, 40, 100)


def main() -> None:
    """Print the tables (markdown)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(N, D, generator=g, dtype=torch.float64)
    feats = Features.dense(phi)
    noise, prior = NoisePrecision(BETA), Prior(ALPHA)
    h = BETA * phi.T @ phi + ALPHA * torch.eye(D, dtype=torch.float64)
    trace = float(torch.linalg.inv(h).trace())

    def run(**kw: object) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        return posterior_samples(feats, noise, prior, K, generator=gen, **kw).samples  # type: ignore[arg-type]

    exact = run(method="cg", tol=1e-12)

    def ratio(z: torch.Tensor) -> float:
        return float((z * z).sum() / K) / trace

    def error(z: torch.Tensor) -> float:
        e = z - exact
        return math.sqrt(float((e * (h @ e)).sum() / (exact * (h @ exact)).sum()))

    print(f"exact minimisers (CG): trace ratio {ratio(exact):.4f}\n")
    print("| solver | batch | " + " | ".join(f"{e} epochs" for e in EPOCHS) + " |")
    print("|---|---|" + "---|" * len(EPOCHS))
    for name, vr in (("variance-reduced (default)", True), ("plain SGD + Polyak", False)):
        for b in BATCHES:
            cells = []
            for e in EPOCHS:
                z = run(sgd=SGDConfig(batch_size=b, max_epochs=e, tol=0.0, variance_reduction=vr))
                cells.append(f"{ratio(z):.3f} ({error(z):.0e})")
            print(f"| {name} | {b} | " + " | ".join(cells) + " |")
    print("\n| batch | epochs to the default tol | error bound | true error | trace ratio |")
    print("|---|---|---|---|---|")
    for b in BATCHES:
        gen = torch.Generator().manual_seed(1)
        out = posterior_samples(feats, noise, prior, K, generator=gen, sgd=SGDConfig(batch_size=b))
        epochs = out.info.history[-1]["epoch"]
        print(
            f"| {b} | {epochs:g} | {out.info.error_bound:.1e} | {error(out.samples):.1e} "
            f"| {ratio(out.samples):.4f} |"
        )


if __name__ == "__main__":
    main()
