"""`LaplaceBase.fit`: one pass over the loader, seeded MC fisher, validated labels and options, warnings."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset

from partialbayes.curvature import (
    DenseLaplace,
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
)

POSTERIORS = [KronLaplace, DiagLaplace, DenseLaplace]
ROUTINES = {KronLaplace: kfac, DiagLaplace: diag_curvature, DenseLaplace: dense_curvature}


class CountingLoader:
    """A re-iterable loader that counts how often it is iterated."""

    def __init__(self, batches):
        self.batches = batches
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return iter(self.batches)


def _data(likelihood, device, n=9, seed=0):
    x, y = classification_data(n, seed)
    if likelihood == "regression":
        g = torch.Generator().manual_seed(seed + 1)
        y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    x, y = x.to(device), y.to(device)
    return x, y, [(x[:4], y[:4]), (x[4:7], y[4:7]), (x[7:], y[7:])]


def _state(la):
    return {k: v.clone() for k, v in la._state().items()}


def _assert_same_state(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.mark.parametrize("cls", POSTERIORS)
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_fit_reads_the_loader_once_and_a_generator_gives_the_list_result(cls, likelihood, device):
    model = TinyNet(0).to(device).eval()
    subset = kron_subset(model)
    x, y, batches = _data(likelihood, device)
    opts = {"likelihood": likelihood, "prior_precision": 0.7, "sigma_noise": 0.6}

    counting = CountingLoader(batches)
    ref = cls(model, subset, **opts).fit(counting)
    assert counting.reads == 1
    from_gen = cls(model, subset, **opts).fit(b for b in batches)
    from_iter = cls(model, subset, **opts).fit(iter(list(batches)))

    # dense float64 reference of the training loss at the MAP, and the evidence from fit_curvature
    with torch.no_grad():
        f = model(x)
    if likelihood == "classification":
        hand = torch.nn.functional.cross_entropy(f, y, reduction="sum").item()
    else:
        hand = ((f - y) ** 2).sum().item()
    curv = ROUTINES[cls](
        model, batches, subset, likelihood=likelihood, sigma_noise=0.6, dtype=torch.float64
    )
    manual = cls(model, subset, **opts).fit_curvature(curv, map_loss=hand, n_data=9, n_outputs=3)
    for la in (ref, from_gen, from_iter):
        assert (la.n_data, la.n_outputs) == (9, 3)
        assert la.map_loss == pytest.approx(hand, rel=1e-12)
        _assert_same_state(_state(la), _state(manual))
        torch.testing.assert_close(la.log_marginal_likelihood(), manual.log_marginal_likelihood())


@pytest.mark.parametrize("cls", POSTERIORS)
def test_fit_generator_seeds_the_mc_fisher(cls, device):
    model = TinyNet(1).to(device).eval()
    subset = kron_subset(model)
    _, _, batches = _data("classification", device, seed=1)

    def fitted(seed):
        la = cls(model, subset, fisher="mc", mc_samples=2)
        return la.fit(iter(batches), generator=torch.Generator().manual_seed(seed))

    a, b, c = fitted(7), fitted(7), fitted(8)
    _assert_same_state(_state(a), _state(b), rtol=0, atol=0)
    assert any(not torch.equal(v, _state(c)[k]) for k, v in _state(a).items())
    # fit passes the generator on to the curvature routine unchanged
    curv = ROUTINES[cls](
        model,
        batches,
        subset,
        fisher="mc",
        mc_samples=2,
        generator=torch.Generator().manual_seed(7),
    )
    direct = cls(model, subset).fit_curvature(curv, map_loss=a.map_loss, n_data=9, n_outputs=3)
    _assert_same_state(_state(a), _state(direct), rtol=0, atol=0)
    with pytest.raises(TypeError, match="generator"):
        cls(model, subset, fisher="mc").fit(batches, generator=7)


@pytest.mark.parametrize("cls", POSTERIORS)
@pytest.mark.parametrize("fisher", ["exact", "mc", "empirical"])
def test_fit_rejects_bad_labels_naming_the_batch(cls, fisher):
    model = TinyNet(0).eval()
    subset = kron_subset(model)
    x, y = classification_data(6, 0)
    good = (x[:3], y[:3])

    def fit(bad, likelihood="classification"):
        la = cls(model, subset, likelihood=likelihood, fisher=fisher)
        return la.fit(iter([good, bad]))

    with pytest.raises(
        ValueError, match=r"batch 1: labels must lie in \[0, 3\); got values in \[0, 5\]"
    ):
        fit((x[3:], torch.tensor([0, 5, 1])))
    with pytest.raises(ValueError, match=r"batch 1: labels must lie in .* got values in \[-1"):
        fit((x[3:], torch.tensor([0, -1, 1])))
    with pytest.raises(TypeError, match="batch 1: labels must be an integer tensor"):
        fit((x[3:], y[3:].double()))
    with pytest.raises(ValueError, match=r"batch 1: labels must have shape \[3\]"):
        fit((x[3:], y[3:, None]))
    with pytest.raises(ValueError, match=r"batch 1: .*needs labels"):
        fit(x[3:])
    # int32 labels are class indices too
    ok = cls(model, subset, fisher=fisher).fit([good, (x[3:], y[3:].int())])
    ref = cls(model, subset, fisher=fisher).fit([good, (x[3:], y[3:])])
    assert ok.map_loss == pytest.approx(ref.map_loss)
    reg_good = (x[:3], torch.zeros(3, 3, dtype=torch.float64))
    reg = cls(model, subset, likelihood="regression", fisher=fisher)
    with pytest.raises(ValueError, match=r"batch 1: regression targets of shape \(3, 2\)"):
        reg.fit([reg_good, (x[3:], torch.zeros(3, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match=r"batch 1: regression targets of shape \(9,\)"):
        reg.fit([reg_good, (x[3:], torch.zeros(9, dtype=torch.float64))])
    with pytest.raises(ValueError, match="batch 1: regression targets are not finite"):
        reg.fit([reg_good, (x[3:], torch.full((3, 3), float("nan"), dtype=torch.float64))])


@pytest.mark.parametrize("cls", POSTERIORS)
def test_val_nll_rejects_bad_labels_naming_the_batch(cls):
    model = TinyNet(0).eval()
    subset = kron_subset(model)
    x, y = classification_data(6, 0)
    la = cls(model, subset).fit([(x, y)])
    val = [(x[:3], y[:3])]
    with pytest.raises(ValueError, match=r"batch 1: labels must lie in \[0, 3\)"):
        la.optimize_prior_precision("val_nll", val_loader=[*val, (x[3:], y[3:] + 3)])
    with pytest.raises(TypeError, match="batch 1: labels must be an integer tensor"):
        la.optimize_prior_precision("val_nll", val_loader=[*val, (x[3:], y[3:].float())])
    reg = cls(model, subset, likelihood="regression")
    reg.fit([(x, torch.zeros(6, 3, dtype=torch.float64))])
    with pytest.raises(ValueError, match=r"batch 0: regression targets of shape \(3, 2\)"):
        reg.optimize_prior_precision("val_nll", val_loader=[(x[:3], torch.zeros(3, 2))])
    # the check leaves good labels alone: int32 labels give the int64 result
    grid = [0.5, 5.0]
    a = la.grid_val_nll([(x, y.int())], torch.tensor(grid))
    b = la.grid_val_nll([(x, y)], torch.tensor(grid))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls", POSTERIORS)
def test_mc_samples_must_be_a_positive_int(cls):
    """One options object: the posteriors refuse what kfac refuses, with the same error (one rule: a wrong
    type is a TypeError, a value out of range a ValueError)."""
    model = TinyNet(0)
    subset = kron_subset(model)
    x, y = classification_data(4, 0)
    for bad in (True, False, 2.0, "3", None, 0, -2):
        error = TypeError if isinstance(bad, bool) or not isinstance(bad, int) else ValueError
        with pytest.raises(error, match="mc_samples must be"):
            cls(model, subset, mc_samples=bad)
        with pytest.raises(error, match="mc_samples must be"):
            kfac(model, [(x, y)], subset, fisher="mc", mc_samples=bad)
    assert cls(model, subset, mc_samples=3).mc_samples == 3


@pytest.mark.parametrize("cls", POSTERIORS)
def test_training_mode_warning_points_at_the_callers_line(cls):
    model = TinyNet(0).train()
    subset = kron_subset(model)
    x, y = classification_data(4, 0)
    with pytest.warns(UserWarning, match="training mode") as record:
        cls(model, subset).fit([(x, y)])
    assert record[0].filename == __file__
    assert model.training
    with pytest.warns(UserWarning, match="training mode") as record:
        ROUTINES[cls](model, [(x, y)], subset)
    assert record[0].filename == __file__
