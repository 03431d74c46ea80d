import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.glue_bench.store import iter_records
from partialbayes.glue_bench.uci import gaussian_metrics, run_uci


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


@pytest.mark.data
def test_uci_pipeline_one_split(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("partialbayes.curvature")
    torch.set_num_threads(1)
    from partialbayes.glue_bench import uci

    real = uci.train_mlp
    monkeypatch.setattr(uci, "train_mlp", lambda split, seed=0: real(split, steps=300, seed=seed))
    store = run_uci(
        ["yacht"],
        [0],
        ["map", "last-layer", "kfac-max"],
        tmp_path,
        data_dir / "uci",
        log=lambda s: None,
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
    # every method shares the MAP mean; Laplace only adds variance
    assert recs[("last-layer", "-")]["rmse"] == pytest.approx(recs[("map", "-")]["rmse"], rel=1e-6)
    assert recs[("kfac-max", "3")]["n_stochastic"] > recs[("kfac-max", "1")]["n_stochastic"]
    # the marginal-likelihood prior is a float64 grid value 10^(k/2), not its float32 rounding
    for key in (("last-layer", "-"), ("kfac-max", "1")):
        prior = recs[key]["extra"]["prior_precision"]
        assert prior in [10.0 ** (k / 2) for k in range(-2, 7)]
        edge = {0.1: "lowest", 1000.0: "highest"}.get(prior)
        assert recs[key]["extra"]["prior_at_grid_edge"] == edge


def test_uci_swag_full_cell_runs():
    # collect_swag takes dict batches; the UCI cell used to pass (x, y) tuples and raised TypeError
    pytest.importorskip("partialbayes.swag")
    from partialbayes.glue_bench.data_uci import UCISplit
    from partialbayes.glue_bench.models import MLP
    from partialbayes.glue_bench.uci import run_uci_cell

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, dtype=torch.float64, generator=gen)
    y = x.sum(1)
    split = UCISplit(x[:48], y[:48], x[48:], y[48:], 0.0, 1.0)
    torch.manual_seed(0)
    rec = run_uci_cell(MLP(3, width=8, depth=1), 0.1, split, "swag-full", "-", 0)
    assert rec["n_test"] == 16
    assert math.isfinite(rec["nll"])
    assert rec["percent_stochastic"] == pytest.approx(100.0)


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
    # every chosen entry has curvature no larger than any left-out one (up to float error)
    assert rest.numel() == 0 or float(chosen.max()) <= float(rest.min()) * (1 + 1e-5) + 1e-9


def test_subnet_selection_bad_method():
    from partialbayes.glue_bench.models import MLP
    from partialbayes.glue_bench.uci import subnet_subset

    with pytest.raises(ValueError, match="'subnet-norm' or 'subnet-variance'"):
        subnet_subset(MLP(2, 3, 1), "subnet-magic", 5.0, torch.zeros(2, 2), torch.zeros(2), 1.0)


@pytest.mark.data
def test_uci_subnet_methods_one_split(tmp_path, data_dir, monkeypatch):
    pytest.importorskip("partialbayes.curvature")
    torch.set_num_threads(1)
    from partialbayes.glue_bench import uci
    from partialbayes.glue_bench.report import write_report

    real = uci.train_mlp
    monkeypatch.setattr(uci, "train_mlp", lambda split, seed=0: real(split, steps=200, seed=seed))
    monkeypatch.setattr(uci, "SUBNET_PERCENTS", (1.0, 5.0))
    run_uci(
        ["yacht"],
        [0],
        ["map", "subnet-norm", "subnet-variance"],
        tmp_path / "uci",
        data_dir / "uci",
        log=lambda s: None,
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
