"""glue-bench on its siblings' public APIs (issue #17): subsets, train modes, no deprecated calls, namespace."""

import dataclasses
import logging
import warnings

import pytest
import torch

import partialbayes.glue_bench as gb
from partialbayes import selection
from partialbayes.glue_bench.context import Prediction, Settings, every_linear_map
from partialbayes.glue_bench.data_glue import Examples, encode
from partialbayes.glue_bench.data_uci import UCISplit
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.linearised import LinearSamplingConfig
from partialbayes.glue_bench.models import MLP
from partialbayes.glue_bench.store import iter_records
from partialbayes.glue_bench.train import TrainConfig, _make_optimizers, finetune, train_epoch
from partialbayes.glue_bench.uci import PROTOCOLS, fit_map, run_uci_cell
from partialbayes.selection.internal import grouped_linear_modules
from tiny_models import tiny_model


@pytest.mark.parametrize("arch", ["bert", "distilbert", "gpt2"])
def test_every_linear_map_is_the_subset_the_svd_ranking_gave(arch):
    model = tiny_model(arch, seed=0)
    n_all = len(grouped_linear_modules(model, "all"))
    assert every_linear_map(model) == selection.max_operator_norm(model, n_all, group="all")
    mlp = MLP(3, 5, 2)
    n_mlp = len(selection.linear_modules(mlp))
    assert every_linear_map(mlp) == selection.max_operator_norm(mlp, n_mlp, group="all")


def _examples(n: int) -> Examples:
    texts = tuple((f"the film {'good' if i % 2 else 'bad'} {i}",) for i in range(n))
    return Examples(texts, tuple(i % 2 for i in range(n)))


@pytest.mark.parametrize("training", [True, False])
def test_finetune_leaves_the_model_in_the_callers_mode(training, tiny_bert_factory):
    model, tokenizer = tiny_bert_factory()
    model.train(training)
    config = TrainConfig(epochs=1, batch_size=4, max_length=16, lr=1e-3)
    finetune(model, tokenizer, _examples(8), _examples(4), config, progress=False)
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_finetune_logs_each_epoch_it_trains(tiny_bert_factory, caplog):
    model, tokenizer = tiny_bert_factory()
    caplog.set_level(logging.INFO, logger="partialbayes.glue_bench")
    config = TrainConfig(epochs=2, batch_size=4, max_length=16, lr=1e-3, patience=5)
    summary = finetune(model, tokenizer, _examples(8), _examples(4), config, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "partialbayes.glue_bench.train"]
    assert len(lines) == len(summary["history"]) == 2
    assert lines[0].startswith("epoch 1/2: train loss ")
    assert "val accuracy" in lines[1]


def test_train_epoch_restores_the_mode_when_the_loss_is_not_finite(tiny_bert_factory):
    model, tokenizer = tiny_bert_factory()
    model.eval()
    config = TrainConfig(epochs=1, batch_size=4, max_length=16, lr=1e-3)
    opts = _make_optimizers(model, config, 4)
    batches = encode(_examples(4), tokenizer, 4, 16)
    with torch.no_grad():
        model.classifier.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        train_epoch(model, opts, batches, "cpu", 0, progress=False)
    assert not model.training


def test_a_tiny_grid_calls_no_deprecated_api(tmp_path, mini_glue, tiny_bert_factory):
    """Every family's posterior (Laplace, SWAG, IVON, linear sampling) through the siblings' current APIs."""
    torch.set_num_threads(1)
    settings = Settings(
        n_samples=2,
        swag_lrs=(1e-2,),
        swag_steps=10,
        module_counts=(1,),
        skfac_percents=(20.0,),
        linear_sampling=LinearSamplingConfig(k=2, em_iters=1, samples=2, cg_iters=2),
    )
    train = TrainConfig(epochs=1, batch_size=8, max_length=32, lr=1e-3)
    runs = {
        "adamw": (train, ["map", "temperature", "last-layer", "kfac-full", "skfac", "swag-full"]),
        "ivon": (dataclasses.replace(train, optimizer="ivon"), ["ivon", "ls-last-layer"]),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name, (tcfg, methods) in runs.items():
            config = RunConfig(
                model="tiny-bert", train=tcfg, settings=settings, max_train_examples=16
            )
            store = run_grid(
                Grid(
                    ["sst2"],
                    [0],
                    methods,
                    config,
                    tmp_path / name,
                    glue_dir=mini_glue,
                    model_factory=lambda n, c, d: tiny_bert_factory(c),
                    progress=False,
                ),
            )
            assert not store.failures
            assert {r["method"] for r in iter_records(store.root)} == set(methods)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(40, 3, generator=g, dtype=torch.float64), torch.randn(40, generator=g)
        split = UCISplit(x[:30], y[:30].double(), x[30:], y[30:].double(), 0.0, 1.0)
        ctx = fit_map(split, dataclasses.replace(PROTOCOLS["paper"], width=8, depth=1, epochs=20))
        for method in ("swag-full", "kfac-full", "subnet-variance"):
            size = "50" if method.startswith("subnet") else "-"
            assert run_uci_cell(ctx, method, size)["rmse"] > 0


def test_prediction_takes_keywords_only():
    probs = torch.full((2, 2), 0.5, dtype=torch.float64)
    with pytest.raises(TypeError):
        Prediction(probs, 0, 0, 0.0, 0.0, 0.0)  # type: ignore[misc]
    pred = Prediction(probs=probs, fit_seconds=1.0)
    assert (pred.floats, pred.n_stochastic, pred.percent_stochastic) == (0, 0, 0.0)


def test_the_package_namespace_is_small_and_the_moved_names_are_gone():
    assert len(gb.__all__) <= 25
    assert all(hasattr(gb, name) for name in gb.__all__)
    # the 0.2 names kept importable for one minor version (0.3) left with the shim in 0.4
    for gone in ("probit_probs", "fit_temperature", "encode", "PRIOR_GRID", "all_metrics"):
        assert not hasattr(gb, gone)
    with pytest.raises(AttributeError, match="no_such_name"):
        gb.no_such_name


def test_methods_take_batches_of_a_data_collator(tiny_bert_factory):
    """A user's Context built from ``DataCollatorWithPadding`` batches (``BatchEncoding``) works (issue #14)."""
    from transformers import DataCollatorWithPadding

    from partialbayes.glue_bench.context import Context
    from partialbayes.glue_bench.methods import METHODS

    torch.set_num_threads(1)
    model, tokenizer = tiny_bert_factory()
    model.eval()
    collate = DataCollatorWithPadding(tokenizer)

    def batches(n: int, offset: int) -> list:
        ex = _examples(n + offset)
        rows = [
            {**tokenizer(*ex.texts[i]), "labels": ex.labels[i]} for i in range(offset, offset + n)
        ]
        return [collate(rows[i : i + 4]) for i in range(0, n, 4)]

    settings = Settings(
        n_samples=2,
        swag_lrs=(1e-2,),
        swag_steps=10,
        linear_sampling=LinearSamplingConfig(k=2, em_iters=1, samples=2, cg_iters=2),
    )
    ctx = Context(
        model=model,
        train=batches(8, 0),
        val=batches(4, 8),
        test=batches(4, 12),
        num_labels=2,
        device=torch.device("cpu"),
        seed=0,
        settings=settings,
    )
    assert type(ctx.train[0]).__name__ == "BatchEncoding"
    for name, size in [
        ("map", "-"),
        ("kfac-random", "1"),
        ("swag-random", "1"),
        ("ls-random", "1"),
    ]:
        pred = METHODS[name].run(ctx, size)
        assert pred.probs.shape == (4, 2)
        torch.testing.assert_close(pred.probs.sum(-1), torch.ones(4, dtype=torch.float64))
