import math

import pytest
import torch

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
