import dataclasses
import json

import pytest
import torch

from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.linearised import LinearSamplingConfig
from partialbayes.glue_bench.store import iter_records
from partialbayes.glue_bench.train import TrainConfig

FAST = Settings(
    n_samples=3,
    swag_lrs=(1e-2,),
    swag_sweep_steps=10,
    swag_steps=10,
    module_counts=(1, 2),
    skfac_percents=(10.0, 50.0),
    swag_l1_percents=(5.0,),
    linear_sampling=LinearSamplingConfig(k=2, em_iters=1, samples=3, cg_iters=3),
)


# The prior-precision grid 10^-1, 10^-0.5, ..., 10^3 as exact float64 values.
EXACT_PRIOR_GRID = [10.0 ** (k / 2) for k in range(-2, 7)]


def _config(settings=FAST, **kw):
    train = TrainConfig(epochs=2, batch_size=8, max_length=32, patience=1, lr=1e-3)
    return RunConfig(model="tiny-bert", train=train, settings=settings, max_train_examples=32, **kw)


def _run(tmp_path, mini_glue, factory, methods, task="sst2", timings=None, **kw):
    torch.set_num_threads(1)
    store = run_grid(
        Grid(
            [task],
            [0],
            methods,
            _config(**kw),
            tmp_path / "res",
            glue_dir=mini_glue,
            model_factory=lambda name, c, d: factory(c),
            progress=False,
        ),
        timings=timings,
    )
    recs = {(r["method"], r["size"]): r for r in iter_records(store.root)}
    for r in recs.values():
        assert 0 <= r["accuracy"] <= 1
        assert r["nll"] > 0
        assert 0 <= r["ece"] <= 1
        assert 0 <= r["brier"] <= 2
    return recs


def test_map_and_temperature(tmp_path, mini_glue, tiny_bert_factory):
    timings = []
    recs = _run(tmp_path, mini_glue, tiny_bert_factory, ["map", "temperature"], timings=timings)
    assert [t["stage"] for t in timings] == ["prepare", "map", "temperature"]
    assert timings[0]["finetune_cpu"] > 0  # trained here, not cached
    assert timings[1]["cpu"] == recs[("map", "-")]["cpu_seconds"]
    assert set(recs) == {("map", "-"), ("temperature", "-")}
    assert recs[("map", "-")]["floats"] == 0
    assert recs[("map", "-")]["n_test"] == 24
    # same predictions up to a temperature: same argmax, so same accuracy
    assert recs[("temperature", "-")]["accuracy"] == recs[("map", "-")]["accuracy"]
    assert recs[("temperature", "-")]["extra"]["temperature"] > 0


def test_laplace_methods(tmp_path, mini_glue, tiny_bert_factory):
    pytest.importorskip("partialbayes.curvature")
    recs = _run(
        tmp_path,
        mini_glue,
        tiny_bert_factory,
        ["last-layer", "kfac-random", "skfac", "kfac-max-mlp"],
    )
    assert set(recs) == {
        ("last-layer", "-"),
        ("kfac-random", "1"),
        ("kfac-random", "2"),
        ("skfac", "10"),
        ("skfac", "50"),
        ("kfac-max-mlp", "1"),
        ("kfac-max-mlp", "2"),
    }
    assert recs[("kfac-random", "2")]["n_stochastic"] > recs[("kfac-random", "1")]["n_stochastic"]
    assert recs[("skfac", "50")]["percent_stochastic"] > recs[("skfac", "10")]["percent_stochastic"]
    # the achieved percentage is stored beside the requested one: Subset.percent_of, token and position
    # embeddings not counted
    from partialbayes.selection import countable_parameters

    countable = countable_parameters(tiny_bert_factory(2)[0])
    for size in ("10", "50"):
        rec = recs[("skfac", size)]
        assert rec["extra"]["skfac_percent"] == float(size)
        assert rec["percent_stochastic"] == pytest.approx(100 * rec["n_stochastic"] / countable)
    assert recs[("last-layer", "-")]["extra"]["modules"] == ["classifier"]
    # dense covariance of the 2 x (16 + 1) head
    assert recs[("last-layer", "-")]["floats"] >= 34
    for rec in recs.values():
        assert rec["extra"]["prior_method"] == "val_nll"
        # the grid value itself (float64), not its float32 rounding 0.10000000149...
        assert rec["extra"]["prior_precision"] in EXACT_PRIOR_GRID


def test_prior_grid_is_float64():
    from partialbayes.glue_bench import context, uci

    assert list(context.PRIOR_GRID) == EXACT_PRIOR_GRID
    assert list(uci.PRIOR_GRID) == EXACT_PRIOR_GRID
    assert json.dumps(context.PRIOR_GRID[0]) == "0.1"


def test_laplace_methods_with_marglik_prior(tmp_path, mini_glue, tiny_bert_factory):
    """``--prior marglik``: the records store the method and a prior on the grid."""
    pytest.importorskip("partialbayes.curvature")
    settings = dataclasses.replace(FAST, prior="marglik")
    recs = _run(tmp_path, mini_glue, tiny_bert_factory, ["kfac-random", "skfac"], settings=settings)
    assert set(recs) == {
        ("kfac-random", "1"),
        ("kfac-random", "2"),
        ("skfac", "10"),
        ("skfac", "50"),
    }
    config = json.loads((tmp_path / "res" / "config.json").read_text())
    assert config["config"]["settings"]["prior"] == "marglik"
    for rec in recs.values():
        assert rec["extra"]["prior_method"] == "marglik"
        prior = rec["extra"]["prior_precision"]
        assert min(EXACT_PRIOR_GRID) <= prior <= max(EXACT_PRIOR_GRID)
        assert prior in EXACT_PRIOR_GRID
        assert rec["n_stochastic"] > 0


def test_swag_methods(tmp_path, mini_glue, tiny_distilbert_factory):
    pytest.importorskip("partialbayes.swag")
    recs = _run(tmp_path, mini_glue, tiny_distilbert_factory, ["swag-random", "swag-l1"])
    assert set(recs) == {("swag-random", "1"), ("swag-random", "2"), ("swag-l1", "5")}
    assert recs[("swag-random", "1")]["extra"]["swag_lr"] == 1e-2
    assert recs[("swag-random", "1")]["extra"]["swag_lr_swept"] is False
    assert recs[("swag-l1", "5")]["percent_stochastic"] == pytest.approx(5.0, abs=0.5)
    assert recs[("swag-l1", "5")]["extra"]["l1_percent"] == 5.0


def test_swag_module_ramps_share_the_kfac_selection(tmp_path, mini_glue, tiny_bert_factory):
    """swag-max-mlp / swag-min-attn ramp SWAG over the same modules as the KFAC strategies."""
    pytest.importorskip("partialbayes.swag")
    pytest.importorskip("partialbayes.curvature")
    from partialbayes.glue_bench.tables import strategy_ranks

    methods = ["kfac-max-mlp", "kfac-min-attn", "swag-max-mlp", "swag-min-attn", "swag-random"]
    recs = _run(tmp_path, mini_glue, tiny_bert_factory, methods)
    assert set(recs) == {(m, k) for m in methods for k in ("1", "2")}
    for k in ("1", "2"):
        swag_mlp, kfac_mlp = recs[("swag-max-mlp", k)], recs[("kfac-max-mlp", k)]
        assert swag_mlp["extra"]["modules"] == kfac_mlp["extra"]["modules"]
        assert swag_mlp["n_stochastic"] == kfac_mlp["n_stochastic"]
        assert "swag_lr" in swag_mlp["extra"]
        swag_attn = recs[("swag-min-attn", k)]
        assert swag_attn["extra"]["modules"] == recs[("kfac-min-attn", k)]["extra"]["modules"]
        assert all(".attention." in m for m in swag_attn["extra"]["modules"])
    # the report ranks the SWAG strategies as a family of their own
    ranks = strategy_ranks(recs.values())
    swag = {(r["modules"], r["strategy"]) for r in ranks if r["family"] == "swag"}
    assert swag == {(k, s) for k in (1, 2) for s in ("max-mlp", "min-attn", "random")}


def test_ivon_finetuning_and_posterior(tmp_path, mini_glue, tiny_bert_factory):
    pytest.importorskip("partialbayes.ivon")
    torch.set_num_threads(1)
    train = TrainConfig(
        epochs=2, batch_size=8, max_length=32, patience=1, optimizer="ivon", ivon_lr=0.05
    )
    config = RunConfig(model="tiny-bert", train=train, settings=FAST, max_train_examples=32)
    store = run_grid(
        Grid(
            ["sst2"],
            [0],
            ["map", "ivon"],
            config,
            tmp_path / "res",
            glue_dir=mini_glue,
            model_factory=lambda name, c, d: tiny_bert_factory(c),
            progress=False,
        ),
    )
    recs = {(r["method"], r["size"]): r for r in iter_records(store.root)}
    assert set(recs) == {("map", "-"), ("ivon", "-")}
    assert recs[("ivon", "-")]["n_stochastic"] > 0
    ckpt = next((tmp_path / "res" / "checkpoints").rglob("ivon_hess.safetensors"))
    assert ckpt.stat().st_size > 0
    # the posterior's cost is the IVON fine-tuning that built it, not 0
    meta = json.loads((ckpt.parent / "meta.json").read_text())
    rec = recs[("ivon", "-")]
    assert meta["seconds"] > 0
    assert rec["extra"]["finetune_seconds"] == meta["seconds"]
    assert rec["fit_seconds"] >= meta["seconds"]
    assert rec["fit_seconds"] == pytest.approx(
        meta["seconds"] + rec["extra"]["posterior_setup_seconds"]
    )


def test_ivon_method_needs_ivon_checkpoint(tmp_path, mini_glue, tiny_bert_factory):
    with pytest.raises(ValueError, match="--optimizer ivon"):
        _run(tmp_path, mini_glue, tiny_bert_factory, ["ivon"])


def test_linear_sampling_methods(tmp_path, mini_glue, tiny_bert_factory):
    recs = _run(
        tmp_path,
        mini_glue,
        tiny_bert_factory,
        ["ls-last-layer", "ls-skfac", "skfac", "ls-random", "ls-full"],
    )
    assert set(recs) == {
        ("ls-random", "1"),
        ("ls-random", "2"),
        ("ls-full", "-"),
        ("ls-last-layer", "-"),
        ("ls-skfac", "10"),
        ("ls-skfac", "50"),
        ("skfac", "10"),
        ("skfac", "50"),
    }
    head = recs[("ls-last-layer", "-")]
    assert head["extra"]["modules"] == ["classifier"]
    assert head["n_stochastic"] == 2 * 16 + 2
    assert head["floats"] == head["n_stochastic"] * 3 + 1  # 3 samples of d entries, and alpha
    for size in ("10", "50"):
        ls, kfac = recs[("ls-skfac", size)], recs[("skfac", size)]
        # the same S-KFAC subset as the KFAC-Laplace method, with the achieved percentage stored
        assert ls["n_stochastic"] == kfac["n_stochastic"]
        assert ls["percent_stochastic"] == pytest.approx(kfac["percent_stochastic"])
        assert ls["extra"]["skfac_percent"] == float(size)
        assert ls["extra"]["prior_method"] == "em"
        assert len(ls["extra"]["em_history"]) == 1
        assert ls["extra"]["prior_precision"] > 0
        assert ls["fit_seconds"] > 0
        assert ls["predict_seconds"] > 0
    assert recs[("ls-skfac", "50")]["n_stochastic"] > recs[("ls-skfac", "10")]["n_stochastic"]
    assert recs[("ls-random", "2")]["n_stochastic"] > recs[("ls-random", "1")]["n_stochastic"]
    full = recs[("ls-full", "-")]
    assert len(full["extra"]["modules"]) == 2 * 6 + 2  # 6 linear maps per layer, pooler, classifier
    assert full["n_stochastic"] > recs[("ls-skfac", "50")]["n_stochastic"]


def test_results_folder_of_another_configuration_is_refused(tmp_path, mini_glue):
    from partialbayes.glue_bench.store import Cell, ResultStore

    ResultStore(tmp_path / "res", _config().to_dict()).write(Cell("sst2", 0, "map", "-"), {})
    other = _config(max_test_examples=5)
    with pytest.raises(ValueError, match=r"another configuration.*max_test_examples"):
        run_grid(
            Grid(
                ["sst2"], [0], ["map"], other, tmp_path / "res", glue_dir=mini_glue, progress=False
            )
        )
    assert [p.name for p in (tmp_path / "res" / "records").rglob("*.json")] == ["-.json"]


def test_swag_learning_rate_sweep(tmp_path, mini_glue, tiny_distilbert_factory):
    """Two learning rates: the validation sweep runs and picks one; one rate: no sweep."""
    torch.set_num_threads(1)
    settings = Settings(
        n_samples=2, swag_lrs=(1e-3, 1e-2), swag_sweep_steps=10, swag_steps=10, module_counts=(1,)
    )
    train = TrainConfig(epochs=1, batch_size=8, max_length=32, patience=1, lr=1e-3)
    config = RunConfig(model="tiny", train=train, settings=settings, max_train_examples=32)
    store = run_grid(
        Grid(
            ["sst2"],
            [0],
            ["swag-random"],
            config,
            tmp_path / "res",
            glue_dir=mini_glue,
            model_factory=lambda name, c, d: tiny_distilbert_factory(c),
            progress=False,
        ),
    )
    (rec,) = iter_records(store.root)
    assert rec["extra"]["swag_lr_swept"] is True
    assert rec["extra"]["swag_lr"] in (1e-3, 1e-2)


def test_stage_table_sums_cells():
    from partialbayes.glue_bench.cli import stage_table

    timings = [
        {
            "stage": "prepare",
            "wall": 12.0,
            "cpu": 20.0,
            "finetune_wall": 10.0,
            "finetune_cpu": 18.0,
        },
        {"stage": "skfac", "size": "1", "wall": 3.0, "cpu": 5.0},
        {"stage": "skfac", "size": "6.8", "wall": 4.0, "cpu": 6.0},
    ]
    table = stage_table(timings, total_wall=20.0, total_cpu=40.0)
    assert "| fine-tuning | 1 | 10 | 18 |" in table
    assert "| skfac | 2 | 7 | 11 |" in table
    assert "| other | | 3 | 11 |" in table
    assert "| **total** | | 20 | 40 |" in table
    cached = stage_table([{**timings[0], "finetune_wall": 0.0, "finetune_cpu": 0.0}], 1.0, 1.0)
    assert "| fine-tuning | cached | 0 | 0 |" in cached


def test_concurrent_shards_score_with_the_published_checkpoint(
    tmp_path, mini_glue, tiny_bert_factory, monkeypatch
):
    """Two shards fine-tune one checkpoint at once: the one published first is the MAP of both."""
    from partialbayes.glue_bench import experiment
    from partialbayes.glue_bench.store import ResultStore
    from partialbayes.glue_bench.train import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    config = _config()
    store = ResultStore(tmp_path / "res", config.to_dict())
    folder = store.checkpoint_dir("sst2", 0, config.model)
    other, _ = tiny_bert_factory(2, seed=123)
    published = {k: v.clone() for k, v in other.state_dict().items()}
    real = experiment.finetune

    def another_shard_publishes_first(model, *args, **kwargs):
        summary = real(model, *args, **kwargs)
        meta = {"task": "sst2", "split": 0, "model": config.model, "val_accuracy": 0.5, "shard": 1}
        save_checkpoint(other, folder, meta)
        return summary

    monkeypatch.setattr(experiment, "finetune", another_shard_publishes_first)
    ctx, meta = experiment.prepare_context(
        "sst2",
        0,
        config,
        store,
        torch.device("cpu"),
        mini_glue,
        model_factory=lambda n, c, d: tiny_bert_factory(c),
        progress=False,
    )
    # the context scores with the published (other shard's) weights and meta, not its own training
    own = ctx.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in published.items())
    assert meta["shard"] == 1
    # this process did train (and its time is its own)
    assert meta["cached"] is False
    assert meta["published_here"] is False
    assert meta["finetune_seconds"] > 0
    # ours was discarded: only the published directory is left, with the other shard's meta
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    fresh, _ = tiny_bert_factory(2)
    meta_on_disk, hess = load_checkpoint(fresh, folder)
    assert meta_on_disk["shard"] == 1
    assert hess is None
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in published.items())


def test_save_checkpoint_publishes_once(tmp_path, tiny_bert_factory):
    from partialbayes.glue_bench.train import load_checkpoint, save_checkpoint

    first, _ = tiny_bert_factory(2, seed=1)
    second, _ = tiny_bert_factory(2, seed=2)
    folder = tmp_path / "ckpt"
    hess = {"classifier.weight": torch.ones(2, 16)}
    assert save_checkpoint(first, folder, {"who": "first"}, hess) is True
    assert save_checkpoint(second, folder, {"who": "second"}) is False
    meta, loaded_hess = load_checkpoint(second, folder)
    assert meta == {"who": "first"}
    assert torch.equal(loaded_hess["classifier.weight"], hess["classifier.weight"])
    assert all(torch.equal(second.state_dict()[k], v) for k, v in first.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # a folder that save_checkpoint did not write completely is named, not silently retrained
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"broken is incomplete \(no meta.json\)"):
        load_checkpoint(second, broken)
    # an empty folder counts as no checkpoint, and publishing replaces it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_checkpoint(second, empty) is None
    assert save_checkpoint(first, empty, {"who": "first"}) is True
