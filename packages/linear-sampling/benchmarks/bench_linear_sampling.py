"""Sample-then-optimise against the dense closed form (Cholesky) as the number of parameters d grows.

The model is random-Fourier-feature regression, y_n = Φ_n θ + η_n with Φ_n = cos(W x_n + c) / sqrt(d): the
features are an operator computed batch by batch (memory O(b·d)), never an n × d or d × d matrix. The dense
closed form accumulates H = βΦᵀΦ + αI (d² floats), factors it and draws k samples L⁻ᵀξ; sample-then-optimise
runs a fixed budget of SGD epochs on the low-variance objective with k samples jointly (O(d·k) floats).
"""

from __future__ import annotations

import math

import torch
from benchharness import Bench

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    posterior_samples,
)

BETA, ALPHA, K, P = 4.0, 1.0, 8, 8


def rff_features(n: int, d: int, device: torch.device, seed: int = 0) -> tuple[Features, object]:
    """Random-Fourier features computed on the fly: ``Φ_idx = cos(X_idx Wᵀ + c) / sqrt(d)``, m = 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, P, generator=g).to(device)
    w = torch.randn(d, P, generator=g).to(device)
    c = (2 * math.pi * torch.rand(d, generator=g)).to(device)
    scale = 1.0 / math.sqrt(d)

    def phi(idx: torch.Tensor) -> torch.Tensor:
        return torch.cos(x[idx] @ w.T + c) * scale  # [b, d]

    def jvp(idx: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (phi(idx) @ z).unsqueeze(1)

    def vjp(idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return phi(idx).T @ v[:, 0, :]

    return Features(jvp, vjp, n, 1, d, torch.float32, device, check_finite=False), phi


def dense_closed_form(feats: Features, phi, batch_size: int, k: int) -> torch.Tensor:
    """K samples of N(0, H⁻¹) by Cholesky: accumulate H in d² floats, factor, solve Lᵀ z = ξ."""
    d, device = feats.d, feats.device
    h = ALPHA * torch.eye(d, device=device)
    for start in range(0, feats.n, batch_size):
        p = phi(torch.arange(start, min(start + batch_size, feats.n), device=device))
        h.addmm_(p.T, p, alpha=BETA)
    chol = torch.linalg.cholesky(h)
    xi = torch.randn(d, k, device=device)
    return torch.linalg.solve_triangular(chol.T, xi, upper=True)


def sampled(feats: Features, epochs: int, batch_size: int, k: int) -> torch.Tensor:
    config = SGDConfig(batch_size=batch_size, max_epochs=epochs, tol=0.0)  # fixed budget
    out = posterior_samples(
        feats,
        NoisePrecision(BETA),
        Prior(ALPHA),
        k,
        method="sgd",
        sgd=config,
        generator=torch.Generator().manual_seed(0),
    )
    return out.samples


def _free_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return 0


def bench_crossover(b: Bench) -> None:
    torch.manual_seed(0)
    n = 512 if b.quick else 4096
    epochs = 2 if b.quick else 10
    batch = 256 if b.quick else 512
    sizes = [250, 1000] if b.quick else [1000, 2000, 4000, 8000, 12000, 100_000]
    for d in sizes:
        group = f"samples of N(0, H⁻¹), n={n}, k={K}, d={d}"
        feats, phi = rff_features(n, d, b.device)
        dense_bytes = 4 * d * d * 3  # H, its factor, and the work space
        repeat = 1 if d >= 4000 else 3
        if d > 20000 or (_free_bytes() and dense_bytes > 0.5 * _free_bytes()):
            b.skip(
                "dense Cholesky closed form",
                group=group,
                reason=f"needs {d * d:,} floats for H alone ({4 * d * d / 2**30:.0f} GiB in float32)",
            )
            reference = None
        else:
            b.time(
                "dense Cholesky closed form",
                lambda feats=feats, phi=phi: dense_closed_form(feats, phi, batch, K),
                group=group,
                floats=d * d,
                repeat=repeat,
                warmup=0 if d >= 4000 else 1,
            )
            reference = "dense Cholesky closed form"
        budget = 2 if d >= 50_000 else epochs  # d = 10^5: a shorter budget keeps the run in minutes
        b.time(
            f"sample-then-optimise ({budget} epochs)",
            lambda feats=feats, budget=budget: sampled(feats, budget, batch, K),
            group=group,
            reference=reference,
            floats=4 * d * K + d * (P + 1),
            repeat=1 if d >= 8000 else repeat,
            warmup=0 if d >= 8000 else 1,
            note="z, momentum, average, θⁿ: 4·d·k; features regenerated per batch",
        )


def bench_epoch_scaling(b: Bench) -> None:
    # One solver call of one epoch: with the variance-reduced default that is one minibatch pass plus
    # two full passes (the initial residual and the check).
    group = "one-epoch solve, low-variance objective (k=8): time / (n·d)"
    grid = (
        [(512, 250), (1024, 500), (2048, 500)]
        if b.quick
        else [
            (2048, 1000),
            (4096, 1000),
            (4096, 4000),
            (8192, 4000),
            (16384, 4000),
        ]
    )
    for n, d in grid:
        feats, _ = rff_features(n, d, b.device)
        # λ_max(H) <= β Σ_n ‖Φ_n‖² <= β n: a fixed safe step, no power iteration inside the timed epoch
        config = SGDConfig(lr=0.5 / (BETA * n), batch_size=256, max_epochs=1, tol=0.0)

        def epoch(feats: Features = feats, config: SGDConfig = config) -> None:
            posterior_samples(
                feats,
                NoisePrecision(BETA),
                Prior(ALPHA),
                K,
                method="sgd",
                sgd=config,
                generator=torch.Generator().manual_seed(0),
            )

        seconds = b.time(f"n={n}, d={d}", epoch, group=group, repeat=3, warmup=1)
        b.metric(f"n={n}, d={d}: ns per n·d", 1e9 * seconds / (n * d), unit="ns", group=group)


def bench_accuracy(b: Bench) -> None:
    """How far the fixed epoch budget of the crossover table is from the exact samples (same draws, CG)."""
    n, d = (512, 250) if b.quick else (4096, 1000)
    group = f"sample-then-optimise accuracy vs CG (same θ⁰, ε), n={n}, d={d}, k={K}"
    feats, _ = rff_features(n, d, b.device)
    exact = posterior_samples(
        feats,
        NoisePrecision(BETA),
        Prior(ALPHA),
        K,
        method="cg",
        tol=1e-6,
        batch_size=256,
        generator=torch.Generator().manual_seed(0),
    ).samples
    for epochs in [2, 10] if b.quick else [10, 40]:
        approx = sampled(feats, epochs, 512 if not b.quick else 256, K)
        err = float((approx - exact).norm() / exact.norm())
        b.metric(f"{epochs} epochs: ‖z − z_CG‖ / ‖z_CG‖", err, unit="", group=group)
