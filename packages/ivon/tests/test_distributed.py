"""Data-parallel IVON with two gloo CPU processes: per-rank noise, averaged gradient and Hessian estimate,
weighted by the ranks' minibatch sizes (Shen et al., 2024, Alg. 1 note)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from ivon_dist_worker import HYPER, SPLIT, _setup, _worker
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

    # ranks with minibatches of 5 and 3 examples: one process with two samples weighted 5:3 (not 1:1)
    w0 = torch.load(tmp_path / "rank0-weighted.pt")
    w1 = torch.load(tmp_path / "rank1-weighted.pt")

    def rank_loss(part):
        def loss_fn(ws):
            w1_, b1, w2, b2 = ws
            out = torch.tanh(x[part] @ w1_.T + b1) @ w2.T + b2
            return ((out - y[part]) ** 2).mean()

        return loss_fn

    gens = [torch.Generator().manual_seed(100), torch.Generator().manual_seed(101)]
    ref_w, _ = reference_ivon(
        [p.detach() for p in model.parameters()], [rank_loss(s) for s in SPLIT], 3, mc_samples=2,
        generators=gens, weights=[5, 3], **HYPER,
    )  # fmt: skip
    gens = [torch.Generator().manual_seed(100), torch.Generator().manual_seed(101)]
    equal_w, _ = reference_ivon(
        [p.detach() for p in model.parameters()], [rank_loss(s) for s in SPLIT], 3, mc_samples=2,
        generators=gens, **HYPER,
    )  # fmt: skip
    for a, b, m in zip(w0, w1, ref_w, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, m, rtol=1e-10, atol=1e-12)
    assert max((a - e).abs().max().item() for a, e in zip(w0, equal_w, strict=True)) > 1e-4
