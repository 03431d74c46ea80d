"""The strategies and the Subset follow the model's device (cpu, and cuda when present)."""

import torch
from torch import nn

from partialbayes.selection import (
    KronBlock,
    MaskBlock,
    Subset,
    largest_magnitude,
    random_parameters,
    sparse_kfac,
)
from partialbayes.selection._norms import operator_norms


def model_on(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().to(device)


def test_strategies_match_cpu(device):
    cpu, dev = model_on("cpu"), model_on(device)
    for p in (10, 50, 90):
        assert sparse_kfac(dev, p) == sparse_kfac(cpu, p)
        assert sparse_kfac(dev, p, sequential=True) == sparse_kfac(cpu, p, sequential=True)
        assert largest_magnitude(dev, p) == largest_magnitude(cpu, p)
        assert random_parameters(dev, p, seed=1) == random_parameters(cpu, p, seed=1)
    for method in ("svd", "power"):
        a, b = operator_norms(dev, method=method), operator_norms(cpu, method=method)
        assert list(a) == list(b)
        for n in a:
            assert abs(a[n] - b[n]) <= 1e-9 * b[n]


def test_gather_scatter_on_device(device):
    model = model_on(device)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 2] = mask[2, 0] = True
    s = Subset.from_model(
        model, {"0.weight": KronBlock([0, 4], [1, 5]), "2.weight": MaskBlock(mask)}
    )
    for name, p in model.named_parameters():
        if name not in s:
            continue
        got = s.gather(name, p.detach())
        assert got.device == p.device
        assert torch.equal(got.cpu(), p.detach().cpu()[s.mask(name)])
        out = s.scatter(name, torch.zeros_like(got), p.detach())
        assert out.device == p.device
        assert int((out == 0).sum()) == s.num_entries(name)
