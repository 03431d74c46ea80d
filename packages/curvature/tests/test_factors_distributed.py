"""Two gloo CPU processes on two shards give the single-process factors (G summed, A averaged by counts).

Also the posteriors: a fit on uneven shards gives the single-process training loss, ``n_data``, evidence and
tuned prior, and an error on one rank fails both ranks instead of leaving the other waiting.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from partialbayes.curvature import (
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
)
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


def _regression(shards):
    """The same inputs with real targets ``[B, 3]``."""
    g = torch.Generator().manual_seed(2)
    return [
        [(x, torch.randn(x.shape[0], 3, generator=g, dtype=torch.float64)) for x, _ in shard]
        for shard in shards
    ]


def _posteriors(model, loader, reg_loader):
    """Evidence of posteriors fitted from one-shot iterators over ``loader`` (and ``reg_loader``)."""
    s = modules(model, ["0", "2"])
    sd = Subset.from_model(model, {"2.weight": KronBlock()})
    kron = KronLaplace(model, s, prior_precision=0.5).fit(iter(loader))
    diag = DiagLaplace(model, sd, prior_precision=0.5).fit(iter(loader))
    reg = KronLaplace(model, s, likelihood="regression", sigma_noise=0.7).fit(iter(reg_loader))
    out = {}
    for name, la in {"kron": kron, "diag": diag, "reg": reg}.items():
        out[name] = {
            "map_loss": la.map_loss,
            "n_data": la.n_data,
            "n_outputs": la.n_outputs,
            "lml": la.log_marginal_likelihood().detach(),
            "prior": la.optimize_prior_precision(),
        }
    return out


def _run(model, loader, reg_loader):
    s = modules(model, ["0", "2"])
    f = kfac(model, loader, s, fisher="exact")
    sd = Subset.from_model(model, {"2.weight": KronBlock()})
    return {
        "G": {m: v.G for m, v in f.items()},
        "A": {m: v.A for m, v in f.items()},
        "n": {m: v.n_examples for m, v in f.items()},
        "diag": diag_curvature(model, loader, sd)["2.weight"],
        "dense": dense_curvature(model, loader, sd),
        "posteriors": _posteriors(model, loader, reg_loader),
    }


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, shards = _problem()
        torch.save(_run(model, shards[rank], _regression(shards)[rank]), f"{out}.{rank}")
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
    reg = _regression(shards)
    ref = _run(model, shards[0] + shards[1], reg[0] + reg[1])
    for r in range(2):
        got = torch.load(f"{tmp_path / 'res'}.{r}")
        for m in ref["G"]:
            torch.testing.assert_close(got["G"][m], ref["G"][m])
            torch.testing.assert_close(got["A"][m], ref["A"][m])
            assert got["n"][m] == 7
        torch.testing.assert_close(got["diag"], ref["diag"])
        torch.testing.assert_close(got["dense"], ref["dense"])
        for name, want in ref["posteriors"].items():
            have = got["posteriors"][name]
            assert (have["n_data"], have["n_outputs"]) == (7, 3), name
            assert have["map_loss"] == pytest.approx(want["map_loss"], rel=1e-12), name
            torch.testing.assert_close(have["lml"], want["lml"])
            assert have["prior"] == want["prior"], name
    assert not os.environ.get("RANK")  # the parent never joined a process group


def _failing_worker(rank: int, init: str, out: str, routine: str, fisher: str) -> None:
    """Rank 1 holds a batch with a label out of range; both ranks must raise (no hang, no broken group)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, shards = _problem()
        loader = shards[rank]
        if rank == 1:
            x, y = loader[0]
            loader = [(x, y + 3)]
        s = modules(model, ["0", "2"])
        sd = Subset.from_model(model, {"2.weight": KronBlock()})
        try:
            if routine == "fit":
                KronLaplace(model, s, fisher=fisher).fit(loader)
            else:
                diag_curvature(model, loader, sd, fisher=fisher)
            msg = "no error"
        except (ValueError, RuntimeError) as err:
            msg = f"{type(err).__name__}: {err}"
        Path(f"{out}.{rank}").write_text(msg)
        dist.barrier()  # both ranks went through the same collectives: the group is still usable
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("routine", "fisher"), [("fit", "exact"), ("diag", "empirical")])
def test_an_error_on_one_rank_fails_every_rank(tmp_path, routine, fisher):
    init = f"file://{tmp_path / 'rendezvous'}"
    ctx = mp.get_context("fork")
    out = str(tmp_path / "msg")
    procs = [
        ctx.Process(target=_failing_worker, args=(r, init, out, routine, fisher)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "a rank hung waiting for the rank that raised"
    assert all(p.exitcode == 0 for p in procs)
    msgs = [Path(f"{out}.{r}").read_text() for r in range(2)]
    assert msgs[1].startswith("ValueError: batch 0: labels must lie in")
    assert msgs[0].startswith("RuntimeError: 1 other rank(s) raised")
