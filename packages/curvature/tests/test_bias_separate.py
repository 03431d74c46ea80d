"""The bias kept separate: its own Kronecker block ``G ⊗ A_bias`` next to the weight's ``G ⊗ A``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _factor_refs import SeqNet, block_jacobian, dense_ef, dense_ggn, kw, seq_batch
from _laplace_helpers import TinyNet, classification_data, kron_subset, reference_block_jacobian

from partialbayes.curvature import KronLaplace, kfac
from partialbayes.selection import modules

FIXTURE = settings(
    max_examples=10,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _dense(model, x, y, name, likelihood, fisher, sigma, kwargs=False):
    logits, J = block_jacobian(model, x, [name], kwargs=kwargs)
    if fisher == "exact":
        return dense_ggn(J, logits, likelihood, sigma)
    return dense_ef(J, logits, y, likelihood, sigma)


@FIXTURE
@given(
    d_in=st.integers(1, 4),
    h=st.integers(1, 4),
    c=st.integers(2, 3),
    seed=st.integers(0, 2**16),
    module=st.sampled_from(["0", "2"]),
    likelihood=st.sampled_from(["classification", "regression"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_one_datum_weight_and_bias_blocks_exact(
    d_in, h, c, seed, module, likelihood, fisher, device
):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, h), nn.Tanh(), nn.Linear(h, c)).double().eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, d_in, generator=g, dtype=torch.float64)
    y = (
        torch.randint(0, c, (1,), generator=g)
        if likelihood == "classification"
        else torch.randn(1, c, generator=g, dtype=torch.float64)
    )
    ref_w = _dense(model, x, y, f"{module}.weight", likelihood, fisher, 0.7)
    ref_b = _dense(model, x, y, f"{module}.bias", likelihood, fisher, 0.7)
    model.to(device)
    data = [(x.to(device), y.to(device))]
    kwargs = {"likelihood": likelihood, "fisher": fisher, "sigma_noise": 0.7}
    f = kfac(model, data, modules(model, [module]), bias="separate", **kwargs)[module]
    n_in = model[int(module)].in_features
    assert f.bias is True
    assert f.A.shape == (n_in, n_in)
    torch.testing.assert_close(f.A_bias.cpu(), torch.ones(1, 1, dtype=torch.float64))
    torch.testing.assert_close(torch.kron(f.G, f.A).cpu(), ref_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.kron(f.G, f.A_bias).cpu(), ref_b, rtol=1e-9, atol=1e-12)
    # the folded factor carries the same weight part; separate = folded with the cross terms dropped
    fold = kfac(model, data, modules(model, [module]), **kwargs)[module]
    assert fold.A_bias is None
    torch.testing.assert_close(fold.A[:n_in, :n_in], f.A)
    torch.testing.assert_close(fold.A[n_in, n_in], f.A_bias[0, 0])
    sep = f.input_factor()
    torch.testing.assert_close(sep[:n_in, :n_in], f.A)
    assert bool((sep[:n_in, n_in] == 0).all() and (sep[n_in, :n_in] == 0).all())


@FIXTURE
@given(
    t=st.integers(1, 4),
    pad=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    module=st.sampled_from(["lin1", "lin2", "head"]),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_reduce_bias_block_exact_for_one_sequence(t, pad, seed, module, fisher, device):
    """The bias gradient is ``Σ_t δ_t`` (its input is 1): reduce's ``G ⊗ [1]`` is exact for one sequence,
    whatever the network (here with tanh)."""
    torch.manual_seed(seed)
    model = SeqNet(3, 3, 2).double().eval()
    batch = seq_batch(1, t, 3, 2, seed, pad=pad)
    ref = _dense(
        model, kw(batch), batch["labels"], f"{module}.bias", "classification", fisher, 1.0, True
    )
    f = kfac(
        model.to(device),
        [{k: v.to(device) for k, v in batch.items()}],
        modules(model, [module]),
        fisher=fisher,
        sharing="reduce",
        bias="separate",
    )[module]
    torch.testing.assert_close((f.G * f.A_bias).cpu(), ref, rtol=1e-9, atol=1e-12)


@FIXTURE
@given(
    b=st.integers(1, 3),
    pad=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    sharing=st.sampled_from(["reduce", "expand"]),
)
def test_separate_is_fold_without_cross_terms_on_sequences(b, pad, seed, sharing, device):
    torch.manual_seed(seed)
    model = SeqNet(3, 4, 2).double().eval().to(device)
    batch = {k: v.to(device) for k, v in seq_batch(b, 3, 3, 2, seed, pad=pad).items()}
    s = modules(model, ["lin1", "lin2", "head"])
    fold = kfac(model, [batch], s, sharing=sharing)
    sep = kfac(model, [batch], s, sharing=sharing, bias="separate")
    for m in s.kron_modules():
        c = sep[m].A.shape[0]
        torch.testing.assert_close(sep[m].G, fold[m].G)
        torch.testing.assert_close(sep[m].A, fold[m].A[:c, :c])
        torch.testing.assert_close(sep[m].A_bias[0, 0], fold[m].A[c, c])
        torch.testing.assert_close(sep[m].A_bias[0, 0].item(), 1.0)


# ----------------------------------------------------------------------------- posterior algebra
def _separate_posterior(seed=0, prior=0.7, temperature=1.0, device="cpu"):
    model = TinyNet(seed).eval().to(device)
    subset = kron_subset(model)
    x, y = classification_data(8, seed)
    factors = kfac(model, [(x.to(device), y.to(device))], subset, bias="separate")
    la = KronLaplace(model, subset, prior_precision=prior, temperature=temperature, bias="separate")
    la.fit_curvature(factors, map_loss=4.0, n_data=8, n_outputs=3)
    return model, subset, la, factors


def _dense_precision(la, factors, prior, temperature):
    blocks = []
    for i, m in enumerate(la.modules):
        k = torch.kron(factors[m].G, factors[m].input_factor()).cpu() / temperature
        blocks.append(k + prior[i] * torch.eye(k.shape[0], dtype=k.dtype))
    return torch.block_diag(*blocks)


def _block_map(la):
    return torch.cat([la.params_to_block(m, la._map).reshape(-1) for m in la.modules]).cpu()


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 1000),
    prior=st.floats(0.05, 10.0),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_log_det_functional_cov_and_marglik_equal_dense(seed, prior, temperature, device):
    model, subset, la, factors = _separate_posterior(seed, prior, temperature, device)
    assert la.bias == "separate"
    assert factors["c1"].A_bias is not None
    assert factors["l0"].A_bias is None  # l0 has no bias in the subset
    P = _dense_precision(la, factors, [prior] * 3, temperature)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(P))
    x, _ = classification_data(4, seed + 1)
    f, cov = la.logit_mean_cov(x.to(device))
    model.cpu()
    J = reference_block_jacobian(model, x, subset)
    torch.testing.assert_close(f.cpu(), model(x).detach())
    torch.testing.assert_close(cov.cpu(), J @ torch.linalg.inv(P) @ J.mT)
    theta = _block_map(la)
    hand = (
        -4.0 / temperature
        - 0.5 * (torch.logdet(P) - theta.numel() * math.log(prior))
        - 0.5 * prior * theta @ theta
    )
    torch.testing.assert_close(la.log_marginal_likelihood().cpu(), hand)


def test_samples_covariance_matches_dense(device):
    _, _, la, factors = _separate_posterior(3, prior=1.5, temperature=2.0, device=device)
    sigma = torch.linalg.inv(_dense_precision(la, factors, [1.5] * 3, 2.0))
    n = 20_000
    s = la.sample(n, generator=torch.Generator(device=device).manual_seed(0))
    blocks = torch.cat([la.params_to_block(m, s).reshape(n, -1).cpu() for m in la.modules], dim=1)
    centered = blocks - _block_map(la)
    d = torch.diagonal(sigma)
    assert (centered.mean(0).abs() <= 6 * torch.sqrt(d / n)).all()
    emp = centered.T @ centered / n
    assert ((emp - sigma).abs() <= 6 * torch.sqrt((torch.outer(d, d) + sigma**2) / n)).all()


def test_fit_passes_the_option_and_refuses_factors_of_the_other_mode():
    model = TinyNet(0).eval()
    subset = kron_subset(model)
    x, y = classification_data(8, 0)
    la = KronLaplace(model, subset, bias="separate").fit([(x, y)])
    ref = _separate_posterior(0, prior=1.0)[2]
    torch.testing.assert_close(la.log_det(), ref.log_det())
    fold = kfac(model, [(x, y)], subset)
    with pytest.raises(ValueError, match=r"module 'c1' fold the bias.*bias='separate'"):
        KronLaplace(model, subset, bias="separate").fit_curvature(
            fold, map_loss=1.0, n_data=8, n_outputs=3
        )
    sep = kfac(model, [(x, y)], subset, bias="separate")
    with pytest.raises(ValueError, match=r"module 'c1' keep the bias separate"):
        KronLaplace(model, subset).fit_curvature(sep, map_loss=1.0, n_data=8, n_outputs=3)
    with pytest.raises(ValueError, match=r"bias must be one of \['fold', 'separate'\]"):
        KronLaplace(model, subset, bias="both")
    with pytest.raises(ValueError, match=r"bias must be one of \['fold', 'separate'\]"):
        kfac(model, [(x, y)], subset, bias="none")
    assert "bias G ⊗ [1]" in la.summary()
    # floats: eig_g, Q_G, eig_a (weight inputs + the bias factor), Q_A over the weight inputs only
    expected = 0
    for m in la.modules:
        r, cw, c = la._dims[m]
        expected += r + r * r + c + (cw * cw if c > cw else c * c)
    assert la.num_floats == expected


def test_save_load_round_trip_and_mismatch(tmp_path):
    _, _, la, _ = _separate_posterior(2, prior=0.9)
    path = tmp_path / "sep.safetensors"
    la.save(path)
    back = KronLaplace.load(path, TinyNet(2))
    assert back.bias == "separate"
    torch.testing.assert_close(back.log_marginal_likelihood(), la.log_marginal_likelihood())
    x, _ = classification_data(3, 5)
    torch.testing.assert_close(back.logit_mean_cov(x)[1], la.logit_mean_cov(x)[1])
    s1 = la.sample(2, generator=torch.Generator().manual_seed(4))
    s2 = back.sample(2, generator=torch.Generator().manual_seed(4))
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k])
    assert back.num_floats == la.num_floats
    # a file whose option does not match its stored factors is refused, naming the module's tensor
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["partialbayes"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta["options"]["bias"] = "fold"
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata={"partialbayes": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"bad\.safetensors.*'curv:c1:q_a' has shape"):
        KronLaplace.load(bad, TinyNet(2))
    # files written before the option existed load as folded
    net = TinyNet(2).eval()
    fold = KronLaplace(net, kron_subset(net))
    fold.fit_curvature(
        kfac(fold.model, [classification_data(8, 2)], fold.subset),
        map_loss=4.0,
        n_data=8,
        n_outputs=3,
    )
    old = tmp_path / "old.safetensors"
    fold.save(old)
    with safe_open(str(old), framework="pt") as f:
        meta = json.loads(f.metadata()["partialbayes"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del meta["options"]["bias"]
    save_file(tensors, str(old), metadata={"partialbayes": json.dumps(meta)})
    assert KronLaplace.load(old, TinyNet(2)).bias == "fold"
