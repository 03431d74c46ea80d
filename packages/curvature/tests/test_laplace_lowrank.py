"""KronLaplace with low-rank factors (``max_rank``) against dense float64 references.

Each factor side larger than ``max_rank`` is kept as ``U diag(s) Uᵀ + f₀ (I − U Uᵀ)``; the posterior is then
exactly the Kronecker posterior of those factors, ``P = (Ĝ ⊗ Â) / T + δ I``, which the tests build densely.
On these small maps the sketch sees every direction (its test matrix is square), so the fitted factor is the
best rank-``r`` approximation of the exact KFAC factor plus the mean remainder, and ``r = n`` is the exact path.
"""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data, kron_subset, reference_block_jacobian

from partialbayes.curvature import KronLaplace, kfac
from partialbayes.curvature._kfac import LowRankFactor, truncated, whole_factor
from partialbayes.selection import modules

FIXTURE_OK = settings(
    max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None
)
F64 = torch.float64


def dense(f: LowRankFactor) -> torch.Tensor:
    eye = torch.eye(f.U.shape[0], dtype=f.U.dtype, device=f.U.device)
    return (f.U * f.s) @ f.U.T + f.rest * (eye - f.U @ f.U.T)


def dense_precision(la: KronLaplace, prior: float, temperature: float = 1.0) -> torch.Tensor:
    blocks = []
    for m in la.modules:
        g, a = la._eig[m]
        k = torch.kron(dense(g), dense(a)).cpu() / temperature
        blocks.append(k + prior * torch.eye(k.shape[0], dtype=F64))
    return torch.block_diag(*blocks)


def _fit(device, max_rank, bias="fold", prior=0.7, temperature=1.0, seed=0):
    model = TinyNet(seed).to(device).eval()
    subset = kron_subset(model)
    x, y = classification_data(7, seed)
    la = KronLaplace(
        model,
        subset,
        prior_precision=prior,
        temperature=temperature,
        bias=bias,
        max_rank=max_rank,
    )
    return model, subset, la.fit([(x.to(device), y.to(device))]), (x, y)


@FIXTURE_OK
@given(
    max_rank=st.integers(1, 4),
    bias=st.sampled_from(["fold", "separate"]),
    prior=st.floats(0.1, 5.0),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 100),
)
def test_lowrank_posterior_equals_the_dense_reference(
    device, max_rank, bias, prior, temperature, seed
):
    """Log det, evidence, ``J Σ Jᵀ`` and the sampler of the low-rank posterior are those of its dense ``P``."""
    model, subset, la, (x, y) = _fit(device, max_rank, bias, prior, temperature, seed)
    exact = kfac(model, [(x.to(device), y.to(device))], subset, bias=bias)
    for (
        m
    ) in la.modules:  # the fitted factors: the best rank-r part of KFAC's and the mean remainder
        sides = {"G": exact[m].G, "A": exact[m].A}
        for (key, matrix), f in zip(sides.items(), la._eig[m], strict=True):
            want = truncated(whole_factor(matrix.double()), max_rank)
            got = _weights_part(f) if m in la._separate and key == "A" else f
            torch.testing.assert_close(dense(got), dense(want), rtol=1e-8, atol=1e-10)
    P = dense_precision(la, prior, temperature)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(P))
    xt, _ = classification_data(4, seed + 1)
    f, cov = la.logit_mean_cov(xt.to(device))
    J = reference_block_jacobian(model.cpu(), xt, subset)
    torch.testing.assert_close(cov.cpu(), J @ torch.linalg.inv(P) @ J.mT)
    theta = torch.cat([la.params_to_block(m, la._map).reshape(-1) for m in la.modules]).cpu()
    d = theta.numel()
    hand = -la.map_loss / temperature - 0.5 * (
        torch.logdet(P) - d * torch.log(torch.tensor(prior, dtype=F64))
    )
    hand = hand - 0.5 * prior * theta @ theta
    torch.testing.assert_close(la.log_marginal_likelihood().cpu(), hand)


def _weights_part(a: LowRankFactor) -> LowRankFactor:
    """The weight-input factor of ``blockdiag(A, A_bias)`` (a separate bias: the last row / column)."""
    return LowRankFactor(a.U[:-1, :-1], a.s[:-1], a.rest)


def test_lowrank_sampler_has_the_posterior_covariance(device):
    """Samples are ``S ε`` with ``S Sᵀ = P⁻¹`` exactly (the noise replaced by unit vectors)."""
    model = TinyNet(1).to(device).eval()
    subset = modules(model, ["l0"])
    x, y = classification_data(6, 1)
    la = KronLaplace(model, subset, prior_precision=0.4, max_rank=2)
    la.fit([(x.to(device), y.to(device))])
    r, _, c = la._dims["l0"]
    units = torch.eye(r * c, dtype=F64, device=device).reshape(r * c, r, c)
    la._noise = lambda shape, generator: units  # type: ignore[method-assign]
    s = la.sample(r * c)
    block = la.params_to_block("l0", s) - la.params_to_block("l0", la._map)
    S = block.reshape(r * c, r * c).T.cpu()
    torch.testing.assert_close(S @ S.T, torch.linalg.inv(dense_precision(la, 0.4)))


def test_rank_at_least_every_factor_warns_and_is_the_exact_path(device):
    model, subset, exact, (x, y) = _fit(device, None)
    with pytest.warns(UserWarning, match=r"max_rank=50 is not below the size of any factor"):
        la = KronLaplace(model, subset, prior_precision=0.7, max_rank=50)
    la.fit([(x.to(device), y.to(device))])
    assert torch.equal(la.log_det(), exact.log_det())
    xt, _ = classification_data(3, 5)
    assert torch.equal(la.logit_mean_cov(xt.to(device))[1], exact.logit_mean_cov(xt.to(device))[1])
    assert la.summary().splitlines()[2:] == exact.summary().splitlines()[2:]


@pytest.mark.parametrize("bias", ["fold", "separate"])
def test_lowrank_save_load_round_trip(tmp_path, bias):
    model, _, la, _ = _fit("cpu", 2, bias)
    assert "rank 2" in la.summary()
    path = tmp_path / "lowrank.safetensors"
    la.save(path)
    back = KronLaplace.load(path, model)
    assert back.max_rank == 2
    assert back.num_floats == la.num_floats
    xt, _ = classification_data(3, 2)
    assert torch.equal(back.logit_mean_cov(xt)[1], la.logit_mean_cov(xt)[1])
    torch.testing.assert_close(back.log_marginal_likelihood(), la.log_marginal_likelihood())
    g = torch.Generator().manual_seed(3)
    assert torch.equal(
        back.sample(2, generator=g)["l0.weight"],
        la.sample(2, generator=g.manual_seed(3))["l0.weight"],
    )
    fit = back.maximize_evidence()  # the evidence's gradient
    assert fit.converged
    assert float(fit.log_marginal_likelihood) >= float(la.log_marginal_likelihood())


def test_truncated_rtol_predictive_keeps_lowrank_modules_exact():
    """``predictive_rtol > 0`` truncates the whole modules' bases; the low-rank ones stay exact."""
    model, subset, exact, (x, y) = _fit("cpu", 1)
    la = KronLaplace(model, subset, prior_precision=0.7, max_rank=1, predictive_rtol=0.5).fit(
        [(x, y)]
    )
    xt, _ = classification_data(3, 4)
    torch.testing.assert_close(la.logit_mean_cov(xt)[1], exact.logit_mean_cov(xt)[1])


def test_max_rank_must_be_a_positive_int():
    model = TinyNet(0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(
            TypeError if isinstance(bad, bool) or not isinstance(bad, int) else ValueError,
            match="max_rank must be",
        ):
            KronLaplace(model, kron_subset(model), max_rank=bad)
