import json

import pytest
import torch

from partialbayes.glue_bench import experiment
from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.store import Cell, ResultStore, grid_units, parse_shard
from partialbayes.glue_bench.train import TrainConfig

TIMING = {"fit_seconds", "predict_seconds", "seconds", "cpu_seconds"}


def test_record_roundtrip_and_atomic_layout(tmp_path):
    store = ResultStore(tmp_path, {"model": "m", "seed": 0})
    cell = Cell("rte", 3, "skfac", "12.6")
    assert not store.has(cell)
    store.write(cell, {"nll": 0.5})
    assert store.has(cell)
    rec = store.read(cell)
    assert rec["nll"] == 0.5
    assert (rec["task"], rec["split"], rec["method"], rec["size"]) == ("rte", 3, "skfac", "12.6")
    assert not list(tmp_path.rglob("*.tmp*"))


def test_refuses_other_configuration(tmp_path):
    ResultStore(tmp_path, {"model": "m", "seed": 0})
    # nothing stored yet: the folder is not bound to a configuration
    assert not (tmp_path / "config.json").exists()
    ResultStore(tmp_path, {"model": "m", "seed": 1})
    ResultStore(tmp_path, {"model": "m", "seed": 0}).write(Cell("rte", 0, "map", "-"), {"nll": 1})
    ResultStore(tmp_path, {"model": "m", "seed": 0})  # same config: fine
    with pytest.raises(ValueError, match=r"another configuration.*\['seed'\]"):
        ResultStore(tmp_path, {"model": "m", "seed": 1})


def test_parse_shard():
    assert parse_shard(None) == (0, 1)
    assert parse_shard("2/5") == (2, 5)
    for bad in ("5/5", "a/b", "1", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_shards_partition_the_grid_into_task_split_units():
    units = grid_units(["rte", "sst2"], range(5))
    assert units == sorted((t, s) for t in ("rte", "sst2") for s in range(5))
    parts = [grid_units(["rte", "sst2"], range(5), (i, 4)) for i in range(4)]
    flat = [u for p in parts for u in p]
    assert sorted(flat) == units
    assert len(set(flat)) == len(units)
    # independent of the order the caller lists tasks and splits in
    assert grid_units(["sst2", "rte"], [4, 3, 2, 1, 0], (1, 4)) == parts[1]


def _config():
    return RunConfig(
        model="tiny",
        train=TrainConfig(epochs=2, batch_size=8, max_length=32, patience=1, lr=1e-3),
        settings=Settings(
            n_samples=2,
            swag_lrs=(1e-2,),
            swag_sweep_steps=10,
            swag_steps=10,
            module_counts=(1, 2, 3),
        ),
        max_train_examples=32,
    )


def _grid(root, mini_glue, factory):
    return run_grid(
        Grid(
            ["sst2"],
            [0],
            ["map", "temperature", "swag-random"],
            _config(),
            root,
            glue_dir=mini_glue,
            model_factory=lambda n, c, d: factory(c),
            progress=False,
        ),
    )


def _records(root):
    return {
        p.relative_to(root / "records"): json.loads(p.read_text())
        for p in sorted((root / "records").rglob("*.json"))
    }


def _strip(rec):
    return {k: v for k, v in rec.items() if k not in TIMING}


def test_interrupted_run_resumes_without_recomputing(
    tmp_path, mini_glue, tiny_bert_factory, monkeypatch
):
    pytest.importorskip("partialbayes.swag")
    torch.set_num_threads(1)
    clean = tmp_path / "clean"
    _grid(clean, mini_glue, tiny_bert_factory)
    expected = _records(clean)
    assert len(expected) == 5

    real = experiment.run_cell
    calls = []

    def interrupting(ctx, method, size):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append((method.name, size))
        return real(ctx, method, size)

    root = tmp_path / "resumed"
    monkeypatch.setattr(experiment, "run_cell", interrupting)
    with pytest.raises(KeyboardInterrupt):
        _grid(root, mini_glue, tiny_bert_factory)
    first = _records(root)
    assert len(first) == 3
    before = {p: (root / "records" / p).read_bytes() for p in first}

    # rerun: the checkpoint is reused (no fine-tuning) and only the missing cells run
    def no_training(*a, **k):
        raise AssertionError("fine-tuned again instead of reusing the checkpoint")

    monkeypatch.setattr(experiment, "finetune", no_training)
    calls.clear()
    monkeypatch.setattr(
        experiment, "run_cell", lambda c, m, s: (calls.append((m.name, s)), real(c, m, s))[1]
    )
    _grid(root, mini_glue, tiny_bert_factory)
    assert calls == [("swag-random", "2"), ("swag-random", "3")]
    assert all((root / "records" / p).read_bytes() == b for p, b in before.items())
    resumed = _records(root)
    assert {p: _strip(r) for p, r in resumed.items()} == {p: _strip(r) for p, r in expected.items()}

    calls.clear()
    _grid(root, mini_glue, tiny_bert_factory)
    assert calls == []


def test_temporary_names_are_unique_across_machines(tmp_path, monkeypatch):
    """Two machines with the same process id writing one shared folder must not share a temporary file."""
    import os
    import socket

    from partialbayes.glue_bench.figures import pyplot, save_figure
    from partialbayes.glue_bench.store import atomic_write

    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(socket, "gethostname", lambda: "node 7")
    real = os.replace
    sources: list[str] = []

    def spy(src, dst):
        sources.append(os.path.basename(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    for _ in range(2):
        atomic_write(tmp_path / "a.json", '{"x": 1}')
        atomic_write(tmp_path / "a.md", lambda tmp: tmp.write_text("x"))
        save_figure(pyplot().figure(), tmp_path / "a.png")
    assert len(sources) == 6
    assert len(set(sources)) == 6  # a random token, not only the pid
    for name in sources:
        assert "-node_7-4242-" in name  # host name (sanitised) and pid, for debugging
    assert not list(tmp_path.glob(".*"))
