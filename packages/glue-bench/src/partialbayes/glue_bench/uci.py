"""The paper's UCI regression experiments (appendix B): MLP, Laplace on module subsets, SWAG.

Metrics are in the original target units: RMSE and the mean Gaussian negative log-likelihood of the
predictive ``N(mean, var)``. Records go to the same kind of results store as GLUE (task = dataset name).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partialbayes import selection
from partialbayes.curvature import DenseLaplace, KronLaplace, diag_curvature
from partialbayes.glue_bench.context import PRIOR_GRID as PRIOR_GRID  # re-exported: the UCI grid
from partialbayes.glue_bench.context import every_linear_map, prior_edge, prior_grid
from partialbayes.glue_bench.data_uci import UCI_DATASETS, UCISplit, load_uci
from partialbayes.glue_bench.models import MLP
from partialbayes.glue_bench.store import Cell, ResultStore, grid_units
from partialbayes.selection import Subset
from partialbayes.swag import collect_swag

UCI_METHODS = (
    "map",
    "last-layer",
    "kfac-full",
    "kfac-random",
    "kfac-max",
    "kfac-min",
    "swag-full",
    "subnet-norm",
    "subnet-variance",
)
# Percent-of-parameters ramp of the norm- vs variance-based subnetwork comparison (the paper's Figs. 9, 10;
# the authors' UCI code ramps the same percentages).
SUBNET_PERCENTS = (1.0, 2.0, 5.0, 8.0, 14.0, 23.0, 37.0, 61.0, 100.0)


def train_mlp(
    split: UCISplit,
    width: int = 50,
    depth: int = 2,
    steps: int = 2000,
    lr: float = 1e-2,
    seed: int = 0,
) -> tuple[MLP, float]:
    """Full-batch Adam on the squared error (weight decay 1e-4) in standardised units.

    Returns:
        ``(model in eval mode, sigma_noise)`` with ``sigma_noise`` the training residual RMS (standardised).
    """
    torch.manual_seed(seed)
    x, y = split.x_train.float(), split.y_train.float()
    model = MLP(x.shape[1], width, depth)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x).squeeze(-1) - y) ** 2).mean()
        loss.backward()
        opt.step()
    if not torch.isfinite(loss):
        raise FloatingPointError("UCI MLP training diverged")
    model.eval()
    with torch.no_grad():
        sigma = float(((model(x).squeeze(-1) - y) ** 2).mean().sqrt())
    return model, max(sigma, 1e-3)


def gaussian_metrics(
    mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor, y_std: float
) -> dict[str, float]:
    """RMSE and mean Gaussian NLL in original units, from standardised ``mean``, ``var``, ``y`` (N,)."""
    var = var.clamp_min(1e-12)
    rmse = float(((mean - y) ** 2).mean().sqrt()) * y_std
    nll = float((0.5 * (torch.log(2 * math.pi * var) + (y - mean) ** 2 / var)).mean()) + math.log(
        y_std
    )
    if not (math.isfinite(rmse) and math.isfinite(nll)):
        raise ValueError("non-finite UCI metrics")
    return {"rmse": rmse, "nll": nll}


def _subset(model: nn.Module, method: str, k: int, seed: int) -> Subset:
    if method == "last-layer":
        return selection.last_layer(model)
    if method == "kfac-full" or method == "swag-full":
        return every_linear_map(model)
    if method == "kfac-random":
        return selection.random_modules(model, k, seed=seed, group="all")
    if method == "kfac-max":
        return selection.max_operator_norm(model, k, group="all")
    return selection.min_operator_norm(model, k, group="all")


def _sizes(model: nn.Module, method: str) -> list[str]:
    if method in ("kfac-random", "kfac-max", "kfac-min"):
        return [str(k) for k in range(1, len(selection.linear_modules(model)) + 1)]
    if method in ("subnet-norm", "subnet-variance"):
        return [f"{p:g}" for p in SUBNET_PERCENTS]
    return ["-"]


def subnet_subset(
    model: nn.Module, method: str, percent: float, x: torch.Tensor, y: torch.Tensor, sigma: float
) -> Subset:
    """The elementwise subnetwork of the norm- vs variance-based comparison (Figs. 9, 10).

    ``subnet-norm`` keeps the ``percent`` % of weights and biases with the largest magnitude;
    ``subnet-variance`` those with the largest marginal variance under a diagonal GGN Laplace (Daxberger et
    al., 2021): with a scalar prior ``δ`` that is ``1 / (h_i / σ² + δ)``, ascending GGN diagonal ``h_i``
    whatever ``δ``, so no prior is fitted. ``x`` (N, D), ``y`` (N,) and ``sigma`` are standardised.
    """
    if method == "subnet-norm":
        return selection.largest_magnitude(model, percent)
    if method != "subnet-variance":
        raise ValueError(f"method must be 'subnet-norm' or 'subnet-variance', got {method!r}")
    full = every_linear_map(model)
    h = diag_curvature(model, [(x, y[:, None])], full, likelihood="regression", sigma_noise=sigma)
    params = dict(model.named_parameters())
    variances = {
        n: 1.0 / (full.scatter(n, h[n].to(params[n].dtype), torch.zeros_like(params[n])) + 1.0)
        for n in full.names
    }
    return selection.largest_marginal_variance(model, variances, percent)


def run_uci_cell(
    model: nn.Module, sigma: float, split: UCISplit, method: str, size: str, seed: int
) -> dict[str, Any]:
    """One UCI cell: fit the posterior on the training part, predict the test part.

    The Laplace prior precision maximises the marginal likelihood over :data:`PRIOR_GRID` (UCI has no
    validation part in the standard splits); ``extra.prior_at_grid_edge`` says when it is an end of the grid.
    """
    x_tr, y_tr = split.x_train.float(), split.y_train.float()
    x_te, y_te = split.x_test.float(), split.y_test.double()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {"sigma_noise": sigma}
    if method == "map":
        with torch.no_grad():
            mean = model(x_te).squeeze(-1).double()
        var = torch.full_like(mean, sigma**2)
        fit, floats, n_stoch = 0.0, 0, 0
    elif method == "swag-full":
        subset = _subset(model, method, 0, seed)
        # collect_swag takes dict batches (it moves each tensor entry to the model's device)
        batches = [{"x": x_tr[i : i + 32], "y": y_tr[i : i + 32]} for i in range(0, len(x_tr), 32)]

        def loss_fn(m: nn.Module, b: Mapping[str, Any]) -> torch.Tensor:
            return ((m(b["x"]).squeeze(-1) - b["y"]) ** 2).mean()

        swag = collect_swag(
            model, subset, batches, lr=1e-2, n_steps=500, loss_fn=loss_fn, progress=False
        )
        fit = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(seed)
        outs = []
        for _ in range(30):
            with swag.sampled(generator=gen), torch.no_grad():
                outs.append(model(x_te).squeeze(-1).double())
        stack = torch.stack(outs)
        mean, var = stack.mean(0), stack.var(0) + sigma**2
        floats, n_stoch = int(swag.num_floats), subset.num_entries()
    else:
        if method.startswith("subnet-"):
            subset = subnet_subset(model, method, float(size), x_tr, y_tr, sigma)
        else:
            subset = _subset(model, method, int(size) if size != "-" else 0, seed)
        dense = method == "last-layer" or method.startswith("subnet-")
        la = (DenseLaplace if dense else KronLaplace)(
            model, subset, likelihood="regression", sigma_noise=sigma
        )
        la.fit([(x_tr, y_tr[:, None])])
        extra["prior_precision"] = la.optimize_prior_precision("marglik", grid=prior_grid())
        extra["prior_at_grid_edge"] = prior_edge(extra["prior_precision"], PRIOR_GRID)
        fit = time.perf_counter() - t0
        f, cov = la.logit_mean_cov(x_te)
        mean = f.squeeze(-1).double()
        var = cov[:, 0, 0].double().clamp_min(0) + sigma**2
        floats, n_stoch = int(la.num_floats), subset.num_entries()
    predict = time.perf_counter() - t0 - fit
    total = sum(p.numel() for p in model.parameters())
    return {
        **gaussian_metrics(mean, var, y_te, split.y_std),
        "n_test": len(y_te),
        "floats": floats,
        "n_stochastic": n_stoch,
        "percent_stochastic": 100.0 * n_stoch / total,
        "fit_seconds": fit,
        "predict_seconds": predict,
        "extra": extra,
    }


def run_uci(
    datasets: Sequence[str],
    splits: Sequence[int],
    methods: Sequence[str],
    results: str | Path,
    uci_dir: str | Path | None = None,
    shard: tuple[int, int] = (0, 1),
    seed: int = 0,
    device: str = "cpu",
    log: Callable[[str], None] = print,
    keep_going: bool = False,
) -> ResultStore:
    """Fill the UCI grid (dataset, split, method, size) of this shard; finished cells are skipped.

    One (dataset, split) unit at a time, in this process: train its MLP, run its cells. ``shard=(i, n)``
    keeps every n-th unit. With ``keep_going`` a failing cell is logged and skipped (in ``store.failures``;
    a later run retries it); loading data and training the MLP always raise.

    Raises:
        ValueError: An unknown dataset or a method that has no UCI version (the message lists the valid
            ones), before any work.
    """
    bad = [d for d in datasets if d not in UCI_DATASETS]
    if bad:
        raise ValueError(f"unknown UCI dataset(s) {bad}; valid datasets: {', '.join(UCI_DATASETS)}")
    bad = [m for m in methods if m not in UCI_METHODS]
    if bad:
        raise ValueError(
            f"method(s) {bad} have no UCI version; valid UCI methods: {', '.join(UCI_METHODS)}"
        )
    if str(device) != "cpu":
        log("UCI models are tiny: running them on cpu")
    store = ResultStore(
        results, {"kind": "uci", "width": 50, "depth": 2, "steps": 2000, "seed": seed}
    )
    for name, split in grid_units(datasets, splits, shard):
        data = load_uci(name, split, uci_dir)
        model, sigma = train_mlp(data, seed=seed * 100 + split)
        for method in sorted(set(methods)):
            for size in _sizes(model, method):
                cell = Cell(name, split, method, size)
                if store.has(cell):
                    continue
                try:
                    rec = run_uci_cell(model, sigma, data, method, size, seed * 100 + split)
                except Exception as err:  # one broken cell must not stop the grid
                    store.failures.append(
                        f"{name}/split{split}/{method}/{size}: {type(err).__name__}: {err}"
                    )
                    log(f"[{name} split {split}] {method} {size}: FAILED ({store.failures[-1]})")
                    if not keep_going:
                        raise
                    continue
                store.write(cell, rec)
                log(
                    f"[{name} split {split}] {method} {size}: rmse {rec['rmse']:.3f} nll {rec['nll']:.3f}"
                )
    return store
