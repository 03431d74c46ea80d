"""Optional oracle: curvlinops' KFAC operator on small models (skipped when curvlinops is not installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import SeqNet

from partialbayes.curvature import kfac
from partialbayes.selection import modules

pytestmark = pytest.mark.peers


def _curvlinops_block(model, x, y, module, fisher, approx, separate=False):
    curvlinops = pytest.importorskip("curvlinops")
    m = model.get_submodule(module)
    params = [m.weight, m.bias]
    op = curvlinops.KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(reduction="sum"),
        params,
        [(x, y)],
        fisher_type=fisher,
        kfac_approx=approx,
        separate_weight_and_bias=separate,
        check_deterministic=False,
    )
    p = sum(t.numel() for t in params)
    return op @ torch.eye(p, dtype=torch.float64)


def _ours_in_param_order(f, n_out, n_in):
    """Our block on vec([W | b]) row-major, permuted to curvlinops' [vec(W), b] order."""
    k = torch.kron(f.G, f.A)
    c = n_in + 1
    perm = torch.empty(n_out * c, dtype=torch.long)
    for i in range(n_out):
        for j in range(c):
            perm[i * n_in + j if j < n_in else n_out * n_in + i] = i * c + j
    return k[perm][:, perm]


@pytest.mark.parametrize(("fisher", "ours"), [("type-2", "exact"), ("empirical", "empirical")])
@pytest.mark.parametrize("module", ["0", "2"])
def test_mlp_matches_curvlinops(fisher, ours, module):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    ref = _curvlinops_block(model, x, y, module, fisher, "expand")
    f = kfac(model, [(x, y)], modules(model, [module]), fisher=ours)[module]
    n_out, n_in = model.get_submodule(module).weight.shape
    torch.testing.assert_close(_ours_in_param_order(f, n_out, n_in), ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("sharing", ["reduce", "expand"])
def test_sequences_match_curvlinops(sharing):
    torch.manual_seed(0)
    model = SeqNet(3, 4, 2).double().eval()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    ref = _curvlinops_block(model, x, y, "lin2", "type-2", sharing)
    f = kfac(model, [(x, y)], modules(model, ["lin2"]), fisher="exact", sharing=sharing)["lin2"]
    torch.testing.assert_close(_ours_in_param_order(f, 4, 4), ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("sharing", ["reduce", "expand"])
def test_separate_bias_matches_curvlinops(sharing):
    """Our ``bias="separate"`` is curvlinops' ``separate_weight_and_bias=True``: ``G ⊗ A`` and ``G ⊗ [1]``."""
    torch.manual_seed(1)
    model = SeqNet(3, 4, 2).double().eval()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    ref = _curvlinops_block(model, x, y, "lin2", "type-2", sharing, separate=True)
    s = modules(model, ["lin2"])
    f = kfac(model, [(x, y)], s, fisher="exact", sharing=sharing, bias="separate")["lin2"]
    ours = torch.block_diag(torch.kron(f.G, f.A), torch.kron(f.G, f.A_bias))
    torch.testing.assert_close(ours, ref, rtol=1e-8, atol=1e-10)
