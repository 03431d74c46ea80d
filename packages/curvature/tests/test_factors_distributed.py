"""Two gloo CPU processes on two shards give the single-process factors (G summed, A averaged by counts)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partialbayes.curvature import dense_curvature, diag_curvature, kfac
from partialbayes.selection import KronBlock, Subset, modules

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed with fork"
)


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    # uneven shards: rank 0 gets 5 examples in two batches, rank 1 gets 2
    shards = [[(x[:3], y[:3]), (x[3:5], y[3:5])], [(x[5:], y[5:])]]
    return model, shards


def _run(model, loader):
    s = modules(model, ["0", "2"])
    f = kfac(model, loader, s, fisher="exact")
    sd = Subset.from_model(model, {"2.weight": KronBlock()})
    return {
        "G": {m: v.G for m, v in f.items()},
        "A": {m: v.A for m, v in f.items()},
        "n": {m: v.n_examples for m, v in f.items()},
        "diag": diag_curvature(model, loader, sd)["2.weight"],
        "dense": dense_curvature(model, loader, sd),
    }


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, shards = _problem()
        torch.save(_run(model, shards[rank]), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_single_process(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(r, init, str(tmp_path / "res"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    model, shards = _problem()
    ref = _run(model, shards[0] + shards[1])
    for r in range(2):
        got = torch.load(f"{tmp_path / 'res'}.{r}")
        for m in ref["G"]:
            torch.testing.assert_close(got["G"][m], ref["G"][m])
            torch.testing.assert_close(got["A"][m], ref["A"][m])
            assert got["n"][m] == 7
        torch.testing.assert_close(got["diag"], ref["diag"])
        torch.testing.assert_close(got["dense"], ref["dense"])
    assert not os.environ.get("RANK")  # the parent never joined a process group
