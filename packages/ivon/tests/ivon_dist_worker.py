"""Worker of the two-process gloo test (a plain module so that spawned processes can import it)."""

import os

import torch
import torch.distributed as dist

from partialbayes.ivon import IVON

HYPER = dict(lr=0.1, ess=8.0, beta2=0.9, hess_init=0.5)


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    return model, x, y


#: Rank r's examples in the weighted run: rank 0 the first 5, rank 1 the last 3.
SPLIT = (slice(0, 5), slice(5, 8))


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for weighted in (False, True):
            model, x, y = _setup()
            if weighted:  # each rank its own minibatch, of its own size
                x, y = x[SPLIT[rank]], y[SPLIT[rank]]
            opt = IVON(
                model.parameters(), generator=torch.Generator().manual_seed(100 + rank), **HYPER
            )
            for _ in range(3):
                with opt.sampled_params(train=True, batch_size=len(x) if weighted else None):
                    ((model(x) - y) ** 2).mean().backward()
                opt.step()
            name = f"rank{rank}{'-weighted' if weighted else ''}.pt"
            torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, name))
    finally:
        dist.destroy_process_group()
