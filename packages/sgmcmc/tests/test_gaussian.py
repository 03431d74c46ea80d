"""Long-run moments of every sampler on Bayesian linear regression against the closed-form posterior.

Many chains run at once: the model holds one weight row per chain and the loss is the sum of the chains'
losses, so each chain sees its own gradient (and SGNHT's one thermostat is shared). The Monte Carlo error
comes from the chains themselves: each chain's estimate of a moment is one draw, so the standard error is
their standard deviation over √C (batch means with the chains as batches), and ESS = variance / SE². The
entries of the last column are outside the subset: they never move and shift the posterior mean.
"""

import pytest
import torch
from torch import nn

from partialbayes.selection import KronBlock, Subset
from partialbayes.sgmcmc import SGMCMC
from partialbayes.sgmcmc.internal import METHODS

C, N, D, SIGMA, LAM, FIXED = 64, 32, 2, 1.0, 2.0, 0.7
Z_MAX = (
    4.0  # standard errors: with 6 moments per run, |z| > 4 is a 1-in-2500 event per run under H0
)


def problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D + 1, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, FIXED], dtype=torch.float64)
    y = y + SIGMA * torch.randn(N, generator=g, dtype=torch.float64)
    xs, r = x[:, :D], y - x[:, D] * FIXED
    precision = xs.T @ xs / SIGMA**2 + LAM * torch.eye(D, dtype=torch.float64)
    mean = torch.linalg.solve(precision, xs.T @ r / SIGMA**2)
    return x, y, mean, torch.linalg.inv(precision)


class Chains(nn.Module):
    def __init__(self, start):
        super().__init__()
        self.w = nn.Parameter(
            torch.cat([start.expand(C, D), torch.full((C, 1), FIXED, dtype=torch.float64)], 1)
        )

    def forward(self, x):
        return x @ self.w.T  # [N, C]: one regression per chain


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_long_run_moments_match_the_tempered_posterior(method, temperature):
    x, y, mean, cov = problem()
    model = Chains(mean)  # chains start at the MAP, as after fine-tuning
    subset = Subset.from_model(model, {"w": KronBlock(cols=torch.arange(D))})
    lr, burn, keep = (0.02, 300, 4000 if method == "sgld" else 1500)  # SGLD mixes slowest
    sampler = SGMCMC(
        model,
        subset,
        lr=lr,
        num_data=N,
        method=method,
        temperature=temperature,
        momentum=0.0 if method == "sgld" else 0.9,
        prior_precision=LAM,
        burn_in=burn,
        generator=torch.Generator().manual_seed(int(10 * temperature)),
    )
    for _ in range(burn + keep):
        model.zero_grad()
        loss = ((y[:, None] - model(x)) ** 2).sum(1).mean() / (2 * SIGMA**2)  # mean over the data
        loss.backward()
        sampler.step()
    assert torch.all(model.w[:, D] == FIXED)  # outside the subset: untouched
    draws = sampler.posterior().samples["w"].view(keep, C, D).transpose(0, 1)  # [C, keep, D]
    assert torch.equal(draws[:, -1], model.w.detach()[:, :D])
    dev = draws - mean
    per_chain = torch.cat([draws.mean(1), (dev.transpose(1, 2) @ dev / keep).reshape(C, -1)], 1)
    truth = torch.cat([mean, (temperature * cov).reshape(-1)])
    se = per_chain.std(0) / C**0.5
    pooled = torch.cat(
        [dev.reshape(-1, D), (dev[..., :, None] * dev[..., None, :]).reshape(-1, D * D)], 1
    )
    ess = pooled.var(0) / se**2
    assert ess.min() > 1000, f"too few effective samples for the test to mean anything: {ess}"
    z = (per_chain.mean(0) - truth) / se
    assert z.abs().max() < Z_MAX, (
        f"{method} at T={temperature}: z = {z.tolist()}, ESS = {ess.tolist()}"
    )
