"""The `Posterior` protocol on every Laplace posterior; predict's links against hand computations; bad input."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import BatchEncoding

from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _laplace_helpers import TinyNet, classification_data
from _token_refs import TokenNet, bert_tagger, inputs, kept, llama_lm, lm_batch, tagged_batch

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace
from partialbayes.predictive import Posterior, mc_predictive
from partialbayes.predictive.testing import check_posterior
from partialbayes.selection import MaskBlock, Subset, last_layer, linear_modules, sparse_kfac

CLASSES = 3


def _bert_classifier():
    return tiny_model("bert", seed=0, num_labels=CLASSES).double().eval()


def _sequence_batch(seed, b=4, t=6):
    """A collator-style batch: BatchEncoding, labels under 'label', one padded sequence."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, t // 2 :] = 0
    ids = torch.randint(1, 30, (b, t), generator=g) * mask
    return BatchEncoding(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "label": torch.randint(0, CLASSES, (b,), generator=g),
        }
    )


def _regression_pairs(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, torch.randn(n, 3, generator=g, dtype=torch.float64)


def _token_regression_batch(seed, b=3, t=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return {
        "x": torch.randn(b, t, 3, generator=g, dtype=torch.float64),
        "attention_mask": mask,
        "labels": torch.randn(b, t, 2, generator=g, dtype=torch.float64),
    }


def _mask_subset(model, seed=0, fraction=0.3):
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    blocks = {}
    for m in linear_modules(model):
        for kind in ("weight", "bias"):
            name = f"{m}.{kind}"
            if name in params:
                mask = torch.rand(params[name].shape, generator=g) < fraction
                mask.view(-1)[0] = True
                blocks[name] = MaskBlock(mask)
    return Subset.from_model(model, blocks)


def _case(case):
    """``(model, train batches, test batch, likelihood, token-level)`` of one output kind."""
    if case == "sequence":
        return (
            _bert_classifier(),
            [_sequence_batch(0), _sequence_batch(1)],
            _sequence_batch(2),
            "classification",
            False,
        )
    if case == "regression":
        torch.manual_seed(0)
        model = TinyNet(0).eval()
        return (
            model,
            [_regression_pairs(0), _regression_pairs(1)],
            _regression_pairs(2),
            "regression",
            False,
        )
    if case == "tokens":
        return (
            bert_tagger(0),
            [tagged_batch(3, 5, 0), tagged_batch(2, 5, 1)],
            tagged_batch(3, 5, 2),
            "classification",
            True,
        )
    if case == "causal-lm":
        return llama_lm(0), [lm_batch(2, 5, 0)], lm_batch(2, 5, 1), "classification", True
    torch.manual_seed(0)
    model = TokenNet(3, 4, 2).double().eval()
    return (
        model,
        [_token_regression_batch(0), _token_regression_batch(1)],
        _token_regression_batch(2),
        "regression",
        True,
    )


def _posterior(family, model, likelihood, token):
    if family == "kron":
        subset = sparse_kfac(model, 60)
        return KronLaplace(
            model, subset, likelihood=likelihood, sharing="expand" if token else "reduce"
        )
    if family == "diag":
        return DiagLaplace(model, _mask_subset(model), likelihood=likelihood)
    subset = last_layer(model) if not token else sparse_kfac(model, 30)
    return DenseLaplace(model, subset, likelihood=likelihood)


CASES = ["sequence", "regression", "tokens", "causal-lm", "token-regression"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", ["kron", "diag", "dense"])
def test_every_laplace_posterior_conforms(family, case, tmp_path):
    model, train, test, likelihood, token = _case(case)
    la = _posterior(family, model, likelihood, token).fit(train)
    assert isinstance(la, Posterior)
    check_posterior(la, test, tmp_path / "post.safetensors", regression=likelihood == "regression")


# ----------------------------------------------------------------------------- predict against hand computations
def _hand_probit(f, cov):
    var = cov.diagonal(dim1=-2, dim2=-1)
    return torch.softmax(f / torch.sqrt(1 + math.pi / 8 * var), -1)


def _hand_bridge(f, cov):
    """Laplace bridge (Hobbhahn et al. 2022) after conditioning on Σ_k f_k = 0, written out."""
    ones = torch.ones(f.shape[-1], dtype=f.dtype)
    s1 = cov @ ones  # Σ1
    total = s1 @ ones  # 1ᵀΣ1 per row
    mu = f - s1 * (f @ ones)[:, None] / total[:, None]
    var = cov.diagonal(dim1=-2, dim2=-1) - s1**2 / total[:, None]
    k = f.shape[-1]
    alpha = (1 - 2 / k + torch.exp(mu) * torch.exp(-mu).sum(-1, keepdim=True) / k**2) / var
    return alpha / alpha.sum(-1, keepdim=True)


@pytest.mark.parametrize("case", ["sequence", "tokens", "causal-lm"])
@pytest.mark.parametrize("family", ["kron", "diag", "dense"])
def test_links_equal_hand_computations_from_logit_mean_cov(family, case):
    """predict ignores labels: every real position, by the links of logit_mean_cov's Gaussian (issue #25)."""
    model, train, test, likelihood, token = _case(case)
    la = _posterior(family, model, likelihood, token).fit(train)
    la.prior_precision = 0.5
    unlabelled = inputs(dict(test))
    f, cov = la.logit_mean_cov(unlabelled)  # without labels: every real output
    with torch.no_grad():
        logits = model(**unlabelled).logits
    keep = test["attention_mask"].bool() if token else None

    def at_kept(probs):
        if keep is None:
            return probs
        out = torch.softmax(logits, -1).clone()
        out[keep] = probs
        return out

    torch.testing.assert_close(la.predict(test), at_kept(_hand_probit(f, cov)))
    torch.testing.assert_close(la.predict(unlabelled), la.predict(test))
    with torch.no_grad():  # the Jacobians switch gradients on internally
        torch.testing.assert_close(la.predict(test), at_kept(_hand_probit(f, cov)))
    torch.testing.assert_close(la.predict(test, link="probit"), at_kept(_hand_probit(f, cov)))
    torch.testing.assert_close(la.predict(test, link="bridge"), at_kept(_hand_bridge(f, cov)))
    gen = torch.Generator().manual_seed(3)
    mc = la.predict(test, link="mc", n_samples=50, generator=gen)
    ref = mc_predictive(f, cov, 50, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(mc, at_kept(ref))
    draws = la.predictive_samples(test, 7, generator=torch.Generator().manual_seed(4))
    assert draws.shape == (7, *logits.shape)
    if keep is not None:  # padding holds f_MAP
        torch.testing.assert_close(draws[:, ~keep], logits[~keep].expand(7, -1, -1))
    if (
        token
    ):  # with labels, logit_mean_cov's rows are the labelled positions only, at the same values
        labelled = kept(dict(test), la.shift_labels)
        f_l, cov_l = la.logit_mean_cov(test)
        rows = labelled[keep]
        torch.testing.assert_close(f_l, f[rows])
        torch.testing.assert_close(cov_l, cov[rows])


FIXTURE = settings(
    max_examples=4,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


@FIXTURE
@given(seed=st.integers(0, 2**10), prior=st.floats(0.05, 1.0))
def test_mc_link_converges_to_a_dense_monte_carlo_reference(device, seed, prior):
    """``E[softmax(f)]`` under ``N(f, J Σ Jᵀ)`` with Σ dense: within 5 standard errors of n samples."""
    model = TinyNet(seed).to(device).eval()
    x, y = classification_data(8, seed)
    x, y = x.to(device), y.to(device)
    la = DenseLaplace(model, last_layer(model), prior_precision=prior).fit([(x, y)])
    # dense reference: Σ = (H + δ)⁻¹ from dense_curvature, J by autograd, many draws of f
    from partialbayes.curvature import dense_curvature

    H = dense_curvature(model, [(x, y)], la.subset)
    sigma = torch.linalg.inv(H + prior * torch.eye(H.shape[0], dtype=H.dtype, device=H.device))
    params = dict(model.named_parameters())
    names = list(la.subset.names)

    def f_of(*ps):
        return torch.func.functional_call(
            model, {**params, **dict(zip(names, ps, strict=True))}, (x,)
        )

    jac = torch.func.jacrev(f_of, argnums=tuple(range(len(names))))(
        *[params[n].detach() for n in names]
    )
    J = torch.cat([j.reshape(x.shape[0], CLASSES, -1) for j in jac], -1)
    cov = J @ sigma @ J.mT
    f = model(x).detach()
    g = torch.Generator(device=device).manual_seed(seed)
    ref = torch.distributions.MultivariateNormal(f.cpu(), cov.cpu()).sample((20000,))
    ref_p = torch.softmax(ref, -1)
    n = 4000
    got = la.predict(x, link="mc", n_samples=n, generator=g)
    se = ref_p.std(0) / n**0.5
    err = (got.cpu() - ref_p.mean(0)).abs()
    assert bool((err <= 5 * se * (1 + n / 20000) ** 0.5 + 1e-9).all()), float((err / se).max())


def test_regression_predict_is_the_gaussian_predictive_with_noise():
    model = TinyNet(0).eval()
    x, y = _regression_pairs(0)
    la = KronLaplace(model, sparse_kfac(model, 60), likelihood="regression", sigma_noise=0.7).fit(
        [(x, y)]
    )
    f, cov = la.logit_mean_cov(x)
    for link in la.links:
        mean, var = la.predict(x, link=link)
        torch.testing.assert_close(mean, f)
        torch.testing.assert_close(var, cov.diagonal(dim1=-2, dim2=-1) + 0.7**2)


def test_predictive_samples_have_the_linearised_moments():
    model = TinyNet(1).eval()
    x, y = classification_data(3, 1)
    la = KronLaplace(model, sparse_kfac(model, 60), prior_precision=0.3).fit([(x, y)])
    f, cov = la.logit_mean_cov(x)
    n = 20000
    draws = la.predictive_samples(x, n, generator=torch.Generator().manual_seed(0))
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    assert bool(((draws.mean(0) - f).abs() <= 5 * sd / n**0.5).all())
    centred = draws - f
    emp = torch.einsum("nbi,nbj->bij", centred, centred) / n
    # variance of a sample covariance entry: (Σ_ii Σ_jj + Σ_ij²) / n
    tol = 5 * torch.sqrt((sd[:, :, None] ** 2 * sd[:, None, :] ** 2 + cov**2) / n)
    assert bool(((emp - cov).abs() <= tol).all())


def test_grid_val_nll_of_token_outputs_scores_the_kept_positions():
    model = bert_tagger(0)
    train, val = [tagged_batch(3, 5, 0)], tagged_batch(3, 5, 9)
    la = KronLaplace(model, sparse_kfac(model, 60), sharing="expand").fit(train)
    grid = torch.tensor([0.3, 3.0])
    got = la.grid_val_nll([val], grid)
    keep = (val["attention_mask"] == 1) & (val["labels"] != -100)
    y = val["labels"][keep]
    for i, v in enumerate(grid.tolist()):
        la.prior_precision = v
        f, cov = la.logit_mean_cov(val)
        p = _hand_probit(f.double(), cov.double())
        ref = -p[torch.arange(len(y)), y].log().mean()
        torch.testing.assert_close(got[i], ref)


# ----------------------------------------------------------------------------- bad input, deprecations
def test_unknown_batch_kinds_name_the_type_and_the_accepted_ones():
    model = _bert_classifier()
    la = KronLaplace(model, sparse_kfac(model, 60)).fit([_sequence_batch(0)])
    for call in (
        lambda b: KronLaplace(model, sparse_kfac(model, 60)).fit([b]),
        la.predict,
        la.logit_mean_cov,
        lambda b: la.predictive_samples(b, 2),
        lambda b: la.optimize_prior_precision("val_nll", val_loader=[b]),
    ):
        with pytest.raises(TypeError, match=r"batch must be a tensor x, a pair .*got set"):
            call({1, 2})
        with pytest.raises(TypeError, match=r"got tuple of length 3"):
            call((1, 2, 3))


def test_unknown_link_lists_the_offered_ones():
    model = TinyNet(0).eval()
    x, y = classification_data(4, 0)
    la = DiagLaplace(model, last_layer(model)).fit([(x, y)])
    assert la.links == ("probit", "mc", "bridge")
    with pytest.raises(
        ValueError,
        match=r"link='glm' is not offered; DiagLaplace offers \('probit', 'mc', 'bridge'\)",
    ):
        la.predict(x, link="glm")
    with pytest.raises(ValueError, match="n_samples must be a positive int"):
        la.predict(x, link="mc", n_samples=0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        la.predictive_samples(x, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        la.sample(True)
    with pytest.raises(RuntimeError, match="not fitted"):
        DiagLaplace(model, last_layer(model)).predict(x)


def test_the_generator_is_a_keyword_only():
    """The positional generator of sample / sampled (deprecated in 0.3) is removed."""
    model = TinyNet(0).eval()
    x, y = classification_data(4, 0)
    la = KronLaplace(model, sparse_kfac(model, 60)).fit([(x, y)])
    with pytest.raises(TypeError):
        la.sample(2, torch.Generator().manual_seed(1))
    with pytest.raises(TypeError):
        la.sampled(torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        la.sample(1, generator=torch.Generator().manual_seed(0))
        with la.sampled(generator=torch.Generator().manual_seed(0)):
            pass
