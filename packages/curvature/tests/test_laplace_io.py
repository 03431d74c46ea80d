"""Save / load round trips and refusals for every Laplace posterior type."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset, random_factors

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace
from partialbayes.selection import KronBlock, Subset


def _fitted(cls, model):
    subset = kron_subset(model)
    la = cls(model, subset, prior_precision={"l0": 0.5, "c1": 2.0, "l2": 1.0}, temperature=0.8)
    g = torch.Generator().manual_seed(1)
    p = subset.num_entries()
    if cls is KronLaplace:
        curv = random_factors(la, 1)
    elif cls is DiagLaplace:
        curv = {
            n: torch.rand(subset.num_entries(n), generator=g, dtype=torch.float64)
            for n in subset.names
        }
    else:
        x = torch.randn(p, p, generator=g, dtype=torch.float64)
        curv = x @ x.T
    la.fit_curvature(curv, map_loss=3.0, n_data=9, n_outputs=3)
    return la


@pytest.mark.parametrize("cls", [KronLaplace, DiagLaplace, DenseLaplace])
def test_round_trip(cls, tmp_path, device):
    model = TinyNet(0).to(device)
    la = _fitted(cls, model)
    path = tmp_path / "post.safetensors"
    la.save(path)
    assert b"pickle" not in path.read_bytes()[:64]
    fresh = TinyNet(0).to(device)  # same weights, a new instance
    back = cls.load(path, fresh)
    assert type(back) is cls
    assert back.modules == la.modules
    assert back.device.type == la.device.type == torch.device(device).type
    torch.testing.assert_close(back.prior_precision, la.prior_precision)
    torch.testing.assert_close(back.log_marginal_likelihood(), la.log_marginal_likelihood())
    x, _ = classification_data(4, 0)
    x = x.to(device)
    torch.testing.assert_close(back.logit_mean_cov(x)[1], la.logit_mean_cov(x)[1])
    s1 = la.sample(3, generator=torch.Generator().manual_seed(5))
    s2 = back.sample(3, generator=torch.Generator().manual_seed(5))
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k])
    assert back.num_floats == la.num_floats
    assert back.summary() == la.summary()


def test_refuses_mismatched_model_and_files(tmp_path):
    la = _fitted(KronLaplace, TinyNet(0))
    path = tmp_path / "post.safetensors"
    la.save(path)
    with pytest.raises(ValueError, match="does not match"):
        KronLaplace.load(path, TinyNet(0, n_classes=4))
    with pytest.raises(ValueError, match="holds a KronLaplace"):
        DiagLaplace.load(path, TinyNet(0))
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a saved"):
        KronLaplace.load(other, TinyNet(0))
    # Issue 34: other weights used to be only a warning, then the predictive ran on the mismatch.
    with pytest.raises(ValueError, match=r"differ from the saved MAP .*check_weights=False"):
        KronLaplace.load(path, TinyNet(1))
    anyway = KronLaplace.load(path, TinyNet(1), check_weights=False)
    torch.testing.assert_close(anyway.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_save_requires_fit(tmp_path):
    model = TinyNet(0)
    la = KronLaplace(model, Subset.from_model(model, {"l2.weight": KronBlock()}))
    with pytest.raises(RuntimeError, match="not fitted"):
        la.save(tmp_path / "x.safetensors")
