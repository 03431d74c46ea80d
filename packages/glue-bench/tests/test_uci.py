import math
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.glue_bench.data_uci import UCISplit
from partialbayes.glue_bench.store import fingerprint, iter_records
from partialbayes.glue_bench.uci import (
    PROTOCOLS,
    UCI_METHODS,
    fit_map,
    gaussian_metrics,
    run_uci,
    run_uci_cell,
)

# A small literature-style protocol: validation part, every choice on it, a tiny network.
TINY = replace(
    PROTOCOLS["literature"],
    width=8,
    epochs=60,
    patience=20,
    weight_decay=(1e-4, 1e-2),
    swag_lrs=(1e-2, 3e-2),
    swag_steps=20,
    n_samples=5,
)


def synthetic_split(n=80, n_test=40, d=3, noise=0.3, seed=0, val=20):
    """A standardised regression split ``y = sin(x) sum + noise`` with a validation part of ``val`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + n_test + val, d, generator=g, dtype=torch.float64)
    y = torch.sin(x).sum(1) + noise * torch.randn(len(x), generator=g, dtype=torch.float64)
    y_std = float(y[:n].std())
    y = (y - float(y[:n].mean())) / y_std
    parts = dict(x_train=x[:n], y_train=y[:n], x_test=x[n : n + n_test], y_test=y[n : n + n_test])
    if val:
        parts.update(x_val=x[n + n_test :], y_val=y[n + n_test :])
    return UCISplit(**parts, y_mean=0.0, y_std=y_std)


def test_gaussian_metrics_reference():
    mean = torch.tensor([0.0, 1.0], dtype=torch.float64)
    var = torch.tensor([1.0, 4.0], dtype=torch.float64)
    y = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out = gaussian_metrics(mean, var, y, y_std=2.0)
    assert out["rmse"] == pytest.approx(math.sqrt(0.5) * 2.0)
    ref = 0.5 * ((math.log(2 * math.pi) + 1) + math.log(2 * math.pi * 4)) / 2 + math.log(2.0)
    assert out["nll"] == pytest.approx(ref)


def test_uci_rejects_classification_only_methods():
    with pytest.raises(ValueError, match="valid UCI methods: map, last-layer"):
        run_uci(["yacht"], [0], ["skfac"], "/tmp/unused")
    with pytest.raises(ValueError, match="unknown UCI protocol 'nice'; valid: paper, literature"):
        run_uci(["yacht"], [0], ["map"], "/tmp/unused", protocol="nice")
    ctx = fit_map(synthetic_split(), TINY)
    with pytest.raises(ValueError, match="unknown UCI method 'kfac-magic'"):
        run_uci_cell(ctx, "kfac-magic", "-")


def test_paper_preset_keeps_its_fingerprint():
    """New protocol fields at their paper values leave the folders of earlier paper runs valid."""
    legacy = {"kind": "uci", "width": 50, "depth": 2, "steps": 2000, "seed": 0}
    assert PROTOCOLS["paper"].store_config(0) == legacy
    assert fingerprint(PROTOCOLS["paper"].store_config(0)) == fingerprint(legacy)
    lit = PROTOCOLS["literature"].store_config(3)
    assert lit["protocol"] == "literature"
    assert lit["depth"] == 1
    assert lit["seed"] == 3
    assert lit["val_fraction"] == 0.2
    assert lit["sigma"] == "val"
    assert lit["prior"] == "val_nll"
    changed = replace(PROTOCOLS["paper"], width=20).store_config(0)
    assert changed == {**legacy, "width": 20}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"sigma": "guess"}, "sigma must be one of"),
        ({"prior": "test"}, "prior must be one of"),
        ({"width": 0}, "width=0"),
        ({"weight_decay": ()}, "weight_decay=\\[\\]"),
        ({"sigma": "val"}, "sigma='val' need\\(s\\) a validation part"),
        ({"weight_decay": (0.1, 0.2)}, "several weight decays need\\(s\\) a validation part"),
        ({"swag_lrs": (0.1, 0.2)}, "several SWAG learning rates"),
        ({"lr": 0.0}, "lr or a grid"),
    ],
)
def test_protocol_refuses_bad_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        replace(PROTOCOLS["paper"], **changes)


def test_overfit_network_sigma_is_not_far_below_the_test_error():
    """The paper's σ (training residuals of a network trained to the end) is far below the test error of
    an overfit network; the validation σ is not."""
    torch.manual_seed(0)
    split = synthetic_split(n=40, n_test=200, noise=0.5, val=40)
    overfit = replace(PROTOCOLS["paper"], width=100, epochs=1500, weight_decay=(0.0,))
    train_ctx = fit_map(replace(split, x_val=None, y_val=None), overfit)
    val_ctx = fit_map(split, replace(overfit, val_fraction=0.2, sigma="val"))
    test_rmse = run_uci_cell(train_ctx, "map", "-")["rmse"] / split.y_std
    assert train_ctx.sigma < test_rmse / 3  # the failure the literature preset fixes
    assert 0.6 * test_rmse < val_ctx.sigma < 1.6 * test_rmse


def test_learned_sigma_recovers_the_noise():
    split = synthetic_split(n=400, n_test=50, noise=0.4, val=100)
    ctx = fit_map(split, replace(TINY, sigma="learned", epochs=400, patience=50, width=20))
    true = 0.4 / split.y_std
    assert ctx.info["sigma_rule"] == "learned"
    assert 0.75 * true < ctx.sigma < 1.35 * true
    rec = run_uci_cell(ctx, "kfac-full", "-")
    assert rec["extra"]["sigma_rule"] == "learned"
    assert rec["extra"]["prior_rule"] == "val_nll"
    assert rec["extra"]["sigma_noise"] == pytest.approx(ctx.sigma)


def test_evidence_sigma_guard_on_an_over_parameterised_network():
    """More stochastic weights than data points: the evidence σ is refused with a warning, σ and the prior
    are chosen on validation data instead; a 1-layer last-layer posterior keeps the evidence fit."""
    split = synthetic_split(n=80, n_test=20, val=20)
    proto = replace(TINY, sigma="evidence", width=50, depth=2)
    ctx = fit_map(split, proto)
    with pytest.warns(
        UserWarning, match="evidence σ refused .*stochastic weights > 80 data points"
    ):
        rec = run_uci_cell(ctx, "kfac-full", "-")
    assert rec["extra"]["sigma_rule"] == "val"
    assert rec["extra"]["prior_rule"] == "val_nll"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = run_uci_cell(ctx, "last-layer", "-")
    assert rec["extra"]["sigma_rule"] == "evidence"
    assert rec["extra"]["prior_rule"] == "evidence"
    assert rec["extra"]["sigma_noise"] <= 1.0


def test_test_data_cannot_influence_a_choice():
    """Every choice (weight decay, epochs, σ, prior, SWAG lr) and every validation score is the same when
    only the test part changes; the test metrics are not."""
    split = synthetic_split()
    g = torch.Generator().manual_seed(9)
    other = replace(
        split,
        x_test=torch.randn(split.x_test.shape, generator=g, dtype=torch.float64),
        y_test=10 * torch.randn(split.y_test.shape, generator=g, dtype=torch.float64),
    )
    for method in UCI_METHODS:
        recs = []
        for s in (split, other):
            ctx = fit_map(s, TINY, seed=1)
            size = UCI_METHODS[method].sizes(ctx)[-1]
            recs.append(run_uci_cell(ctx, method, size))
        a, b = recs
        assert a["val_nll"] == b["val_nll"], method
        assert a["val_rmse"] == b["val_rmse"], method
        keys = set(a["extra"]) | set(b["extra"])
        assert {k: a["extra"].get(k) for k in keys} == {k: b["extra"].get(k) for k in keys}, method
        assert a["nll"] != b["nll"], method


@pytest.mark.data
def test_uci_pipeline_one_split(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("partialbayes.curvature")
    torch.set_num_threads(1)
    from partialbayes.glue_bench import uci

    monkeypatch.setitem(uci.PROTOCOLS, "paper", replace(uci.PROTOCOLS["paper"], epochs=300))
    store = run_uci(
        ["yacht"],
        [0],
        ["map", "last-layer", "kfac-max"],
        tmp_path,
        data_dir / "uci",
    )
    recs = {(r["method"], r["size"]): r for r in iter_records(store.root)}
    assert set(recs) == {
        ("map", "-"),
        ("last-layer", "-"),
        ("kfac-max", "1"),
        ("kfac-max", "2"),
        ("kfac-max", "3"),
    }
    for r in recs.values():
        assert r["n_test"] == 31
        assert math.isfinite(r["nll"])
        assert r["rmse"] > 0
        assert r["extra"]["sigma_rule"] == "train"
    # every method shares the MAP mean; Laplace only adds variance
    assert recs[("last-layer", "-")]["rmse"] == pytest.approx(recs[("map", "-")]["rmse"], rel=1e-6)
    assert recs[("kfac-max", "3")]["n_stochastic"] > recs[("kfac-max", "1")]["n_stochastic"]
    # the marginal-likelihood prior is a float64 grid value 10^(k/2), not its float32 rounding
    for key in (("last-layer", "-"), ("kfac-max", "1")):
        prior = recs[key]["extra"]["prior_precision"]
        assert prior in [10.0 ** (k / 2) for k in range(-2, 7)]
        edge = {0.1: "lowest", 1000.0: "highest"}.get(prior)
        assert recs[key]["extra"]["prior_at_grid_edge"] == edge


@pytest.mark.data
def test_uci_literature_one_split(tmp_path, data_dir):
    """The literature preset on real data (short training): validation part, choices recorded."""
    torch.set_num_threads(1)
    proto = replace(PROTOCOLS["literature"], epochs=200)
    methods = ["map", "diag-full", "swag-full"]
    run_uci(["yacht"], [0], methods, tmp_path, data_dir / "uci", protocol=proto)
    recs = {r["method"]: r for r in iter_records(tmp_path)}
    assert set(recs) == set(methods)
    for r in recs.values():
        assert math.isfinite(r["val_nll"])
        assert r["extra"]["sigma_rule"] == "val"
        assert r["extra"]["weight_decay"] in proto.weight_decay
    assert recs["swag-full"]["extra"]["swag_lr"] in proto.swag_lrs
    assert recs["diag-full"]["extra"]["prior_rule"] == "val_nll"


def test_uci_swag_full_cell_runs():
    pytest.importorskip("partialbayes.swag")
    ctx = fit_map(synthetic_split(val=0), replace(PROTOCOLS["paper"], width=8, depth=1, epochs=50))
    rec = run_uci_cell(ctx, "swag-full", "-")
    assert rec["n_test"] == 40
    assert math.isfinite(rec["nll"])
    assert rec["percent_stochastic"] == pytest.approx(100.0)
    assert rec["extra"]["swag_lr_rule"] == "fixed"


def _flat_mask(subset, params):
    return torch.cat(
        [
            subset.mask(n).flatten() if n in subset.names else torch.zeros(p.numel(), dtype=bool)
            for n, p in params.items()
        ]
    )


@given(st.integers(0, 10_000), st.integers(3, 12), st.sampled_from([1.0, 10.0, 37.0]))
def test_subnet_selection_matches_dense_reference(seed, n, percent):
    pytest.importorskip("partialbayes.curvature")
    from partialbayes.glue_bench.models import MLP
    from partialbayes.glue_bench.uci import subnet_subset

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = MLP(3, width=4, depth=1).eval()
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, generator=g)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    k = math.ceil(percent * total / 100)
    # norm-based: the k largest |w|
    flat = torch.cat([p.detach().abs().flatten() for p in params.values()])
    mask = subnet_subset(model, "subnet-norm", percent, x, y, 0.5)
    got = _flat_mask(mask, params)
    assert int(got.sum()) == k
    assert set(got.nonzero().flatten().tolist()) == set(flat.topk(k).indices.tolist())
    # variance-based: the k smallest GGN diagonal entries sum_n (df_n/dθ)² / σ² (dense reference)
    h = torch.zeros(total, dtype=torch.float64)
    for i in range(n):
        model.zero_grad()
        model(x[i : i + 1]).sum().backward()
        h += torch.cat([p.grad.flatten() for p in params.values()]).double() ** 2 / 0.25
    mask = subnet_subset(model, "subnet-variance", percent, x, y, 0.5)
    got = _flat_mask(mask, params)
    assert int(got.sum()) == k
    chosen = h[got]
    rest = h[~got]
    # every chosen entry has curvature no larger than any left-out one, up to float32 error on the scale of
    # the largest entry (entries ~1e-8 of a 0.1 diagonal are rounding noise: their order is arbitrary)
    tol = 1e-6 * float(h.max())
    assert rest.numel() == 0 or float(chosen.max()) <= float(rest.min()) * (1 + 1e-5) + tol


def test_subnet_selection_bad_method():
    from partialbayes.glue_bench.models import MLP
    from partialbayes.glue_bench.uci import subnet_subset

    with pytest.raises(
        ValueError, match=r"method must be one of \['subnet-norm', 'subnet-variance'\]"
    ):
        subnet_subset(MLP(2, 3, 1), "subnet-magic", 5.0, torch.zeros(2, 2), torch.zeros(2), 1.0)


@pytest.mark.data
def test_uci_subnet_methods_one_split(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("partialbayes.curvature")
    torch.set_num_threads(1)
    from partialbayes.glue_bench import uci
    from partialbayes.glue_bench.report import write_report

    monkeypatch.setitem(uci.PROTOCOLS, "paper", replace(uci.PROTOCOLS["paper"], epochs=200))
    monkeypatch.setattr(uci, "SUBNET_PERCENTS", (1.0, 5.0))
    run_uci(
        ["yacht"],
        [0],
        ["map", "subnet-norm", "subnet-variance"],
        tmp_path / "uci",
        data_dir / "uci",
    )
    recs = {(r["method"], r["size"]): r for r in iter_records(tmp_path / "uci")}
    assert set(recs) == {
        ("map", "-"),
        ("subnet-norm", "1"),
        ("subnet-norm", "5"),
        ("subnet-variance", "1"),
        ("subnet-variance", "5"),
    }
    for method in ("subnet-norm", "subnet-variance"):
        assert recs[(method, "5")]["n_stochastic"] > recs[(method, "1")]["n_stochastic"]
        assert recs[(method, "1")]["percent_stochastic"] == pytest.approx(1.0, abs=0.1)
        # the Laplace mean is the MAP mean
        assert recs[(method, "1")]["rmse"] == pytest.approx(recs[("map", "-")]["rmse"], rel=1e-6)
    out = write_report(tmp_path)
    assert str(tmp_path / "report" / "uci_yacht_selection.png") in out["files"]
