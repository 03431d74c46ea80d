"""Prior precision by the Laplace evidence: grid vs gradient ascent, and laplace-torch's ``marglik``.

All three work on the same fitted posterior (an MLP without biases, every weight, KFAC), so only the search
differs: our grid (``optimize_prior_precision``, 21 scalar values), our gradient ascent (``maximize_evidence``:
Adam on one log prior per module until the scaled gradient is below ``tol``) and laplace-torch's
``optimize_prior_precision(method="marglik", prior_structure="layerwise")`` (100 Adam steps, its default, no stopping rule). Both libraries' evidences
agree to rounding on this posterior, so the evidence each search reaches is comparable.
"""

from __future__ import annotations

import warnings

import torch
from benchharness import Bench
from torch import nn

from partialbayes.curvature import KronLaplace
from partialbayes.selection import KronBlock, Subset, linear_modules


def _setup(b: Bench):
    d_in, width, classes, n_train, batch = (
        (16, 32, 4, 64, 16) if b.quick else (128, 512, 10, 512, 64)
    )
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Linear(d_in, width, bias=False),
            nn.Tanh(),
            nn.Linear(width, width, bias=False),
            nn.Tanh(),
            nn.Linear(width, classes, bias=False),
        )
        .to(b.device)
        .eval()
    )
    with torch.no_grad():  # layers of different scale, so one prior per layer pays
        model[0].weight.mul_(3.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train, d_in, generator=g).to(b.device)
    y = torch.randint(0, classes, (n_train,), generator=g).to(b.device)
    return model, [(x[i : i + batch], y[i : i + batch]) for i in range(0, n_train, batch)]


def bench_marglik(b: Bench) -> None:
    model, loader = _setup(b)
    size = "tiny MLP" if b.quick else "MLP 128-512-512-10"
    group = f"Prior precision by marginal likelihood, {size}, all weights"
    subset = Subset.from_model(model, {f"{n}.weight": KronBlock() for n in linear_modules(model)})
    la = KronLaplace(model, subset).fit(loader)
    b.time("grid (21 scalar values)", lambda: la.optimize_prior_precision("marglik"), group=group)
    grid_value = float(la.log_marginal_likelihood())

    def gradient():
        la.prior_precision = 1.0
        return la.maximize_evidence()

    b.time(
        "gradient, per module (tol 1e-4)",
        gradient,
        group=group,
        reference="grid (21 scalar values)",
    )
    fit = gradient()
    b.metric("gradient: Adam steps to tol", fit.steps, unit="steps", group=group)
    b.metric(
        "evidence gain, gradient per module - grid",
        fit.log_marginal_likelihood - grid_value,
        unit="nats",
        group=group,
        note=f"grid {grid_value:.4f}, gradient {fit.log_marginal_likelihood:.4f}",
    )
    peer_name = "laplace-torch marglik (100 Adam steps, layerwise)"
    if not b.has("laplace"):
        b.skip(peer_name, group=group, reason="laplace-torch not installed")
        return
    from laplace import KronLaplace as PeerKron

    x_all = torch.cat([x for x, _ in loader])
    y_all = torch.cat([y for _, y in loader])
    peer_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_all, y_all), batch_size=len(loader[0][1])
    )
    peer = PeerKron(model, "classification")
    peer.fit(peer_loader, progress_bar=False)

    def peer_fn():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its reminder about link_approx
            peer.optimize_prior_precision(
                pred_type="glm", method="marglik", prior_structure="layerwise", init_prior_prec=1.0
            )

    b.time(peer_name, peer_fn, group=group, reference="gradient, per module (tol 1e-4)")
    peer_fn()
    prior = peer.prior_precision.detach().to(la.prior_precision)
    b.metric(
        "evidence, laplace-torch result - ours",
        float(peer.log_marginal_likelihood()) - fit.log_marginal_likelihood,
        unit="nats",
        group=group,
    )
    b.metric(
        "|evidence ours - laplace-torch| at laplace-torch's prior",
        abs(float(la.log_marginal_likelihood(prior)) - float(peer.log_marginal_likelihood())),
        unit="nats",
        group=group,
        note="same posterior: agreement check",
    )
    b.metric(
        "max |δ laplace-torch / δ ours - 1|",
        float((prior / fit.prior_precision.to(prior) - 1).abs().max()),
        unit="",
        group=group,
    )
