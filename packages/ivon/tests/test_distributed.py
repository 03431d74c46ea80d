"""Data-parallel IVON with two gloo CPU processes: per-rank noise, averaged gradient and Hessian estimate."""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from ivon_dist_worker import HYPER, _setup, _worker
from ivon_reference import reference_ivon


@pytest.mark.slow
def test_two_ranks_agree_and_match_two_sample_reference(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    model, x, y = _setup()

    def loss_fn(ws):
        w1, b1, w2, b2 = ws
        return (((torch.tanh(x @ w1.T + b1) @ w2.T + b2) - y) ** 2).mean()

    gens = [torch.Generator().manual_seed(100), torch.Generator().manual_seed(101)]
    ref_m, _ = reference_ivon(
        [p.detach() for p in model.parameters()], loss_fn, 3, mc_samples=2, generators=gens, **HYPER
    )
    for a, b, m in zip(r0, r1, ref_m, strict=True):
        assert torch.equal(a, b)  # every rank takes the same step
        torch.testing.assert_close(
            a, m, rtol=1e-10, atol=1e-12
        )  # = one process with the two ranks' noise
