"""Tiny models and subsets shared by the SGMCMC tests (exposed as the ``helpers`` fixture)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from partialbayes.selection import KronBlock, MaskBlock, Subset


class TinyNet(nn.Module):
    """Two linear maps; forward(input_ids-free) takes ``x`` and returns an object with ``.logits``."""

    def __init__(self, n_in=4, hidden=5, n_out=3):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def tiny_net(seed=0, dtype=torch.float64, device="cpu", **kw):
    torch.manual_seed(seed)
    return TinyNet(**kw).to(device=device, dtype=dtype)


def partial_subset(model, seed=0):
    """fc1.weight: rows {0, 2} x cols {1, 3}; fc1.bias: entries {0, 2}; fc2.weight: a random mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(model.fc2.weight.shape, generator=g) < 0.5
    mask[0, 0] = True
    return Subset.from_model(
        model,
        {
            "fc1.weight": KronBlock(rows=torch.tensor([0, 2]), cols=torch.tensor([1, 3])),
            "fc1.bias": KronBlock(rows=torch.tensor([0, 2])),
            "fc2.weight": MaskBlock(mask),
        },
    )


def gathered(model, subset):
    """Concatenated subset.gather of every subset parameter (the reference flat layout)."""
    params = dict(model.named_parameters())
    return torch.cat([subset.gather(n, params[n].detach().cpu()) for n in subset.names])


def x_batches(model, n_batches=4, batch=8, seed=0, n_in=4, n_out=3):
    """Plain (non-HF) batches for ``loss_fn``-based training: dicts with ``x`` and ``labels``."""
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters())
    return [
        {
            "x": torch.randn(batch, n_in, generator=g).to(p.device, p.dtype),
            "labels": torch.randint(0, n_out, (batch,), generator=g).to(p.device),
        }
        for _ in range(n_batches)
    ]


def x_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


@pytest.fixture(scope="session")
def helpers():
    return SimpleNamespace(
        tiny_net=tiny_net,
        partial_subset=partial_subset,
        gathered=gathered,
        x_batches=x_batches,
        x_loss=x_loss,
    )
