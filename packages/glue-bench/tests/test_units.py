"""Units of work (task, split) on one results folder: claims, executors (local, Ray), the CLI's unit flags,
the user's own checkpoint (``--epochs 0``), and the glue-bench defects of issue #27."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from partialbayes.glue_bench import experiment
from partialbayes.glue_bench.cli import main, parse_splits
from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.store import (
    ResultStore,
    UnitBusyError,
    iter_records,
    without_timings,
)
from partialbayes.glue_bench.train import TrainConfig

TRAIN = dict(epochs=1, batch_size=8, max_length=32, patience=1, lr=1e-3)


def _config(model="tiny-bert", **train):
    return RunConfig(
        model=model,
        train=TrainConfig(**{**TRAIN, **train}),
        settings=Settings(n_samples=2, skfac_percents=(20.0,)),
        max_train_examples=16,
        max_test_examples=8,
    )


def _grid(root, glue, factory=None, methods=("map",), model="tiny-bert", splits=(0,), **kw):
    torch.set_num_threads(1)
    make = None if factory is None else (lambda name, c, d: factory(c))
    config = kw.pop("config", None) or _config(model)
    executor = kw.pop("executor", "local")
    grid = Grid(["sst2"], list(splits), list(methods), config, root, glue_dir=glue,
                model_factory=make, progress=False, **kw)  # fmt: skip
    return run_grid(grid, executor=executor)


def _saved(folder, factory, num_labels=2, head=True):
    """A tiny BERT (with its classification head, or only the encoder) and its tokenizer in ``folder``."""
    model, tokenizer = factory(num_labels)
    (model if head else model.bert).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _records(root):
    out = {}
    for r in iter_records(root):
        r = without_timings(r)
        r["extra"].pop("shared_cells", None)
        out[(r["split"], r["method"], r["size"])] = r
    return out


# ------------------------------------------------------------------------------------------ claims
def test_a_unit_claimed_by_a_live_process_is_left_to_it(
    tmp_path, mini_glue, tiny_bert_factory, caplog
):
    """Two workers on one unit: the second is refused (nothing written), never a second fine-tuning."""
    store = ResultStore(tmp_path / "res", _config().to_dict())
    with store.unit_claim("sst2", 0):  # this process is alive: a second claim must be refused
        busy = pytest.raises(UnitBusyError, match=rf"claimed by host .* pid {os.getpid()}")
        with busy, store.unit_claim("sst2", 0):
            pass
        got = _grid(tmp_path / "res", mini_glue, tiny_bert_factory, keep_going=True)
        assert len(got.failures) == 1
        assert "sst2/split0: unit sst2 split 0 is claimed by" in got.failures[0]
        assert "--take-over" in got.failures[0]
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == [f"[sst2 split 0] skipped: {got.failures[0].split(': ', 1)[1]}"]
        assert not (tmp_path / "res" / "records").exists()
        assert not (tmp_path / "res" / "checkpoints").exists()
    assert not (tmp_path / "res" / "claims").exists()  # released on exit, the empty folder removed
    _grid(tmp_path / "res", mini_glue, tiny_bert_factory)
    assert [r["method"] for r in iter_records(tmp_path / "res")] == ["map"]


def test_stale_claims_are_taken_over(tmp_path, mini_glue, tiny_bert_factory):
    """A dead process's claim on this host is taken over; another host's only with take_over."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    pid = int(dead.stdout)
    claims = tmp_path / "res" / "claims"
    claims.mkdir(parents=True)
    host = __import__("socket").gethostname()
    owner = {"host": host, "pid": pid, "started": "then", "token": "t"}
    (claims / "sst2-split0.json").write_text(json.dumps(owner))
    _grid(tmp_path / "res", mini_glue, tiny_bert_factory)
    assert [r["split"] for r in iter_records(tmp_path / "res")] == [0]
    # a claim from another machine cannot be checked: refused, then taken over on request
    other = {**owner, "host": "elsewhere", "pid": 1}
    (claims / "sst2-split1.json").write_text(json.dumps(other))
    got = _grid(tmp_path / "res", mini_glue, tiny_bert_factory, splits=(1,), keep_going=True)
    assert "claimed by host elsewhere pid 1 since then" in got.failures[0]
    _grid(tmp_path / "res", mini_glue, tiny_bert_factory, splits=(1,), take_over=True)
    assert sorted(r["split"] for r in iter_records(tmp_path / "res")) == [0, 1]
    assert not list(claims.iterdir())


def test_a_run_killed_before_any_result_does_not_block_the_rerun(
    tmp_path, mini_glue, tiny_bert_factory, monkeypatch
):
    """Killed while fine-tuning: no config.json, no claim left, and another configuration may follow."""

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "finetune", killed)
    with pytest.raises(KeyboardInterrupt):
        _grid(tmp_path / "res", mini_glue, tiny_bert_factory)
    assert not (tmp_path / "res").exists()  # no claim left, nor the empty folders it needed
    monkeypatch.undo()
    # a folder bound by an old config.json and data fingerprint but holding no record does not refuse
    old = ResultStore(tmp_path / "res", _config(seed=5).to_dict())
    old.check_data("sst2", {"sha256": "other data"})
    old.claim()
    _grid(tmp_path / "res", mini_glue, tiny_bert_factory)
    assert (
        json.loads((tmp_path / "res" / "config.json").read_text())["config"]["train"]["seed"] == 0
    )
    # once a record exists, the folder is bound
    with pytest.raises(ValueError, match=r"another configuration.*\['train'\]"):
        _grid(tmp_path / "res", mini_glue, tiny_bert_factory, config=_config(seed=5))


# ------------------------------------------------------------------------------------------ the CLI
def test_splits_are_bounded_before_they_are_expanded(capsys):
    start = time.perf_counter()
    for text in ("0-100000000", "0-100000000000", "3,0-99999999999999999999"):
        with pytest.raises(Exception, match="beyond 0-999"):
            parse_splits(text)
    assert time.perf_counter() - start < 1.0  # nothing of that size was built
    with pytest.raises(SystemExit) as exc:
        main(["run", "--splits", "0-100000000000"])
    assert exc.value.code == 2
    assert "beyond 0-999" in capsys.readouterr().err
    assert parse_splits("0-999") == list(range(1000))


@pytest.mark.parametrize("argv", [["run", "--task", "mrpc"], ["report", "--res", "x"]])
def test_options_cannot_be_abbreviated(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


def test_every_command_shows_its_own_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    quick = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    run = " ".join(capsys.readouterr().out.split())
    for text in ("fine-tuning (5; 0:", "MC samples (8)", "10^-3 ... 10^3", "(1024; None"):
        assert text in quick
    for text in ("fine-tuning (10; 0:", "MC samples (50)", "10^-1 ... 10^3", "(None; None"):
        assert text in run
    for text in ("AdamW learning rate (5e-05)", "fine-tuning batch (16)"):
        assert text in quick
        assert text in run


def test_lr_and_batch_size_reach_the_configuration(tmp_path, mini_glue, tiny_bert_factory):
    folder = _saved(tmp_path / "model", tiny_bert_factory)
    argv = ["run", "--model", str(folder), "--glue-dir", str(mini_glue), "--results", str(tmp_path)]
    argv += ["--methods", "map", "--max-train-examples", "16", "--max-test-examples", "8"]
    argv += ["--epochs", "1", "--lr", "0.002", "--batch-size", "4", "--no-progress"]
    torch.set_num_threads(1)
    assert main(argv) == 0
    train = json.loads((tmp_path / "config.json").read_text())["config"]["train"]
    assert (train["lr"], train["batch_size"]) == (0.002, 4)


def test_list_units_and_run_one_unit(tmp_path, mini_glue, tiny_bert_factory, capsys):
    """The Slurm recipe: --list-units, then one array task per --unit INDEX."""
    folder = _saved(tmp_path / "model", tiny_bert_factory)
    argv = ["run", "--model", str(folder), "--glue-dir", str(mini_glue), "--splits", "0-2"]
    argv += ["--results", str(tmp_path / "res"), "--methods", "map", "--max-train-examples", "16"]
    argv += ["--max-test-examples", "8", "--epochs", "1", "--no-progress"]
    assert main([*argv, "--list-units"]) == 0
    out = capsys.readouterr().out
    assert "0\tsst2\tsplit 0\n1\tsst2\tsplit 1\n2\tsst2\tsplit 2\n" in out
    assert "3 units; run one with --unit INDEX (Slurm: --array=0-2)" in out
    assert not (tmp_path / "res").exists()
    torch.set_num_threads(1)
    assert main([*argv, "--unit", "1"]) == 0
    assert [r["split"] for r in iter_records(tmp_path / "res")] == [1]
    # the library's messages, one printed line each; fine-tuning's lines name the unit too
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[sst2 split 1] preparing model {folder}"
    assert lines[1].startswith("[sst2 split 1] epoch 1/1: train loss ")
    assert lines[2].startswith("[sst2 split 1] MAP val accuracy ")
    assert lines[3].startswith("[sst2 split 1] map -: acc ")
    assert lines[4:] == [
        f"results in {tmp_path / 'res'}; summarise with: glue-bench report --results {tmp_path / 'res'}"
    ]
    package = logging.getLogger("partialbayes.glue_bench")
    assert (package.handlers, package.level) == (
        [],
        logging.NOTSET,
    )  # main leaves no handler behind
    assert main([*argv, "--unit", "3"]) == 2
    assert "--unit 3 is out of range: this grid has 3 units (0-2" in capsys.readouterr().err
    assert main([*argv, "--unit", "0", "--shard", "0/2"]) == 2


# ------------------------------------------------------------------------------------------ models
def test_model_folders_that_cannot_serve_are_refused_before_any_work(tmp_path, tiny_bert_factory):
    from partialbayes.glue_bench.models import load_encoder

    res = tmp_path / "res"
    with pytest.raises(ValueError, match=r"'.*missing': no such folder"):
        _grid(res, None, model=str(tmp_path / "missing"))
    no_tokenizer = tmp_path / "no-tokenizer"
    tiny_bert_factory(2)[0].save_pretrained(no_tokenizer)
    with pytest.raises(ValueError, match=r"holds no tokenizer \(none of tokenizer.json, vocab.txt"):
        _grid(res, None, model=str(no_tokenizer))
    assert not res.exists()
    # a tokenizer of another, larger vocabulary than the model's embeddings
    model, tokenizer = tiny_bert_factory(2)
    model.resize_token_embeddings(20)
    small = tmp_path / "small-vocab"
    model.save_pretrained(small)
    tokenizer.save_pretrained(small)
    with pytest.raises(ValueError, match=r"has \d+ tokens but the model only 20 embeddings"):
        load_encoder(str(small), 2)


def test_loading_weights_bar_is_silent_without_progress(tmp_path, tiny_bert_factory, capfd):
    from partialbayes.glue_bench.models import load_encoder

    folder = _saved(tmp_path / "model", tiny_bert_factory)
    capfd.readouterr()
    load_encoder(str(folder), 2, progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    load_encoder(str(folder), 2, progress=True)
    assert "Loading weights" in capfd.readouterr().err


def test_epochs_0_takes_the_folder_as_the_map(tmp_path, mini_glue, tiny_bert_factory, monkeypatch):
    """--model FOLDER --epochs 0: no fine-tuning, the folder's weights score; validation still serves."""
    folder = _saved(tmp_path / "model", tiny_bert_factory)
    reference, _ = tiny_bert_factory(2)
    from partialbayes.glue_bench import train

    def no_step(*args, **kwargs):
        raise AssertionError("fine-tuned although --epochs 0")

    monkeypatch.setattr(train, "train_epoch", no_step)
    store = _grid(
        tmp_path / "res",
        mini_glue,
        model=str(folder),
        methods=("map", "temperature", "skfac"),
        config=_config(str(folder), epochs=0),
    )
    assert not store.failures
    meta = json.loads(next((tmp_path / "res" / "checkpoints").rglob("meta.json")).read_text())
    assert (meta["best_epoch"], meta["history"]) == (0, [])
    ckpt = next((tmp_path / "res" / "checkpoints").rglob("model.safetensors"))
    from safetensors.torch import load_file

    weights = load_file(str(ckpt))
    assert all(torch.equal(weights[k], v) for k, v in reference.state_dict().items())
    recs = {r["method"]: r for r in iter_records(tmp_path / "res")}
    assert set(recs) == {"map", "temperature", "skfac"}
    assert recs["temperature"]["extra"]["temperature"] > 0
    assert recs["skfac"]["extra"]["prior_precision"] > 0


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("encoder", r"has no trained classification head \(not in the checkpoint: classifier.bias"),
        ("three labels", r"classifies into 3 labels, the task has 2"),
    ],
)
def test_epochs_0_refuses_what_is_not_a_classifier_for_the_task(
    kind, match, tmp_path, mini_glue, tiny_bert_factory
):
    if kind == "encoder":
        folder = _saved(tmp_path / "model", tiny_bert_factory, head=False)
    else:
        folder = _saved(tmp_path / "model", tiny_bert_factory, num_labels=3)
    with pytest.raises(ValueError, match=match):
        _grid(tmp_path / "res", mini_glue, model=str(folder), config=_config(str(folder), epochs=0))
    assert not (tmp_path / "res").exists()  # issue 34: not even an empty claims/ folder


# ------------------------------------------------------------------------------------------ data
def test_the_hub_fallback_says_what_it_tried(tmp_path, monkeypatch):
    from partialbayes.glue_bench.data_glue import load_glue

    monkeypatch.delenv("PARTIALBAYES_DATA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:  # the hub extra: its error is the hub's; without it (the README's plain set-up), the ImportError
        import datasets  # noqa: F401

        tried = r"OSError: .*HF_HUB_OFFLINE is set"
    except ImportError:
        tried = r"ImportError: .*partialbayes-glue-bench\[hub\]"
    with pytest.raises(FileNotFoundError, match=rf"hub .* was tried instead and failed: {tried}"):
        load_glue("mrpc")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FileNotFoundError, match=r"ImportError: .*partialbayes-glue-bench\[hub\]"):
        load_glue("mrpc")


# ------------------------------------------------------------------------------------------ Ray
def test_ray_needs_its_extra(tmp_path, mini_glue, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"partialbayes-glue-bench\[ray\]"):
        _grid(tmp_path / "res", mini_glue, model="minilm", executor="ray")
    assert not (tmp_path / "res").exists()


def _ray():
    """Ray, imported as glue-bench imports it (its `uv run` hook off), or a skip."""
    from partialbayes.glue_bench.executors import import_ray

    try:
        return import_ray()
    except ImportError:
        pytest.skip("ray is not installed (extra 'ray')")


def test_a_ray_address_that_does_not_answer_fails_at_once(tmp_path, mini_glue, capsys):
    _ray()
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    argv = ["run", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--methods", "map"]
    assert main([*argv, "--glue-dir", str(mini_glue), "--results", str(tmp_path / "res")]) == 2
    assert time.perf_counter() - start < 20
    err = capsys.readouterr().err
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err
    assert not (tmp_path / "res").exists()
    argv = [*argv[:4], "not an address", "--results", str(tmp_path / "res")]
    assert main(argv) == 2
    assert "--ray-address must be HOST:PORT" in capsys.readouterr().err


WORKER = """
import logging, sys
from partialbayes.glue_bench.executors import UnitResult, on_worker

def job(task, split):
    logging.getLogger("partialbayes.glue_bench.experiment").info(f"[{task} split {split}] progress")
    logging.getLogger("partialbayes.glue_bench.experiment").warning(f"[{task} split {split}] FAILED")
    return UnitResult()

if sys.argv[2] == "configured":  # the user's own logging in the worker: left alone
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stdout)
for split in (0, 1):  # a worker process runs several units: one handler, not one per unit
    on_worker(job, "sst2", split, sys.argv[1])
"""


@pytest.mark.parametrize("logging_set_up", [False, True])
def test_a_ray_worker_prints_its_progress(tmp_path, logging_set_up):
    """A fresh worker process has no logging set up: ``on_worker`` prints the unit's lines, as before."""
    (probe := tmp_path / "probe").write_text("driver")
    argv = [sys.executable, "-c", WORKER, str(probe), "configured" if logging_set_up else "fresh"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()
    if logging_set_up:
        assert out == [f"WARNING [sst2 split {k}] FAILED" for k in (0, 1)]
    else:
        assert out == [f"[sst2 split {k}] {m}" for k in (0, 1) for m in ("progress", "FAILED")]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster of two worker processes on loopback."""
    ray = _ray()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_units_give_the_local_records(ray_cluster, tmp_path, mini_glue, tiny_bert_factory):
    """Two units on two Ray workers write the records a local run writes (timings aside)."""
    folder = _saved(tmp_path / "model", tiny_bert_factory)
    methods = ("map", "temperature", "skfac")
    kw = dict(model=str(folder), methods=methods, splits=(0, 1), config=_config(str(folder)))
    local = _grid(tmp_path / "local", mini_glue, **kw)
    remote = _grid(tmp_path / "ray", mini_glue, executor="ray", **kw)
    assert local.failures == remote.failures == []
    assert _records(tmp_path / "ray") == _records(tmp_path / "local")
    assert len(_records(tmp_path / "ray")) == 2 * 3
    assert not list((tmp_path / "ray").glob(".glue-bench-probe-*"))
    assert not list((tmp_path / "ray").glob("claims/*"))  # every claim released
    # a rerun on the cluster finds every cell done
    again = _grid(tmp_path / "ray", mini_glue, executor="ray", **kw)
    assert not again.failures


def test_a_results_folder_the_workers_do_not_see_is_named(
    ray_cluster, tmp_path, mini_glue, tiny_bert_factory, monkeypatch
):
    """The workers check the probe file the driver wrote; here the driver writes it elsewhere."""
    from partialbayes.glue_bench import executors

    folder = _saved(tmp_path / "model", tiny_bert_factory)
    real = executors.atomic_write
    monkeypatch.setattr(executors, "atomic_write", lambda p, c: real(tmp_path / "elsewhere", c))
    with pytest.raises(
        FileNotFoundError, match=r"on Ray worker .* this is not the driver's folder"
    ):
        _grid(
            tmp_path / "res",
            mini_glue,
            model=str(folder),
            config=_config(str(folder)),
            executor="ray",
        )
    assert not (tmp_path / "res" / "records").exists()


def test_a_prior_at_the_edge_of_its_grid_is_said_at_run_time(tmp_path, caplog):
    # Issue 34: it was reported only in report/prior_edges.md.
    from partialbayes.glue_bench.experiment import _Unit

    caplog.set_level(logging.INFO, logger="partialbayes.glue_bench")
    unit = _Unit(None, "sst2", 0, ResultStore(tmp_path / "res", _config().to_dict()))
    record = {"accuracy": 0.9, "nll": 0.3, "ece": 0.05, "seconds": 1.0, "cpu_seconds": 1.0}
    edge = {"prior_precision": 0.001, "prior_at_grid_edge": "lowest"}
    unit.done("skfac", "1.0", {**record, "extra": edge})
    unit.done("skfac", "6.8", {**record, "extra": {**edge, "prior_at_grid_edge": None}})
    lines = caplog.messages
    assert lines[0].endswith(
        "its prior precision 0.001 is the lowest value of the grid: widen it (--prior-grid)"
    )
    assert lines[1].endswith("(1.0 s)")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]  # a problem, a result
