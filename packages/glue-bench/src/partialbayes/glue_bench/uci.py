"""UCI regression with Laplace and SWAG posteriors: the paper's protocol (appendix B) and the literature's.

The presets (:data:`PROTOCOLS`) and the metrics (RMSE, Gaussian NLL, original units) are described in the
how-to's UCI sections; records go to a results store like GLUE's (task = dataset name).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from partialbayes import selection
from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace, diag_curvature
from partialbayes.glue_bench.context import PRIOR_GRID, every_linear_map, prior_edge, prior_grid
from partialbayes.glue_bench.data_uci import UCI_DATASETS, UCISplit, load_uci
from partialbayes.glue_bench.methods import Method
from partialbayes.glue_bench.models import MLP
from partialbayes.glue_bench.store import Cell, ResultStore, grid_units, json_ready
from partialbayes.predictive.internal import check_choice, check_finite, check_known
from partialbayes.selection import Subset
from partialbayes.swag import collect_swag

# Percent-of-parameters ramps: the norm- vs variance-based subnetwork Laplace (the paper's Fig. 10) and
# SWAG on the largest-magnitude weights (Fig. 9); the authors' UCI code ramps the same percentages.
SUBNET_PERCENTS = (1.0, 2.0, 5.0, 8.0, 14.0, 23.0, 37.0, 61.0, 100.0)
SIGMA_RULES = ("train", "val", "evidence", "learned")
PRIOR_RULES = ("marglik", "val_nll")
# σ candidates of a validation choice, as multiples of the MAP's validation residual RMS.
SIGMA_FACTORS = tuple(2.0 ** (k / 8) for k in range(-16, 5))
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UCIProtocol:
    """Everything that determines a UCI result besides the data, the split and the seed.

    ``protocol`` names the preset (fingerprinted). Several ``weight_decay`` or ``swag_lrs``: the lowest
    validation error/NLL wins; ``batch_size=None``: full batch (an Adam step per epoch); ``patience=None``:
    no early stopping; ``val_fraction``: the validation share of each training split. ``sigma``: ``train``
    (training residual RMS), ``val`` (each method's σ minimises its validation NLL), ``evidence`` (Laplace:
    guarded marginal likelihood in σ and the prior) or ``learned`` (a log σ trained with the MAP);
    ``prior``: ``marglik`` or ``val_nll`` on ``prior_grid``; SWAG: ``swag_steps`` SGD steps (a snapshot every
    5), ``n_samples`` predictive samples.
    """

    protocol: str = "paper"
    width: int = 50
    depth: int = 2
    epochs: int = 2000
    lr: float = 1e-2
    weight_decay: tuple[float, ...] = (1e-4,)
    batch_size: int | None = None
    val_fraction: float = 0.0
    patience: int | None = None
    sigma: str = "train"
    prior: str = "marglik"
    prior_grid: tuple[float, ...] = PRIOR_GRID
    swag_lrs: tuple[float, ...] = (1e-2,)
    swag_steps: int = 500
    n_samples: int = 30

    def __post_init__(self) -> None:
        check_choice("sigma", self.sigma, SIGMA_RULES)
        check_choice("prior", self.prior, PRIOR_RULES)
        counts = {"width": self.width, "depth": self.depth, "epochs": self.epochs}
        counts.update(swag_steps=self.swag_steps, n_samples=self.n_samples)
        counts.update(batch_size=self.batch_size or 1, patience=self.patience or 1)
        bad = [f"{k}={v}" for k, v in counts.items() if v < 1]
        grids = {"weight_decay": self.weight_decay, "swag_lrs": self.swag_lrs}
        grids.update(prior_grid=self.prior_grid)
        bad += [f"{k}={list(v)}" for k, v in grids.items() if not v or min(v) < 0]
        if bad or self.lr <= 0 or min(self.prior_grid, default=0) <= 0 or min(self.swag_lrs) <= 0:
            raise ValueError(f"bad UCI protocol settings: {', '.join(bad) or 'lr or a grid <= 0'}")
        needs = {
            f"sigma={self.sigma!r}": self.sigma in ("val", "evidence"),
            "prior='val_nll'": self.prior == "val_nll",
            "several weight decays": len(self.weight_decay) > 1,
            "several SWAG learning rates": len(self.swag_lrs) > 1,
            "early stopping (patience)": self.patience is not None,
        }
        needs_val = [what for what, needed in needs.items() if needed]
        if needs_val and not 0 < self.val_fraction <= 0.5:
            raise ValueError(
                f"{', '.join(needs_val)} need(s) a validation part: val_fraction in (0, 0.5], "
                f"got {self.val_fraction}"
            )

    def store_config(self, seed: int) -> dict[str, Any]:
        """The paper preset's keys (``steps`` = epochs) and what differs from it: paper folders keep their fingerprint."""
        paper, mine = json_ready(PROTOCOLS["paper"]), json_ready(self)
        legacy = {"kind": "uci", "width": self.width, "depth": self.depth, "steps": self.epochs}
        rest = {k: v for k, v in mine.items() if k not in ("width", "depth", "epochs")}
        return {**legacy, "seed": seed, **{k: v for k, v in rest.items() if v != paper[k]}}


PROTOCOLS: dict[str, UCIProtocol] = {
    "paper": UCIProtocol(),
    "literature": UCIProtocol(
        protocol="literature",
        depth=1,
        epochs=3000,
        weight_decay=(1e-4, 1e-3, 1e-2),
        val_fraction=0.2,
        patience=100,
        sigma="val",
        prior="val_nll",
        prior_grid=tuple(10.0 ** (k / 2) for k in range(-4, 9)),
        swag_lrs=(3e-3, 1e-2, 3e-2, 1e-1),
    ),
}


# ------------------------------------------------------------------------------------------ the MAP
def _nll(mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean Gaussian NLL (standardised units)."""
    return (0.5 * (torch.log(2 * math.pi * var) + (y - mean) ** 2 / var)).mean()


def train_mlp(
    split: UCISplit,
    protocol: UCIProtocol,
    weight_decay: float,
    seed: int = 0,
    learn_sigma: bool = False,
) -> tuple[MLP, dict[str, Any]]:
    """Adam on the squared error (or, ``learn_sigma``, the Gaussian NLL with a learned log σ), standardised.

    Early stopping keeps the best validation epoch. ``info``: ``epochs``, ``val_loss`` (or ``None``), ``sigma``.
    """
    torch.manual_seed(seed)
    x, y = split.x_train.float(), split.y_train.float()
    model = MLP(x.shape[1], protocol.width, protocol.depth)
    log_sigma = torch.zeros((), requires_grad=True)
    groups = [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    groups += [{"params": [log_sigma], "weight_decay": 0.0}] if learn_sigma else []
    opt = torch.optim.Adam(groups, lr=protocol.lr)

    def loss_of(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        err = (model(xb).squeeze(-1) - yb) ** 2
        if not learn_sigma:
            return err.mean()
        return (0.5 * err * torch.exp(-2 * log_sigma) + log_sigma).mean()

    n, bs = len(x), min(protocol.batch_size or len(x), len(x))
    gen = torch.Generator().manual_seed(seed)
    early = protocol.patience is not None and split.x_val is not None
    best: tuple[float, dict[str, torch.Tensor], float, int] | None = None
    epoch = 0
    for epoch in range(1, protocol.epochs + 1):
        order = torch.randperm(n, generator=gen) if bs < n else None
        for i in range(0, n, bs):
            xb, yb = (x, y) if order is None else (x[order[i : i + bs]], y[order[i : i + bs]])
            opt.zero_grad()
            loss = loss_of(xb, yb)
            loss.backward()
            opt.step()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"UCI MLP training diverged at epoch {epoch}")
        if early:
            with torch.no_grad():
                score = float(loss_of(split.x_val.float(), split.y_val.float()))
            if best is None or score < best[0]:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                best = (score, state, float(log_sigma.detach()), epoch)
            elif epoch - best[3] >= protocol.patience:
                break
    info: dict[str, Any] = {"epochs": epoch, "val_loss": None}
    if best is not None:
        model.load_state_dict(best[1])
        info = {"epochs": best[3], "val_loss": best[0]}
        log_sigma.data.fill_(best[2])
    if learn_sigma:
        info["sigma"] = float(torch.exp(log_sigma.detach()))
    return model.eval(), info


@dataclass
class UCIContext:
    """One (dataset, split) unit: its data, protocol, MAP and the MAP's noise σ (standardised)."""

    data: UCISplit
    protocol: UCIProtocol
    model: nn.Module
    sigma: float
    seed: int
    info: dict[str, Any] = field(default_factory=dict)

    def batches(self, part: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(x, y[:, None])]`` of ``train`` or ``val`` (float32)."""
        x, y = getattr(self.data, f"x_{part}"), getattr(self.data, f"y_{part}")
        return [(x.float(), y.float()[:, None])]

    @property
    def has_val(self) -> bool:
        """Whether the unit has a validation part."""
        return self.data.x_val is not None


def fit_map(data: UCISplit, protocol: UCIProtocol, seed: int = 0) -> UCIContext:
    """Train the MAP (the weight decay with the lowest validation loss) and set its σ by ``protocol.sigma``."""
    learn = protocol.sigma == "learned"
    fits = [(wd, *train_mlp(data, protocol, wd, seed, learn)) for wd in protocol.weight_decay]
    wd, model, info = min(fits, key=lambda f: f[2]["val_loss"] if len(fits) > 1 else 0.0)
    with torch.no_grad():
        mean = model(data.x_train.float()).squeeze(-1)
        train_rms = float(((mean - data.y_train.float()) ** 2).mean().sqrt())
        if data.x_val is not None:
            val_mean = model(data.x_val.float()).squeeze(-1)
            info["val_rms"] = float(((val_mean - data.y_val.float()) ** 2).mean().sqrt())
    info.update(weight_decay=wd, train_rms=train_rms)
    if learn:
        sigma, rule = info["sigma"], "learned"
    elif protocol.sigma == "train":
        sigma, rule = max(train_rms, 1e-3), "train"
    else:  # val and evidence: the MAP's σ is the validation MLE
        sigma, rule = max(info["val_rms"], 1e-3), "val"
    info["sigma_rule"] = rule
    return UCIContext(data, protocol, model, sigma, seed, info)


def gaussian_metrics(
    mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor, y_std: float
) -> dict[str, float]:
    """RMSE and mean Gaussian NLL in original units, from standardised ``mean``, ``var``, ``y`` (N,)."""
    var = var.clamp_min(1e-12)
    rmse = float(((mean - y) ** 2).mean().sqrt()) * y_std
    nll = float(_nll(mean, var, y)) + math.log(y_std)
    check_finite(torch.tensor([rmse, nll]), f"non-finite UCI metrics (RMSE {rmse}, NLL {nll})")
    return {"rmse": rmse, "nll": nll}


# ------------------------------------------------------------------------------------------ cells
@dataclass
class _Pred:
    """A cell's Gaussian predictive (standardised) on the test and validation part, its σ and choices."""

    test: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor] | None
    sigma: float
    rule: str
    floats: int = 0
    n_stochastic: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _best_sigma(ctx: UCIContext, mean: torch.Tensor, fvar: torch.Tensor) -> float:
    """The σ of :data:`SIGMA_FACTORS` × the MAP's σ with the lowest validation NLL of ``N(mean, fvar + σ²)``."""
    y = ctx.data.y_val.double()
    return min(
        (ctx.sigma * f for f in SIGMA_FACTORS),
        key=lambda s: float(_nll(mean.double(), fvar.double() + s**2, y)),
    )


def _map(ctx: UCIContext, size: str) -> _Pred:
    def pred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            mean = ctx.model(x.float()).squeeze(-1).double()
        return mean, torch.full_like(mean, ctx.sigma**2)

    val = pred(ctx.data.x_val) if ctx.has_val else None
    return _Pred(pred(ctx.data.x_test), val, ctx.sigma, ctx.info["sigma_rule"])


def _evidence(ctx: UCIContext, la: Any, n_stoch: int) -> tuple[float, str] | None:
    """Evidence fit of (σ, prior) with its guard: ``(prior, "evidence")``, or ``None`` (warned) to fall back."""
    n = len(ctx.data.y_train)
    why = f"{n_stoch} stochastic weights > {n} data points" if n_stoch > n else None
    if why is None:
        fit = la.maximize_evidence(per_module=False)
        sigma, prior = float(fit.sigma_noise), float(fit.prior_precision.reshape(-1)[0])
        if sigma <= 1.0 and fit.converged:
            return prior, "evidence"
        why = f"the evidence drives σ to {sigma:.3g}, beyond the targets' spread (1)"
        why = why if fit.converged else "the evidence fit did not converge"
        la.sigma_noise = ctx.sigma
    warnings.warn(
        f"evidence σ refused ({why}); choosing σ and the prior as without it", stacklevel=2
    )
    return None


def _laplace(ctx: UCIContext, subset: Subset, kind: type) -> _Pred:
    """A Laplace posterior on ``subset``: σ and prior by the protocol, the linearised predictive."""
    p, val = ctx.protocol, ctx.batches("val") if ctx.has_val else None
    la = kind(ctx.model, subset, likelihood="regression", sigma_noise=ctx.sigma)
    la.fit(ctx.batches("train"))
    grid, n_stoch = prior_grid(p.prior_grid), subset.num_entries()
    chosen = _evidence(ctx, la, n_stoch) if p.sigma == "evidence" else None
    if chosen is not None:
        (prior, rule), how = chosen, "evidence"
    elif p.prior == "marglik":
        prior, rule = la.optimize_prior_precision("marglik", grid=grid), ctx.info["sigma_rule"]
        how = "marglik"
    else:  # validation NLL, jointly with σ when σ is chosen on validation data
        sigmas = [ctx.sigma * f for f in SIGMA_FACTORS] if p.sigma != "learned" else [ctx.sigma]
        scores = []
        for s in sigmas:
            la.sigma_noise = s
            scores.append(la.grid_val_nll(val, grid))
        i, j = divmod(int(torch.stack(scores).argmin()), len(grid))
        la.sigma_noise, prior = sigmas[i], float(grid[j])
        rule, how = "val" if p.sigma != "learned" else "learned", "val_nll"
    la.prior_precision = prior
    extra = {"prior_rule": how, "prior_precision": prior}
    extra["prior_at_grid_edge"] = prior_edge(prior, p.prior_grid)

    def pred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, cov = la.logit_mean_cov(x.float())
        return f.squeeze(-1).double(), cov[:, 0, 0].double().clamp_min(0) + la.sigma_noise**2

    val_pred, floats = pred(ctx.data.x_val) if ctx.has_val else None, int(la.num_floats)
    return _Pred(pred(ctx.data.x_test), val_pred, la.sigma_noise, rule, floats, n_stoch, extra)


def _swag(ctx: UCIContext, subset: Subset) -> _Pred:
    """SWAG on ``subset``: per learning rate (and σ, when chosen on validation data) the best validation NLL."""
    p, data = ctx.protocol, ctx.data
    x_tr, y_tr = data.x_train.float(), data.y_train.float()
    batches = [{"x": x_tr[i : i + 32], "y": y_tr[i : i + 32]} for i in range(0, len(x_tr), 32)]

    def loss_fn(m: nn.Module, b: Mapping[str, Any]) -> torch.Tensor:
        return ((m(b["x"]).squeeze(-1) - b["y"]) ** 2).mean()

    choose = p.sigma in ("val", "evidence")
    best: tuple[float, _Pred] | None = None
    options = {"n_steps": p.swag_steps, "loss_fn": loss_fn, "progress": False}
    errors = []
    for lr in p.swag_lrs:
        try:
            swag = collect_swag(ctx.model, subset, batches, lr=lr, **options)
        except ValueError as err:  # a learning rate that diverges is not a candidate
            errors.append(f"lr {lr:g}: {err}")
            if len(p.swag_lrs) > 1:
                warnings.warn(f"SWAG lr {lr:g} left out: {err}", stacklevel=2)
            continue
        gen, outs = torch.Generator().manual_seed(ctx.seed), []
        x_all = torch.cat([data.x_test, *([data.x_val] if ctx.has_val else [])]).float()
        for _ in range(p.n_samples):
            with swag.sampled(generator=gen), torch.no_grad():
                outs.append(ctx.model(x_all).squeeze(-1).double())
        stack, n_te = torch.stack(outs), len(data.x_test)
        mean, fvar = stack.mean(0), stack.var(0)
        sigma = _best_sigma(ctx, mean[n_te:], fvar[n_te:]) if choose else ctx.sigma
        var = fvar + sigma**2
        val = (mean[n_te:], var[n_te:]) if ctx.has_val else None
        score = float(_nll(*val, data.y_val.double())) if val is not None else 0.0
        rule = "val" if choose else ctx.info["sigma_rule"]
        extra = {"swag_lr": lr, "swag_lr_rule": "val_nll" if len(p.swag_lrs) > 1 else "fixed"}
        floats, n = int(swag.num_floats), subset.num_entries()
        pred = _Pred((mean[:n_te], var[:n_te]), val, sigma, rule, floats, n, extra)
        if best is None or score < best[0]:
            best = (score, pred)
    if best is None:
        raise ValueError(f"SWAG diverged at every learning rate ({'; '.join(errors)})")
    return best[1]


def subnet_subset(
    model: nn.Module, method: str, percent: float, x: torch.Tensor, y: torch.Tensor, sigma: float
) -> Subset:
    """The elementwise subnetwork of the norm- vs variance-based comparison (Figs. 9, 10).

    ``subnet-norm``: the ``percent`` % largest-magnitude weights and biases; ``subnet-variance``: the largest
    marginal variances under a diagonal GGN Laplace, ``1 / (h_i / σ² + δ)``, whose order does not depend on δ.
    """
    if check_choice("method", method, ("subnet-norm", "subnet-variance")) == "subnet-norm":
        return selection.largest_magnitude(model, percent)
    full = every_linear_map(model)
    h = diag_curvature(model, [(x, y[:, None])], full, likelihood="regression", sigma_noise=sigma)
    params = dict(model.named_parameters())
    zeros = {n: torch.zeros_like(params[n]) for n in full.names}
    variances = {
        n: 1.0 / (full.scatter(n, h[n].to(zeros[n].dtype), zeros[n]) + 1.0) for n in full.names
    }
    return selection.largest_marginal_variance(model, variances, percent)


# ------------------------------------------------------------------------------------------ registry
def _modules(ctx: UCIContext) -> list[str]:
    """1 .. the MLP's number of linear maps (hidden layers + output); ``ctx`` needs only ``protocol``."""
    return [str(k) for k in range(1, ctx.protocol.depth + 2)]


def _percents(_: UCIContext) -> list[str]:
    return [f"{p:g}" for p in SUBNET_PERCENTS]


def _variance(c: UCIContext, size: str) -> Subset:
    x, y = c.data.x_train.float(), c.data.y_train.float()
    return subnet_subset(c.model, "subnet-variance", float(size), x, y, c.sigma)


# The subsets of the methods by key: ``(ctx, size) -> Subset``.
_SUBSETS: dict[str, Callable[[UCIContext, str], Subset]] = {
    "last": lambda c, s: selection.last_layer(c.model),
    "all": lambda c, s: every_linear_map(c.model),
    "random": lambda c, s: selection.random_modules(c.model, int(s), seed=c.seed, group="all"),
    "max": lambda c, s: selection.max_operator_norm(c.model, int(s), group="all"),
    "min": lambda c, s: selection.min_operator_norm(c.model, int(s), group="all"),
    "largest": lambda c, s: selection.largest_magnitude(c.model, float(s)),
    "variance": _variance,
}


_SIZES = {**dict.fromkeys(("random", "max", "min"), _modules), "largest": _percents}
_SIZES["variance"] = _percents


def _one(_: UCIContext) -> list[str]:
    return ["-"]


def _method(name: str, about: str, posterior: type | None, subset: str) -> Method:
    """A UCI method: ``posterior`` (a Laplace class; ``None``: SWAG) on the ``_SUBSETS[subset]`` subset."""
    pick, sizes = _SUBSETS[subset], _SIZES.get(subset, _one)
    if posterior is None:
        return Method(name, about, sizes, lambda c, s: _swag(c, pick(c, s)))
    return Method(name, about, sizes, lambda c, s: _laplace(c, pick(c, s), posterior))


UCI_METHODS: dict[str, Method] = {
    "map": Method("map", "the trained network (MAP) with its noise σ", _one, _map),
    **{
        row[0]: _method(*row)
        for row in (
            ("last-layer", "Laplace, dense GGN on the output layer", DenseLaplace, "last"),
            ("kfac-full", "KFAC Laplace on every linear map", KronLaplace, "all"),
            ("kfac-random", "KFAC Laplace on k random linear maps", KronLaplace, "random"),
            ("kfac-max", "KFAC Laplace on the k largest-norm maps", KronLaplace, "max"),
            ("kfac-min", "KFAC Laplace on the k smallest-norm maps", KronLaplace, "min"),
            ("diag-full", "diagonal GGN Laplace on every linear map", DiagLaplace, "all"),
            ("subnet-norm", "dense Laplace on the p % largest weights", DenseLaplace, "largest"),
            (
                "subnet-variance",
                "dense Laplace on the p % largest-variance weights",
                DenseLaplace,
                "variance",
            ),
            ("swag-full", "SWAG on every linear map", None, "all"),
            ("swag-l1", "SWAG on the p % largest-magnitude weights (Fig. 9)", None, "largest"),
        )
    },
}


def run_uci_cell(ctx: UCIContext, method: str, size: str) -> dict[str, Any]:
    """One UCI cell: the method's posterior, its choices (σ, prior, SWAG lr) and its test metrics."""
    check_known("UCI method", method, UCI_METHODS)
    t0 = time.perf_counter()
    pred = UCI_METHODS[method].run(ctx, size)
    data, total = ctx.data, sum(p.numel() for p in ctx.model.parameters())
    extra = {"sigma_noise": pred.sigma, "sigma": pred.sigma * data.y_std, "sigma_rule": pred.rule}
    keep = ("weight_decay", "epochs", "train_rms", "val_rms")
    extra.update({k: ctx.info[k] for k in keep if k in ctx.info}, **pred.extra)
    rec = {**gaussian_metrics(*pred.test, data.y_test.double(), data.y_std)}
    if pred.val is not None:
        val = gaussian_metrics(*pred.val, data.y_val.double(), data.y_std)
        rec.update(val_nll=val["nll"], val_rmse=val["rmse"])
    return {
        **rec,
        "n_test": len(data.y_test),
        "floats": pred.floats,
        "n_stochastic": pred.n_stochastic,
        "percent_stochastic": 100.0 * pred.n_stochastic / total,
        "fit_seconds": time.perf_counter() - t0,
        "predict_seconds": 0.0,
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
    keep_going: bool = False,
    protocol: UCIProtocol | str = "paper",
) -> ResultStore:
    """Fill the UCI grid (dataset, split, method, size) of this shard; finished cells are skipped.

    One (dataset, split) unit at a time, in this process: train its MAP, run its cells. ``shard=(i, n)``
    keeps every n-th unit. With ``keep_going`` a failing cell is logged and skipped (in ``store.failures``;
    a later run retries it); loading data and training the MLP always raise. ``protocol`` is a
    :class:`UCIProtocol` or the name of a preset in :data:`PROTOCOLS`.

    Raises:
        ValueError: An unknown dataset, protocol or a method that has no UCI version (the message lists the
            valid ones), before any work.
    """
    if isinstance(protocol, str):
        check_known("UCI protocol", protocol, PROTOCOLS, "valid")
        protocol = PROTOCOLS[protocol]
    check_known("UCI dataset(s)", datasets, UCI_DATASETS, "valid datasets")
    check_known("UCI method(s)", methods, UCI_METHODS, "valid UCI methods")
    if str(device) != "cpu":
        logger.warning("UCI models are tiny: running them on cpu")
    store = ResultStore(results, protocol.store_config(seed))
    sizes = {m: UCI_METHODS[m].sizes(SimpleNamespace(protocol=protocol)) for m in methods}  # type: ignore[arg-type]
    for name, split in grid_units(datasets, splits, shard):
        cells = [Cell(name, split, m, s) for m in sorted(set(methods)) for s in sizes[m]]
        todo = [cell for cell in cells if not store.has(cell)]
        if not todo:
            continue
        data = load_uci(name, split, uci_dir, protocol.val_fraction, seed * 100 + split)
        ctx = fit_map(data, protocol, seed * 100 + split)
        for cell in todo:
            where = f"[{name} split {split}] {cell.method} {cell.size}"
            try:
                rec = run_uci_cell(ctx, cell.method, cell.size)
            except Exception as err:  # one broken cell must not stop the grid
                store.failures.append(
                    f"{name}/split{split}/{cell.method}/{cell.size}: {type(err).__name__}: {err}"
                )
                logger.warning(f"{where}: FAILED ({store.failures[-1]})")
                if not keep_going:
                    raise
                continue
            store.write(cell, rec)
            sigma = f"σ {rec['extra']['sigma']:.3g} by {rec['extra']['sigma_rule']}"
            logger.info(f"{where}: rmse {rec['rmse']:.3f} nll {rec['nll']:.3f} ({sigma})")
    return store
