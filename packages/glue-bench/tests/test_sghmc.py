"""SGHMC (serial and parallel, partialbayes.sgmcmc) as methods of the grid, on a tiny BERT (issue 35)."""

import math

import torch

from partialbayes.glue_bench.context import Settings
from partialbayes.glue_bench.experiment import Grid, RunConfig, run_grid
from partialbayes.glue_bench.methods import SGHMC_CHAINS
from partialbayes.glue_bench.store import iter_records
from partialbayes.glue_bench.train import TrainConfig


def test_serial_and_parallel_sghmc_cells(tmp_path, mini_glue, tiny_bert_factory):
    torch.set_num_threads(1)
    settings = Settings(n_samples=3, swag_lrs=(1e-2,), swag_steps=8, skfac_percents=(20.0,))
    config = RunConfig(model="tiny-bert", train=TrainConfig(epochs=1, batch_size=8, max_length=32, lr=1e-3),
                       settings=settings, max_train_examples=16)  # fmt: skip
    methods = ["map", "sghmc-full", "psghmc-skfac", "psghmc-full"]
    grid = Grid(["sst2"], [0], methods, config, tmp_path, glue_dir=mini_glue,
                model_factory=lambda n, c, d: tiny_bert_factory(c), progress=False)  # fmt: skip
    store = run_grid(grid)
    assert not store.failures
    records = {r["method"]: r for r in iter_records(store.root)}
    assert set(records) == set(methods)
    for name in methods[1:]:
        r = records[name]
        assert math.isfinite(r["nll"])
        assert 0 <= r["accuracy"] <= 1
        states = 4 if name == "sghmc-full" else SGHMC_CHAINS  # the second half of 8 steps, thin 1
        assert r["extra"]["sghmc_states"] == states
        assert r["floats"] == states * r["n_stochastic"]
    assert records["psghmc-skfac"]["n_stochastic"] < records["psghmc-full"]["n_stochastic"]
    assert records["sghmc-full"]["n_stochastic"] == records["psghmc-full"]["n_stochastic"]
