import pytest

from partialbayes.glue_bench import __version__
from partialbayes.glue_bench.cli import main, parse_splits
from partialbayes.glue_bench.quickstart import QUICKSTART_SETTINGS


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
    head = out.splitlines()[:4]  # printed lines and the library's logged ones, in order
    assert head[0].startswith("glue-bench quickstart: sst2 split 0")
    assert head[1].startswith("threads: ")
    assert head[2] == f"[sst2 split 0] preparing model {folder}"
    assert head[3].startswith("[sst2 split 0] epoch 1/1: train loss ")
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.count("|") == 8]
    methods = [line.split(" | ")[0][2:] for line in rows[1:]]  # after the header
    assert methods[:3] == ["map", "temperature", "last-layer"]  # MAP first, then the baselines
    assert methods[3:] == ["skfac"] * len(QUICKSTART_SETTINGS["skfac_percents"])
    assert "| fine-tuning | 1 |" in out
    assert f"| skfac | {len(QUICKSTART_SETTINGS['skfac_percents'])} |" in out
    assert "| **total** |" in out
    assert (results / "sst2_split0_ramping_nll.png").stat().st_size > 0
    # the output ends with the sentences that read the table, computed from this run's records
    last = out.strip().splitlines()[-1]
    assert last.startswith("The MAP is")
    assert "temperature scaling" in last
    assert "S-KFAC at p = " in last
    assert "last-layer Laplace" in last
    # rerun: everything is reused, the checkpoint too
    assert main(argv) == 0
    assert "| fine-tuning | cached |" in capsys.readouterr().out


def _tiny_uci(root, folder="bostonHousing", n=40, d=3):
    """A synthetic UCI folder in the standard layout: ``root/<folder>/data/`` with 2 splits."""
    import torch

    data = root / folder / "data"
    data.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = x.sum(1) + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
    rows = torch.cat([x, y[:, None]], 1)
    (data / "data.txt").write_text(
        "\n".join(" ".join(f"{v:.6f}" for v in r) for r in rows.tolist())
    )
    (data / "index_features.txt").write_text("\n".join(str(i) for i in range(d)))
    (data / "index_target.txt").write_text(str(d))
    (data / "n_splits.txt").write_text("2")
    for k in range(2):
        test = list(range(k * 10, k * 10 + 10))
        train = [i for i in range(n) if i not in test]
        (data / f"index_train_{k}.txt").write_text("\n".join(map(str, train)))
        (data / f"index_test_{k}.txt").write_text("\n".join(map(str, test)))
    return root


@pytest.fixture
def fast_uci(monkeypatch):
    """Short MLP training, and a GLUE grid that must not run (these tests are about the UCI route)."""
    from dataclasses import replace

    from partialbayes.glue_bench import experiment, uci

    for name, proto in list(uci.PROTOCOLS.items()):
        monkeypatch.setitem(uci.PROTOCOLS, name, replace(proto, epochs=50, swag_steps=20))

    def no_glue(*args, **kwargs):
        raise AssertionError(f"GLUE grid started with {args[:1]}")

    monkeypatch.setattr(experiment, "run_grid", no_glue)


def test_resolve_task_normalises_once():
    from partialbayes.glue_bench.cli import resolve_task

    assert resolve_task("SST-2") == ("glue", "sst2")
    assert resolve_task("RTE") == ("glue", "rte")
    assert resolve_task("Boston") == ("uci", "boston")
    assert resolve_task("bostonHousing") == ("uci", "boston")
    assert resolve_task("YACHT") == ("uci", "yacht")
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['cola'\]"):
        resolve_task("cola")


def test_capitalised_uci_name_runs_the_uci_grid(capsys, tmp_path, fast_uci):
    """`--tasks Boston` used to pass the name check and then fail as an unknown GLUE task."""
    from partialbayes.glue_bench.store import iter_records

    uci_dir = _tiny_uci(tmp_path / "uci")
    argv = ["run", "--tasks", "Boston", "--methods", "map", "--uci-dir", str(uci_dir)]
    assert main([*argv, "--splits", "0", "--results", str(tmp_path / "res")]) == 0
    (rec,) = iter_records(tmp_path / "res" / "uci")
    assert (rec["task"], rec["method"], rec["size"]) == ("boston", "map", "-")
    assert rec["n_test"] == 10


def test_default_methods_follow_the_task_kind(tmp_path, fast_uci):
    """Without --methods a UCI dataset gets the UCI defaults (map, last-layer), not temperature."""
    pytest.importorskip("partialbayes.curvature")
    from partialbayes.glue_bench.cli import DEFAULT_METHODS, plan_run
    from partialbayes.glue_bench.store import iter_records

    uci_dir = _tiny_uci(tmp_path / "uci", folder="yacht")
    argv = ["run", "--tasks", "yacht", "--uci-dir", str(uci_dir), "--results", str(tmp_path / "r")]
    assert main(argv) == 0
    methods = {r["method"] for r in iter_records(tmp_path / "r" / "uci")}
    assert methods == set(DEFAULT_METHODS["uci"]) == {"map", "last-layer"}
    assert plan_run(["SST-2", "yacht"], None) == {
        "glue": (["sst2"], ["map", "temperature"]),
        "uci": (["yacht"], ["map", "last-layer"]),
    }
    # UCI-only methods are accepted for UCI tasks
    assert plan_run(["energy"], ["subnet-norm"]) == {"uci": (["energy"], ["subnet-norm"])}


def test_every_task_kind_and_method_is_checked_before_any_work(capsys, tmp_path, fast_uci):
    """A GLUE+UCI run with a GLUE-only method fails at once, before the GLUE grid starts."""
    uci_dir = _tiny_uci(tmp_path / "uci", folder="yacht")
    argv = ["run", "--tasks", "sst2,yacht", "--methods", "map,temperature,subnet-norm"]
    argv += ["--uci-dir", str(uci_dir), "--results", str(tmp_path / "res")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "method(s) ['subnet-norm'] have no GLUE version (tasks sst2)" in err
    assert "method(s) ['temperature'] have no UCI version (tasks yacht)" in err
    assert "valid UCI methods: map, last-layer, kfac-full" in err
    assert not (tmp_path / "res").exists()
    # the IVON posterior needs IVON fine-tuning: refused up front too
    assert main(["run", "--tasks", "sst2", "--methods", "ivon", "--results", str(tmp_path)]) == 2
    assert "method 'ivon' needs --optimizer ivon" in capsys.readouterr().err
    # missing UCI data or a split beyond the folder's: refused before the GLUE part
    argv = ["run", "--tasks", "sst2,yacht", "--methods", "map", "--results", str(tmp_path / "res")]
    assert main([*argv, "--uci-dir", str(tmp_path / "nowhere")]) == 2
    assert "UCI data for yacht not found" in capsys.readouterr().err
    assert main([*argv, "--uci-dir", str(uci_dir), "--splits", "0-2"]) == 2
    assert "--splits [2] out of range for UCI dataset yacht (2 splits: 0-1)" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "res").exists()


def test_uci_grid_keeps_going_past_a_failing_cell(capsys, tmp_path, fast_uci, monkeypatch):
    from partialbayes.glue_bench import uci
    from partialbayes.glue_bench.store import iter_records

    real = uci.run_uci_cell

    def broken_last_layer(ctx, method, size):
        if method == "last-layer":
            raise RuntimeError("curvature exploded")
        return real(ctx, method, size)

    monkeypatch.setattr(uci, "run_uci_cell", broken_last_layer)
    uci_dir = _tiny_uci(tmp_path / "uci", folder="yacht")
    argv = ["run", "--tasks", "yacht", "--methods", "last-layer,map", "--splits", "0-1"]
    assert main([*argv, "--uci-dir", str(uci_dir), "--results", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "2 cell(s) failed (rerun to retry them)" in err
    assert "yacht/split1/last-layer/-: RuntimeError: curvature exploded" in err
    recs = {(r["split"], r["method"]) for r in iter_records(tmp_path / "r" / "uci")}
    assert recs == {(0, "map"), (1, "map")}
    # from Python the first failure propagates unless keep_going is set
    with pytest.raises(RuntimeError, match="curvature exploded"):
        uci.run_uci(["yacht"], [0], ["last-layer"], tmp_path / "p", uci_dir)


def test_uci_runs_the_papers_15_splits_by_default(tmp_path, fast_uci, monkeypatch):
    """Without --splits a UCI dataset runs splits 0-14 (the paper's 15), or all of a smaller folder."""
    from partialbayes.glue_bench import uci

    seen = []
    real = uci.run_uci
    monkeypatch.setattr(
        uci,
        "run_uci",
        lambda names, splits, *a, **k: (seen.append(list(splits)), real(names, splits, *a, **k))[1],
    )
    small = _tiny_uci(tmp_path / "uci", folder="yacht")
    argv = ["run", "--tasks", "yacht", "--methods", "map", "--results", str(tmp_path / "r")]
    assert main([*argv, "--uci-dir", str(small)]) == 0
    assert seen == [[0, 1]]
    (small / "yacht" / "data" / "n_splits.txt").write_text("20")
    for k in range(2, 20):
        for part in ("train", "test"):
            src = small / "yacht" / "data" / f"index_{part}_{k % 2}.txt"
            (small / "yacht" / "data" / f"index_{part}_{k}.txt").write_text(src.read_text())
    monkeypatch.setattr(
        uci,
        "run_uci",
        lambda names, splits, *a, **k: seen.append(list(splits)) or real(names, [], *a, **k),
    )
    main([*argv, "--uci-dir", str(small)])
    assert seen[-1] == list(range(15))


def test_uci_run_refuses_glue_only_flags(capsys, tmp_path, fast_uci):
    """GLUE flags with UCI tasks only (and UCI flags with GLUE tasks only) are refused, never ignored."""
    uci_dir = _tiny_uci(tmp_path / "uci", folder="yacht")
    argv = ["run", "--tasks", "yacht", "--uci-dir", str(uci_dir), "--results", str(tmp_path / "r")]
    assert main([*argv, "--epochs", "3", "--lr=0.1", "--fisher", "mc"]) == 2
    err = capsys.readouterr().err
    assert "option(s) --epochs, --lr, --fisher apply only to GLUE tasks" in err
    assert "(tasks: yacht)" in err
    assert not (tmp_path / "r").exists()
    assert main(["run", "--tasks", "sst2", "--hidden-width", "20", "--protocol", "literature"]) == 2
    assert "option(s) --protocol, --hidden-width apply only to UCI tasks" in capsys.readouterr().err


def test_uci_protocol_options_reach_the_record(capsys, tmp_path, fast_uci):
    """--protocol literature and the UCI options end up in config.json; a bad combination is refused."""
    import json

    from partialbayes.glue_bench.store import iter_records

    uci_dir = _tiny_uci(tmp_path / "uci", n=60, folder="yacht")
    res = tmp_path / "r"
    argv = ["run", "--tasks", "yacht", "--uci-dir", str(uci_dir), "--results", str(res)]
    argv += ["--methods", "map", "--splits", "0", "--protocol", "literature"]
    argv += ["--hidden-width", "7", "--weight-decay", "0.001", "--prior-grid", "1,10"]
    assert main(argv) == 0
    config = json.loads((res / "uci" / "config.json").read_text())["config"]
    assert config["protocol"] == "literature"
    assert config["width"] == 7
    assert config["weight_decay"] == [0.001]
    assert config["prior_grid"] == [1.0, 10.0]
    (rec,) = iter_records(res / "uci")
    assert rec["extra"]["sigma_rule"] == "val"
    assert rec["extra"]["weight_decay"] == 0.001
    bad = ["run", "--tasks", "yacht", "--uci-dir", str(uci_dir), "--results", str(tmp_path / "b")]
    assert main([*bad, "--sigma", "val"]) == 2
    assert "sigma='val' need(s) a validation part" in capsys.readouterr().err
