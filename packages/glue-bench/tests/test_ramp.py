"""A whole ramp from shared passes: the shared path gives the per-cell path's records, bit for bit."""

import dataclasses

import pytest
import torch

from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, prepare_context, run_grid
from partialbayes.glue_bench.methods import METHODS
from partialbayes.glue_bench.store import Cell, ResultStore, iter_records, without_timings
from partialbayes.glue_bench.train import TrainConfig
from tiny_models import tiny_model

pytest.importorskip("partialbayes.curvature")

SETTINGS = Settings(module_counts=(1, 2, 14), skfac_percents=(1.0, 6.8, 33.0, 60.0))


@pytest.fixture
def wide_bert_factory(tiny_tokenizer):
    """A random 2-layer BERT of width 64 / 128: wide enough that BLAS sums a sub-block's product in another
    order than the full one (so principal sub-blocks of the full factors would NOT be bit-identical)."""

    def make(num_labels: int = 2):
        model = tiny_model(
            "bert",
            size="s",
            vocab=tiny_tokenizer.vocab_size,
            hidden=64,
            intermediate=128,
            positions=64,
            num_labels=num_labels,
        )
        return model, tiny_tokenizer

    return make


RAMP = ["kfac-full", "skfac", "kfac-random", "kfac-max-mlp", "kfac-min-attn"]


def _config(curvature_pass, fisher="empirical", prior="val_nll"):
    return RunConfig(
        model="tiny-bert",
        train=TrainConfig(epochs=2, batch_size=8, max_length=32, patience=1, lr=1e-3),
        settings=dataclasses.replace(SETTINGS, fisher=fisher, prior=prior),
        max_train_examples=32,
        curvature_batch_size=8,
        curvature_pass=curvature_pass,
    )


def _grid(root, mini_glue, factory, curvature_pass, **kw):
    torch.set_num_threads(1)
    run_grid(
        Grid(
            ["sst2"],
            [0],
            ["map", *RAMP],
            _config(curvature_pass, **kw),
            root,
            glue_dir=mini_glue,
            model_factory=lambda name, c, d: factory(c),
            progress=False,
        ),
    )
    return {(r["method"], r["size"]): r for r in iter_records(root)}


def _comparable(record):
    rec = without_timings(record)
    for key in ("curvature_pass", "fingerprint"):
        rec.pop(key, None)
    rec["extra"].pop("shared_cells", None)
    return rec


@pytest.mark.parametrize(
    ("fisher", "prior"), [("empirical", "val_nll"), ("exact", "marglik"), ("mc", "val_nll")]
)
def test_shared_pass_gives_the_per_cell_records(
    tmp_path, mini_glue, wide_bert_factory, fisher, prior
):
    """Every KFAC / S-KFAC / module-ramp record of the shared path equals the per-cell one, bit for bit."""
    shared = _grid(
        tmp_path / "shared", mini_glue, wide_bert_factory, "shared", fisher=fisher, prior=prior
    )
    per_cell = _grid(
        tmp_path / "per-cell", mini_glue, wide_bert_factory, "per-cell", fisher=fisher, prior=prior
    )
    assert set(shared) == set(per_cell)
    assert (
        len(shared) == 1 + 1 + 4 + 3 * 2 + 1
    )  # map, full, 4 levels, 3 ramps (1, 2; 14 only random)
    for key, rec in shared.items():
        if key[0] == "map":
            continue
        assert rec["curvature_pass"] == "shared", key
        assert per_cell[key]["curvature_pass"] == "per-cell", key
        assert rec["extra"]["fisher"] == fisher
        assert _comparable(rec) == _comparable(per_cell[key]), key
        if key[0] != "map":
            assert rec["extra"]["shared_cells"] == len(shared) - 1


def test_a_resumed_ramp_runs_its_missing_cells_in_one_pass(
    tmp_path, mini_glue, wide_bert_factory, monkeypatch
):
    """A rerun computes only the cells without a record, all in one pass, with the same records."""
    from partialbayes.curvature import KronLaplace
    from partialbayes.glue_bench import laplace_cells

    root = tmp_path / "res"
    first = _grid(root, mini_glue, wide_bert_factory, "shared")
    passes = []

    class Counting(KronLaplace):
        @classmethod
        def fit_many(cls, model, subsets, loader, **kw):
            passes.append(len(subsets))
            return KronLaplace.fit_many(model, subsets, loader, **kw)

    monkeypatch.setattr(laplace_cells, "KronLaplace", Counting)
    assert _grid(root, mini_glue, wide_bert_factory, "shared").keys() == first.keys()
    assert passes == []  # every cell has its record
    for rec in (root / "records" / "sst2" / "split0").rglob("*.json"):
        if rec.parent.name in ("skfac", "kfac-full"):
            rec.unlink()
    again = _grid(root, mini_glue, wide_bert_factory, "shared")
    assert passes == [4 + 1]
    assert {k: _comparable(v) for k, v in again.items()} == {
        k: _comparable(v) for k, v in first.items()
    }


def test_ramp_groups_bound_the_memory(tmp_path, mini_glue, wide_bert_factory):
    """Cells are processed in groups whose posteriors fit the budget; the records do not change."""
    from partialbayes.glue_bench.laplace_cells import groups_of, shared_predictions

    torch.set_num_threads(1)
    config = _config("shared")
    store = ResultStore(tmp_path / "res", config.to_dict())
    ctx, _ = prepare_context(
        "sst2",
        0,
        config,
        store,
        torch.device("cpu"),
        mini_glue,
        model_factory=lambda n, c, d: wide_bert_factory(c),
        progress=False,
    )
    cells = [METHODS["skfac"].kron(ctx, s) for s in ("1", "33")] + [
        METHODS["kfac-full"].kron(ctx, "-")
    ]
    assert groups_of(cells) == [[0, 1, 2]]
    assert groups_of(cells, memory_floats=1) == [[0], [1], [2]]
    together, took = shared_predictions(ctx, cells)
    assert set(took) == {"fit", "prior", "predict", "cpu"}
    for cell, pred in zip(cells, together, strict=True):
        (alone,), _ = shared_predictions(ctx, [cell])
        assert torch.equal(pred.probs, alone.probs)
        assert pred.extra["prior_precision"] == alone.extra["prior_precision"]
        assert pred.extra.get("skfac_percent") == cell.skfac_percent


@pytest.mark.parametrize(
    ("change", "differs"),
    [({"curvature_pass": "per-cell"}, "curvature_pass"), ({"fisher": "exact"}, "settings")],
)
def test_a_folder_of_the_other_path_or_fisher_is_refused(tmp_path, change, differs):
    """Cells of the other curvature path or another fisher type never land in the same folder."""
    ResultStore(tmp_path / "res", _config("shared").to_dict()).write(
        Cell("sst2", 0, "map", "-"), {}
    )
    other = _config(
        change.get("curvature_pass", "shared"), fisher=change.get("fisher", "empirical")
    )
    with pytest.raises(ValueError, match=rf"another configuration.*differs in \['{differs}'\]"):
        run_grid(Grid(["sst2"], [0], ["skfac"], other, tmp_path / "res", progress=False))
    assert len(list((tmp_path / "res" / "records").rglob("*.json"))) == 1


def test_groups_count_a_map_with_and_without_its_bias_as_two_blocks():
    """`KronLaplace.fit_many` keeps a weight alone and weight + bias apart: so does the memory count."""
    from types import SimpleNamespace

    from partialbayes.glue_bench.laplace_cells import groups_of
    from partialbayes.selection import KronBlock, Subset

    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    cells = [
        SimpleNamespace(subset=Subset.from_model(model, blocks))
        for blocks in (
            {"0.weight": KronBlock(), "0.bias": KronBlock()},  # 18 entries, 9 + 3 + 36 + 6 floats
            {"0.weight": KronBlock()},  # 15 entries, 9 + 3 + 25 + 5 floats
        )
    ]
    assert groups_of(cells, memory_floats=129) == [[0, 1]]
    assert groups_of(cells, memory_floats=128) == [[0], [1]]
