import pytest

from partialbayes.glue_bench import __version__
from partialbayes.glue_bench.cli import main, parse_splits


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_parse_splits():
    assert parse_splits("0-4") == [0, 1, 2, 3, 4]
    assert parse_splits("3,1,1") == [1, 3]


def test_unknown_task_lists_valid(capsys, tmp_path):
    assert main(["run", "--tasks", "cola", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown task(s) ['cola']" in err
    assert "sst2, mrpc, rte, boston, energy, yacht" in err


def test_unknown_method_lists_valid(capsys, tmp_path):
    assert main(["run", "--methods", "map,laplace-magic", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown method(s) ['laplace-magic']" in err
    assert "skfac" in err


def test_methods_listing(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in (
        "map",
        "temperature",
        "last-layer",
        "skfac",
        "swag-random",
        "kfac-max-mlp",
        "ls-skfac",
        "swag-max-mlp",
        "swag-min-mlp",
        "swag-max-attn",
        "swag-min-attn",
    ):
        assert f"{name} " in out


def test_quickstart_without_data_says_where(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("PARTIALBAYES_DATA", raising=False)
    assert main(["quickstart", "--results", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--glue-dir" in err
    assert "SST-2" in err
    assert "PARTIALBAYES_DATA" in err
    assert main(["quickstart", "--glue-dir", str(tmp_path), "--results", str(tmp_path / "q")]) == 2
    assert f"{tmp_path}/SST-2/" in capsys.readouterr().err


def test_report_on_empty_folder(capsys, tmp_path):
    assert main(["report", "--results", str(tmp_path)]) == 2
    assert "no result records" in capsys.readouterr().err


def test_unknown_model_says_what_is_valid(tmp_path):
    from partialbayes.glue_bench.models import load_encoder

    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=r"cannot load model .*not-a-model.*valid choices are 'minilm'"
    ):
        load_encoder(str(empty), 2)
    with pytest.raises(ValueError, match="num_labels must be >= 2"):
        load_encoder(str(empty), 1)


def test_quickstart_end_to_end_with_a_local_model_folder(
    capsys, tmp_path, mini_glue, tiny_bert_factory
):
    """The README's main command on a tiny BERT saved to a folder: table, plot and the stage times."""
    import torch

    torch.set_num_threads(1)
    model, tokenizer = tiny_bert_factory(2)
    folder = tmp_path / "tiny-bert"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    results = tmp_path / "quick"
    argv = ["quickstart", "--model", str(folder), "--glue-dir", str(mini_glue)]
    argv += ["--results", str(results), "--max-train-examples", "32", "--max-test-examples", "16"]
    argv += ["--epochs", "1", "--n-samples", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for method in ("map", "temperature", "last-layer", "skfac", "swag-random"):
        assert f"| {method} |" in out
    assert "| fine-tuning | 1 |" in out
    assert "| skfac | 3 |" in out
    assert "| **total** |" in out
    assert (results / "sst2_ramping_nll.png").stat().st_size > 0
    # rerun: everything is reused, the checkpoint too
    assert main(argv) == 0
    assert "| fine-tuning | cached |" in capsys.readouterr().out
