"""Bad input to glue-bench's public entry points: a clear error naming the culprit, never a silent result.

Also the glue-bench defects of issue #16, each with a test that fails on the code before the fix.
"""

import math
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.glue_bench.cli import main, parse_splits
from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.store import Cell, ResultStore, iter_records
from partialbayes.glue_bench.train import TrainConfig, load_checkpoint

TINY = dict(epochs=1, batch_size=8, max_length=32, patience=1, lr=1e-3)


def _grid(root, glue, factory, methods=("map",), **kw):
    torch.set_num_threads(1)
    config = RunConfig(
        model="tiny-bert",
        train=TrainConfig(**{**TINY, **kw.pop("train", {})}),
        settings=kw.pop("settings", Settings(n_samples=2)),
        max_train_examples=32,
        **kw,
    )
    return run_grid(
        Grid(
            ["sst2"],
            [0],
            list(methods),
            config,
            root,
            glue_dir=glue,
            model_factory=lambda name, c, d: factory(c),
            progress=False,
        ),
    )


# ------------------------------------------------------------------------------------------ issue #16
def test_ivon_never_makes_the_embeddings_stochastic(tmp_path, mini_glue, tiny_bert_factory):
    """IVON fine-tuning leaves the embeddings out of its posterior; the cell counts countable weights."""
    pytest.importorskip("partialbayes.ivon")
    from partialbayes.selection._subset import countable_named_parameters

    store = _grid(
        tmp_path / "res",
        mini_glue,
        tiny_bert_factory,
        ("map", "ivon"),
        train={"optimizer": "ivon", "ivon_lr": 0.05},
    )
    model, _ = tiny_bert_factory(2)
    countable = countable_named_parameters(model)
    ckpt = next((tmp_path / "res" / "checkpoints").rglob("meta.json")).parent
    _, hess = load_checkpoint(model, ckpt)
    assert hess is not None
    assert set(hess) == set(countable)  # no embedding table, every countable parameter
    assert not any("embeddings" in k and "LayerNorm" not in k for k in hess)
    rec = store.read(Cell("sst2", 0, "ivon", "-"))
    assert rec["n_stochastic"] == sum(p.numel() for p in countable.values())
    assert rec["percent_stochastic"] == pytest.approx(100.0)


def test_ivon_posterior_ignores_embedding_hessians_of_old_checkpoints(mini_glue, tiny_bert_factory):
    """A checkpoint whose IVON Hessians cover the embeddings: they are neither sampled nor counted."""
    from partialbayes.glue_bench.methods import Context, run_ivon
    from partialbayes.selection import countable_parameters

    model, tok = tiny_bert_factory(2)
    model.eval()
    hess = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    from partialbayes.glue_bench.data_glue import encode, load_glue

    _, test = load_glue("sst2", mini_glue)
    batches = encode(test, tok, 8, 32)
    ctx = Context(
        model=model,
        train=batches,
        val=batches,
        test=batches,
        num_labels=2,
        device=torch.device("cpu"),
        seed=0,
        settings=Settings(n_samples=2),
        ivon={"hess": hess, "ess": 100.0, "weight_decay": 1e-4, "finetune_seconds": 1.0},
    )
    embedding = model.bert.embeddings.word_embeddings.weight.detach().clone()
    seen = []
    real_forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.equal(model.bert.embeddings.word_embeddings.weight, embedding))
        return real_forward(*args, **kwargs)

    model.forward = spy
    pred = run_ivon(ctx, "-")
    assert seen
    assert all(seen)
    assert pred.n_stochastic == countable_parameters(model)
    assert pred.percent_stochastic == pytest.approx(100.0)


def test_a_model_that_cannot_be_loaded_leaves_no_folder_that_refuses(
    tmp_path, mini_glue, tiny_bert_factory, capsys
):
    """`--model /nonexistent` fails without writing config.json; the corrected run is then accepted."""
    results = tmp_path / "res"
    argv = ["run", "--glue-dir", str(mini_glue), "--results", str(results), "--no-progress"]
    argv += ["--max-train-examples", "32", "--epochs", "1", "--max-length", "32"]
    assert main([*argv, "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model': no such folder" in capsys.readouterr().err
    assert not (results / "config.json").exists()
    model, tokenizer = tiny_bert_factory(2)
    folder = tmp_path / "tiny-bert"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.set_num_threads(1)
    assert main([*argv, "--model", str(folder), "--methods", "map"]) == 0
    assert (results / "config.json").is_file()


def test_changed_glue_data_is_refused(tmp_path, mini_glue, tiny_bert_factory):
    """A rerun against a copy of the GLUE folder with flipped dev labels must not mix cells."""
    _grid(tmp_path / "res", mini_glue, tiny_bert_factory)
    flipped = tmp_path / "flipped"
    shutil.copytree(mini_glue, flipped)
    dev = flipped / "SST-2" / "dev.tsv"
    lines = dev.read_text().splitlines(keepends=True)
    body = [
        line.rsplit("\t", 1)[0] + "\t" + ("0" if line.rstrip("\n").endswith("1") else "1") + "\n"
        for line in lines[1:]
    ]
    dev.write_text(lines[0] + "".join(body))
    with pytest.raises(ValueError, match=r"holds sst2 results computed on other data"):
        _grid(tmp_path / "res", flipped, tiny_bert_factory, ("map", "temperature"))
    assert [r["method"] for r in iter_records(tmp_path / "res")] == ["map"]
    # the same content in another folder is the same data
    same = tmp_path / "same"
    shutil.copytree(mini_glue, same)
    _grid(tmp_path / "res", same, tiny_bert_factory, ("map", "temperature"))


@pytest.mark.parametrize("flag", ["--tasks", "--methods", "--splits"])
def test_empty_lists_are_refused(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", flag, "", "--results", str(tmp_path / "r")])
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="tasks is empty"):
        run_grid(Grid([], [0], ["map"], RunConfig(), tmp_path / "r"))
    with pytest.raises(TypeError, match="run_grid: grid must be a Grid, got list"):
        run_grid(["sst2"])  # the grid before issue 33: its fields as arguments


def test_damaged_config_json_is_named(tmp_path, capsys):
    results = tmp_path / "res"
    results.mkdir()
    (results / "config.json").write_text('{"fingerprint": "abc", ')
    assert main(["run", "--results", str(results), "--tasks", "sst2"]) == 2
    err = capsys.readouterr().err
    assert str(results / "config.json") in err
    assert "not valid JSON" in err


@pytest.mark.parametrize("command", ["run", "report", "quickstart"])
def test_a_wrong_flag_prints_the_subcommands_usage(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: glue-bench {command} ")
    assert "unrecognized arguments: --no-such-flag" in err


# ------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prior": "evidence"}, ValueError, "Settings.prior"),
        ({"fisher": "ggn"}, ValueError, "Settings.fisher"),
        ({"last_layer_fisher": "kfac"}, ValueError, "Settings.last_layer_fisher"),
        ({"n_samples": 0}, ValueError, "Settings.n_samples"),
        ({"n_samples": 2.5}, TypeError, "Settings.n_samples"),
        ({"prior_grid": (1.0,)}, ValueError, "Settings.prior_grid needs at least 2"),
        ({"prior_grid": (0.1, -1.0)}, ValueError, "Settings.prior_grid"),
        ({"prior_grid": (0.1, float("nan"))}, ValueError, "Settings.prior_grid"),
        ({"prior_grid": "0.1,1"}, TypeError, "Settings.prior_grid"),
        ({"skfac_percents": (0.0, 5.0)}, ValueError, "Settings.skfac_percents"),
        ({"skfac_percents": (5.0, 101.0)}, ValueError, "Settings.skfac_percents"),
        ({"skfac_percents": (5.0, 5.0)}, ValueError, "repeated"),
        ({"swag_lrs": ()}, ValueError, "Settings.swag_lrs is empty"),
        ({"module_counts": (1, 0)}, ValueError, "Settings.module_counts"),
        ({"module_counts": (1, True)}, TypeError, "Settings.module_counts"),
        ({"linear_sampling": {}}, TypeError, "Settings.linear_sampling"),
    ],
)
def test_settings_name_the_bad_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        Settings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"optimizer": "sgd"}, ValueError, "unknown optimizer 'sgd'"),
        ({"epochs": -1}, ValueError, "TrainConfig.epochs"),
        ({"epochs": 0, "optimizer": "ivon"}, ValueError, "optimizer 'ivon' needs epochs >= 1"),
        ({"batch_size": 1.5}, TypeError, "TrainConfig.batch_size"),
        ({"max_length": 0}, ValueError, "TrainConfig.max_length"),
        ({"lr": 0.0}, ValueError, "TrainConfig.lr"),
        ({"lr": float("inf")}, ValueError, "TrainConfig.lr"),
        ({"ivon_lr": -1.0}, ValueError, "TrainConfig.ivon_lr"),
        ({"dropout": 1.0}, ValueError, "TrainConfig.dropout"),
        ({"weight_decay": -0.1}, ValueError, "TrainConfig.weight_decay"),
        ({"betas": (0.9, 1.0)}, ValueError, "TrainConfig.betas"),
        ({"length_buckets": -1}, ValueError, "TrainConfig.length_buckets"),
    ],
)
def test_train_config_names_the_bad_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"curvature_pass": "both"}, ValueError, "RunConfig.curvature_pass"),
        ({"max_train_examples": 0}, ValueError, "RunConfig.max_train_examples"),
        ({"curvature_batch_size": 0}, ValueError, "RunConfig.curvature_batch_size"),
        ({"seed": -1}, ValueError, "RunConfig.seed"),
        ({"seed": 1.0}, TypeError, "RunConfig.seed"),
        ({"model": ""}, TypeError, "RunConfig.model"),
        ({"train": {}}, TypeError, "RunConfig.train"),
        ({"settings": None}, TypeError, "RunConfig.settings"),
    ],
)
def test_run_config_names_the_bad_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        RunConfig(**kwargs)


@given(st.text(max_size=12))
def test_parse_splits_parses_or_refuses(text):
    import argparse

    try:
        splits = parse_splits(text)
    except argparse.ArgumentTypeError as err:
        message = str(err)
        splits = None
    if splits is None:
        assert "--splits" in message
        return
    assert splits == sorted(set(splits))
    assert all(isinstance(k, int) and k >= 0 for k in splits)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_budget_refuses_what_is_not_a_percentage(target):
    from partialbayes.glue_bench.tables import budget_table

    if 0 <= target <= 100:
        assert budget_table([], target=target) == []
    else:
        with pytest.raises(ValueError, match=r"target must lie in \[0, 100\]"):
            budget_table([], target=target)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=4))
def test_prior_grids_are_checked(values):
    ok = (
        len(values) >= 2
        and len(set(values)) == len(values)
        and all(0 < v < math.inf for v in values)
    )
    if ok:
        assert Settings(prior_grid=tuple(values)).prior_grid == tuple(values)
    else:
        with pytest.raises(ValueError, match=r"Settings\.prior_grid"):
            Settings(prior_grid=tuple(values))


# ------------------------------------------------------------------------------------------ damaged files
GARBAGE = [b"", b"\x00\x01garbage\xff", b'{"truncated": ', b"[1, 2, 3]"]


@pytest.mark.parametrize("content", GARBAGE)
def test_damaged_records_and_configs_are_named(tmp_path, content):
    store = ResultStore(tmp_path, {"a": 1})
    store.write(Cell("rte", 0, "map", "-"), {"nll": 0.5})
    record = store.record_path(Cell("rte", 0, "map", "-"))
    record.write_bytes(content)
    with pytest.raises(ValueError, match=str(record)):
        list(iter_records(tmp_path))
    with pytest.raises(ValueError, match=str(record)):
        store.read(Cell("rte", 0, "map", "-"))
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        ResultStore(tmp_path, {"a": 1})


@pytest.mark.parametrize("which", ["meta.json", "model.safetensors"])
@pytest.mark.parametrize("content", GARBAGE[:3])
def test_damaged_checkpoints_are_named(tmp_path, tiny_bert_factory, which, content):
    from partialbayes.glue_bench.train import save_checkpoint

    model, _ = tiny_bert_factory(2)
    folder = tmp_path / "ckpt"
    save_checkpoint(model, folder, {"task": "sst2"})
    if which == "model.safetensors":  # truncated, not only garbage
        data = (folder / which).read_bytes()
        content = content or data[: len(data) // 2]
    (folder / which).write_bytes(content)
    with pytest.raises(ValueError, match=str(folder / which)):
        load_checkpoint(model, folder)


def test_an_unknown_module_strategy_is_refused():
    from partialbayes.glue_bench.methods import module_subset

    with pytest.raises(ValueError, match="strategy must be one of"):
        module_subset(None, "median", "all", 1)
