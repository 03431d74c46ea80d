"""Issue #27 (one rule for all families), the curvature part: each test fails on the 0.3 behaviour.

* ``swapped`` restores what the model held on entry (nested swaps, weights the user changed since fit);
* an empty batch is refused by name on plain modules (Diag / Dense failed inside ``_jacobians``);
* label -100 skips the output for sequence-level outputs too, a batch without a labelled output is
  skipped with one warning, and a loader of such batches only is refused;
* ``fit_curvature`` refuses a factor that is negative beyond round-off instead of clamping it;
* a model on the ``meta`` device is refused by name at construction.
"""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset, random_factors

from partialbayes.curvature import (
    DenseLaplace,
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    diag_curvature,
    kfac,
)
from partialbayes.selection import last_layer, sparse_kfac

CLASSES = [KronLaplace, DiagLaplace, DenseLaplace]


def _fitted(cls, device="cpu"):
    model = TinyNet(0).to(device).eval()
    x, y = classification_data(12, 0)
    return cls(model, kron_subset(model)).fit([(x.to(device), y.to(device))])


def _entries(la):
    params = dict(la.model.named_parameters())
    return {n: la.subset.gather(n, params[n].detach()).clone() for n in la.subset.names}


# ----------------------------------------------------------------------------- swapping
@pytest.mark.parametrize("cls", CLASSES)
def test_nested_swapped_restores_the_outer_sample(cls, device):
    """0.3 wrote the fitted MAP back when the inner context closed, not the outer sample."""
    la = _fitted(cls, device)
    g = torch.Generator(device=device).manual_seed(0)
    outer, inner = ({k: v[i] for k, v in la.sample(2, generator=g).items()} for i in (0, 1))
    before = _entries(la)
    with la.swapped(outer):
        with la.swapped(inner):
            for n, v in _entries(la).items():
                torch.testing.assert_close(v, inner[n].to(v))
        for n, v in _entries(la).items():
            torch.testing.assert_close(v, outer[n].to(v))
    for n, v in _entries(la).items():
        assert torch.equal(v, before[n])


@pytest.mark.parametrize("cls", CLASSES)
def test_sampled_after_the_user_changed_the_weights_restores_the_users_weights(cls):
    """0.3 restored the MAP saved at fit, silently undoing the user's edit."""
    la = _fitted(cls)
    with torch.no_grad():
        la.model.l2.weight.add_(0.25)
    edited = {n: p.detach().clone() for n, p in la.model.named_parameters()}
    with pytest.raises(RuntimeError, match="boom"), la.sampled(generator=torch.Generator()):
        raise RuntimeError("boom")
    for n, p in la.model.named_parameters():
        assert torch.equal(p.detach(), edited[n]), n


# ----------------------------------------------------------------------------- empty batches
def _plain_data():
    x, y = classification_data(6, 0)
    return [(x[:3], y[:3]), (x[:0], y[:0]), (x[3:], y[3:])]


@pytest.mark.parametrize(
    "call",
    [
        lambda m, data: diag_curvature(m, data, kron_subset(m)),
        lambda m, data: dense_curvature(m, data, kron_subset(m)),
        lambda m, data: kfac(m, data, kron_subset(m)),
        lambda m, data: DiagLaplace(m, kron_subset(m)).fit(data),
        lambda m, data: DenseLaplace(m, last_layer(m)).fit(data),
    ],
)
def test_an_empty_batch_is_refused_naming_it(call):
    """0.3: Diag / Dense failed in _jacobians with a raw reshape error of 0 elements."""
    with pytest.raises(ValueError, match=r"batch 1: empty batch"):
        call(TinyNet(0).eval(), _plain_data())


@pytest.mark.parametrize("cls", CLASSES)
def test_an_empty_batch_is_refused_by_the_predictive(cls):
    la = _fitted(cls)
    x, y = classification_data(3, 1)
    for call in (
        lambda: la.predict(x[:0]),
        lambda: la.logit_mean_cov(x[:0]),
        lambda: la.optimize_prior_precision("val_nll", val_loader=[(x, y), (x[:0], y[:0])]),
    ):
        with pytest.raises(ValueError, match="empty batch"):
            call()


# ----------------------------------------------------------------------------- label -100
def _bert():
    return tiny_model("bert", seed=0, num_labels=3).double().eval()


def _batch(seed, labels):
    g = torch.Generator().manual_seed(seed)
    b = len(labels)
    return {
        "input_ids": torch.randint(1, 30, (b, 6), generator=g),
        "attention_mask": torch.ones(b, 6, dtype=torch.long),
        "labels": torch.tensor(labels),
    }


def _labelled(batch):
    keep = batch["labels"] != -100
    return {k: v[keep] for k, v in batch.items()}


@pytest.mark.parametrize("cls", CLASSES)
def test_sequence_level_minus_100_skips_the_example(cls):
    """0.3 refused label -100 on [B, C] outputs ('labels out of range'); SWAG ignored it. One rule now."""
    model = _bert()
    subset = sparse_kfac(model, 30) if cls is not DenseLaplace else last_layer(model)
    data = [_batch(0, [0, -100, 2, 1]), _batch(1, [-100, 1, 1])]
    la = cls(model, subset).fit(data)
    ref = cls(model, subset).fit([_labelled(b) for b in data])
    assert la.n_data == ref.n_data == 5
    assert la.map_loss == pytest.approx(ref.map_loss)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    test = _batch(2, [2, -100, 0])
    f, cov = la.logit_mean_cov(test)  # the labelled outputs only
    f_ref, cov_ref = ref.logit_mean_cov(_labelled(test))
    torch.testing.assert_close(f, f_ref)
    torch.testing.assert_close(cov, cov_ref)
    assert la.predict(test).shape == (3, 3)  # predict ignores labels: every example
    grid = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(
        la.grid_val_nll([test], grid), ref.grid_val_nll([_labelled(test)], grid)
    )


def test_a_batch_labelled_minus_100_only_is_skipped_with_one_warning():
    model = _bert()
    subset = sparse_kfac(model, 30)
    good, none = _batch(0, [0, 1, 2]), _batch(1, [-100, -100])
    with pytest.warns(UserWarning, match="skipped 2 of 3 batches with no labelled outputs") as rec:
        la = KronLaplace(model, subset).fit([none, good, none])
    assert len(rec) == 1
    assert rec[0].filename == __file__
    ref = KronLaplace(model, subset).fit([good])
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    with pytest.raises(ValueError, match=r"every batch of the loader \(2\) has no labelled output"):
        KronLaplace(model, subset).fit([none, none])
    with pytest.raises(ValueError, match="every output of the batch is labelled -100"):
        la.logit_mean_cov(none)
    with pytest.warns(UserWarning, match="skipped 1 of 2 validation batches"):
        la.optimize_prior_precision("val_nll", val_loader=[none, good], grid=[0.5, 1.0])
    with pytest.raises(ValueError, match="every batch of val_loader"):
        la.optimize_prior_precision("val_nll", val_loader=[none], grid=[0.5, 1.0])


# ----------------------------------------------------------------------------- factors far from PSD
@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 500), scale=st.sampled_from([1e-3, 1.0, 1e6]))
def test_a_factor_negative_beyond_round_off_is_refused(seed, scale):
    """0.3 clamped the eigenvalues of -1e6 × (a PSD matrix) to 0 and fitted a wrong posterior silently."""
    model = TinyNet(0)
    la = KronLaplace(model, kron_subset(model))
    factors = random_factors(la, seed)
    factors["c1"].G = -scale * factors["c1"].G
    with pytest.raises(ValueError, match=r"module 'c1'.*G is not positive semi-definite.*-1 times"):
        la.fit_curvature(factors, map_loss=1.0, n_data=4, n_outputs=3)
    dense = DenseLaplace(model, kron_subset(model))
    p = dense.subset.num_entries()
    x = torch.randn(p, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"H is not positive semi-definite"):
        dense.fit_curvature(-scale * x @ x.T, map_loss=1.0, n_data=4, n_outputs=3)
    diag = DiagLaplace(model, kron_subset(model))
    h = {n: torch.rand(diag.subset.num_entries(n), dtype=torch.float64) for n in diag.subset.names}
    h["l0.weight"][0] = -scale
    with pytest.raises(ValueError, match=r"'l0.weight' \(module 'l0'\) has negative entries"):
        diag.fit_curvature(h, map_loss=1.0, n_data=4, n_outputs=3)


def test_round_off_below_zero_is_still_clamped():
    """A rank-deficient PSD factor has eigenvalues of order -ε·max: they are round-off and clamped."""
    model = TinyNet(0)
    la = KronLaplace(model, kron_subset(model))
    factors = random_factors(la, 3, rank=1)  # rank 1: every other eigenvalue is 0 up to round-off
    la.fit_curvature(factors, map_loss=1.0, n_data=4, n_outputs=3)
    assert all(bool((f.s >= 0).all()) for g, a in la._eig.values() for f in (g, a))


# ----------------------------------------------------------------------------- the meta device
@pytest.mark.parametrize("cls", CLASSES)
def test_a_model_on_the_meta_device_is_refused_by_name(cls):
    """0.3: `Tensor.item() cannot be called on meta tensors`, far from the cause."""
    model = TinyNet(0).to("meta")
    with pytest.raises(ValueError, match=r"parameter 'l0.weight' of TinyNet is on the meta device"):
        cls(model, kron_subset(TinyNet(0)))
