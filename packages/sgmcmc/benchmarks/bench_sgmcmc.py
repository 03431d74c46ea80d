"""A sampler step against ``torch.optim.SGD(momentum)``'s step: the update alone, and a whole training step."""

from __future__ import annotations

import math

import torch
from benchharness import Bench
from torch import nn

from partialbayes.selection import KronBlock, Subset
from partialbayes.sgmcmc import SGMCMC

SGD = "torch.optim.SGD(momentum=0.9).step()"


def _mlp(b: Bench) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    width, depth, batch = (64, 2, 32) if b.quick else (1024, 4, 256)  # 4 x 1024² ≈ 4.2 M weights
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(b.device)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model, x.to(b.device), y.to(b.device)


def _subset(model: nn.Module, fraction: float) -> Subset:
    """Every parameter (fraction 1) or the first ⌈√f·n⌉ rows and columns of each weight and its biases."""
    blocks = {}
    for name, p in model.named_parameters():
        r = math.ceil(math.sqrt(fraction) * p.shape[0])
        if fraction == 1:
            blocks[name] = KronBlock()
        elif p.ndim == 2:
            blocks[name] = KronBlock(
                rows=torch.arange(r), cols=torch.arange(math.ceil(math.sqrt(fraction) * p.shape[1]))
            )
        else:
            blocks[name] = KronBlock(rows=torch.arange(r))
    return Subset.from_model(model, blocks)


def bench_step(b: Bench) -> None:
    model, x, y = _mlp(b)
    n = sum(p.numel() for p in model.parameters())
    group = f"SGMCMC update vs SGD, MLP with {n:,} weights (gradients given)"
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    repeat = 5 if b.quick else 20
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    b.time(SGD, sgd.step, group=group, repeat=repeat)
    noise = torch.empty(n, device=b.device)  # what T > 0 adds: one normal per entry
    b.time(
        "normal_ of every weight (the draw alone)",
        noise.normal_,
        group=group,
        reference=SGD,
        repeat=repeat,
    )
    whole = _subset(model, 1.0)
    for method, temperature in [
        ("sghmc", 0.0),
        ("sghmc", 1.0),
        ("sgld", 1.0),
        ("sgnht", 1.0),
        ("baoa", 1.0),
    ]:
        sampler = SGMCMC(
            model,
            whole,
            lr=1e-4,
            num_data=10_000,
            method=method,
            temperature=temperature,
            burn_in=10**9,
        )
        b.time(
            f"{method}, T={temperature:g}, every weight",
            sampler.step,
            group=group,
            reference=SGD,
            repeat=repeat,
        )
    part = _subset(model, 0.1)
    sampler = SGMCMC(model, part, lr=1e-4, num_data=10_000, temperature=1.0, burn_in=10**9)
    b.time(
        "sghmc, T=1, 10 % subset (gather/scatter)",
        sampler.step,
        group=group,
        reference=SGD,
        repeat=repeat,
        note=f"d={part.num_entries():,}",
    )

    group = f"SGMCMC training step vs SGD, MLP with {n:,} weights, batch {x.shape[0]}"

    def train_step(opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    b.time("forward + backward + SGD step", lambda: train_step(sgd), group=group, repeat=repeat)
    sampler = SGMCMC(model, whole, lr=1e-4, num_data=10_000, temperature=1.0, burn_in=10**9)
    b.time(
        "forward + backward + SGHMC step (T=1)",
        lambda: train_step(sampler),
        group=group,
        reference="forward + backward + SGD step",
        repeat=repeat,
    )
