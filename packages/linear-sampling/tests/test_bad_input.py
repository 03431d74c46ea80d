"""Bad input to every public entry point gets a ValueError / TypeError naming what is wrong (issue #16)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.linear_sampling import (
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    effective_dimension,
    fit_prior_precision,
    mackay_update,
    posterior_mean,
    posterior_samples,
    softmax_hessian,
)
from partialbayes.linear_sampling._em import feature_scales
from partialbayes.linear_sampling._features import scale_features
from partialbayes.linear_sampling.internal import conjugate_gradients

F64 = torch.float64
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def small(n=8, m=1, d=3):
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(n, m, d, generator=g, dtype=F64)
    return Features.dense(phi), torch.randn(n, m, generator=g, dtype=F64)


def spd(d=4):
    g = torch.Generator().manual_seed(1)
    m = torch.randn(d, d, generator=g, dtype=F64)
    return m @ m.T + torch.eye(d, dtype=F64)


# --- conjugate_gradients -----------------------------------------------------------------------


@given(
    d=st.integers(1, 6),
    k=st.integers(1, 3),
    row=st.integers(0, 5),
    col=st.integers(0, 2),
    bad=NON_FINITE,
    vector=st.booleans(),
)
def test_cg_refuses_non_finite_right_hand_sides(d, k, row, col, bad, vector):
    # Before the fix, NaN / inf in b made every column look converged and CG returned zeros.
    h = spd(d)
    b = torch.ones(d, dtype=F64) if vector else torch.ones(d, k, dtype=F64)
    if vector:
        b[row % d] = bad
    else:
        b[row % d, col % k] = bad
    with pytest.raises(ValueError, match="right-hand side b has non-finite"):
        conjugate_gradients(lambda v: h @ v, b)


def test_cg_bad_arguments():
    h = spd(3)
    b = torch.ones(3, dtype=F64)
    with pytest.raises(TypeError, match="matvec must be callable"):
        conjugate_gradients(h, b)
    with pytest.raises(TypeError, match="b must be a floating tensor"):
        conjugate_gradients(lambda v: h @ v, torch.ones(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="b must be a floating tensor"):
        conjugate_gradients(lambda v: h @ v, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"b must have shape \[d\] or \[d, k\]"):
        conjugate_gradients(lambda v: v, torch.ones(2, 2, 2, dtype=F64))
    for tol in (-1.0, math.nan, math.inf, True):
        with pytest.raises(TypeError if tol is True else ValueError, match="tol"):
            conjugate_gradients(lambda v: h @ v, b, tol=tol)
    for max_iter in (0, -3, 2.5, True):
        with pytest.raises(
            TypeError
            if isinstance(max_iter, bool) or not isinstance(max_iter, int)
            else ValueError,
            match="max_iter",
        ):
            conjugate_gradients(lambda v: h @ v, b, max_iter=max_iter)


def test_cg_names_a_bad_matvec():
    b = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match=r"matvec returned \(2,\) for an input of shape \(3,\)"):
        conjugate_gradients(lambda v: v[:2], b)
    with pytest.raises(ValueError, match="matvec returned NaN or inf"):
        conjugate_gradients(lambda v: v * math.nan, b)
    with pytest.raises(ValueError, match="matvec returned list"):
        conjugate_gradients(lambda v: v.tolist(), b)
    with pytest.raises(ValueError, match="not positive definite"):
        conjugate_gradients(lambda v: -v, b)


# --- posterior_mean / posterior_samples ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(4,), (3, 2), (1, 3), (3, 1, 1), ()], ids=lambda s: "x".join(map(str, s)) or "scalar"
)
def test_init_of_the_wrong_shape_names_the_expected_one(shape):
    feats, y = small()
    for method in ("cg", "sgd"):
        with pytest.raises(ValueError, match=r"init has shape .* expect \[d\] = \[3\]"):
            posterior_mean(
                feats, y, NoisePrecision(1.0), Prior(1.0), method=method, init=torch.zeros(shape)
            )


def test_init_bad_values():
    feats, y = small()
    with pytest.raises(ValueError, match="init contains 1 NaN or infinite"):
        posterior_mean(
            feats, y, NoisePrecision(1.0), Prior(1.0), init=torch.tensor([0.0, math.nan, 0.0])
        )
    with pytest.raises(TypeError, match="init must be a floating tensor"):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), init=torch.zeros(3, dtype=int))
    with pytest.raises(
        TypeError, match=r"init must be a floating tensor of shape \[3\] or None, got list"
    ):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), init=[0.0, 0.0, 0.0])
    ok = posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), init=torch.zeros(3, 1))
    assert ok.info.converged  # [d, 1] is accepted


def test_sgd_settings_with_cg_are_an_error():
    # Before the fix they were silently ignored.
    feats, y = small()
    cfg = SGDConfig(batch_size=2)
    with pytest.raises(ValueError, match="sgd settings were given but method='cg'"):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), sgd=cfg)
    with pytest.raises(ValueError, match="sgd settings were given but method='cg'"):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), 2, method="cg", sgd=cfg)
    with pytest.raises(ValueError, match="sgd settings were given but method='cg'"):
        fit_prior_precision(feats, y, NoisePrecision(1.0), Prior(1.0), sgd=cfg)
    with pytest.raises(TypeError, match="sgd must be an SGDConfig"):
        posterior_mean(
            feats, y, NoisePrecision(1.0), Prior(1.0), method="sgd", sgd={"batch_size": 2}
        )


@given(bad=NON_FINITE, row=st.integers(0, 7))
def test_non_finite_targets(bad, row):
    feats, y = small()
    y = y.clone()
    y[row] = bad
    for method in ("cg", "sgd"):
        with pytest.raises(ValueError, match="targets have non-finite"):
            posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), method=method)
    with pytest.raises(ValueError, match="targets have non-finite"):
        fit_prior_precision(feats, y, NoisePrecision(1.0), Prior(1.0))


@pytest.mark.parametrize("k", [0, -1, True, 2.0, "3", None])
def test_bad_sample_counts(k):
    feats, _ = small()
    with pytest.raises(
        TypeError if isinstance(k, bool) or not isinstance(k, int) else ValueError,
        match="k must be",
    ):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), k)


@pytest.mark.parametrize("batch_size", [0, -4, True, 2.5])
def test_bad_batch_sizes(batch_size):
    feats, y = small()
    error = (
        TypeError if isinstance(batch_size, bool) or not isinstance(batch_size, int) else ValueError
    )
    with pytest.raises(error, match="batch_size must be"):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), batch_size=batch_size)
    with pytest.raises(error, match="batch_size must be"):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), 2, batch_size=batch_size)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tol": math.nan}, ValueError, "tol"),
        ({"tol": -1.0}, ValueError, "tol"),
        ({"tol": "small"}, TypeError, "tol"),
        ({"max_iter": 0}, ValueError, "max_iter"),
        ({"max_iter": True}, TypeError, "max_iter"),
        ({"method": "adam"}, ValueError, "method"),
        ({"generator": 0}, TypeError, "generator"),
    ],
)
def test_bad_solver_options(kwargs, error, match):
    feats, y = small()
    with pytest.raises(error, match=match):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), **kwargs)
    with pytest.raises(error, match=match):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), 2, **kwargs)


def test_wrong_types_of_the_model_pieces():
    feats, y = small()
    with pytest.raises(TypeError, match="features must be Features"):
        posterior_mean(feats.matrix, y, NoisePrecision(1.0), Prior(1.0))
    with pytest.raises(TypeError, match="prior must be a Prior"):
        posterior_samples(feats, NoisePrecision(1.0), 1.0, 2)
    with pytest.raises(TypeError, match="noise must be a NoisePrecision"):
        fit_prior_precision(feats, y, 1.0, Prior(1.0))
    with pytest.raises(TypeError, match="targets must be a tensor"):
        posterior_mean(feats, y.tolist(), NoisePrecision(1.0), Prior(1.0))


# --- SGDConfig -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": 0.0}, ValueError, "lr"),
        ({"lr": math.nan}, ValueError, "lr"),
        ({"lr": math.inf}, ValueError, "lr"),
        ({"lr": "0.1"}, TypeError, "lr"),
        ({"lr_scale": 0.0}, ValueError, "lr_scale"),
        ({"lr_scale": math.nan}, ValueError, "lr_scale"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"momentum": math.nan}, ValueError, "momentum"),
        ({"polyak": 1.0}, ValueError, "polyak"),
        ({"polyak": -0.5}, ValueError, "polyak"),
        ({"variance_reduction": 1}, TypeError, "variance_reduction"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": True}, TypeError, "batch_size"),
        ({"batch_size": 8.0}, TypeError, "batch_size"),
        ({"max_epochs": 0}, ValueError, "max_epochs"),
        ({"max_epochs": False}, TypeError, "max_epochs"),
        ({"tol": -1e-3}, ValueError, "tol"),
        ({"tol": math.inf}, ValueError, "tol"),
        ({"check_every": 0}, ValueError, "check_every"),
        ({"divergence_factor": 1.0}, ValueError, "divergence_factor"),
        ({"divergence_factor": math.nan}, ValueError, "divergence_factor"),
    ],
)
def test_bad_sgd_config(kwargs, error, match):
    with pytest.raises(error, match=f"SGDConfig.{match}"):
        SGDConfig(**kwargs)


# --- Features, NoisePrecision, Prior, softmax_hessian -------------------------------------------


@pytest.mark.parametrize("name", ["n", "m", "d"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_bad_feature_sizes(name, value):
    feats, _ = small()
    sizes = {"n": 8, "m": 1, "d": 3, name: value}
    with pytest.raises(
        TypeError if isinstance(value, bool) or not isinstance(value, int) else ValueError,
        match=f"Features.{name} must be",
    ):
        Features(feats.jvp, feats.vjp, dtype=F64, device=torch.device("cpu"), **sizes)


def test_bad_features():
    feats, _ = small()
    with pytest.raises(TypeError, match=r"Features\.dtype"):
        Features(feats.jvp, feats.vjp, 8, 1, 3, torch.int64, torch.device("cpu"))
    with pytest.raises(TypeError, match="callable"):
        Features(None, feats.vjp, 8, 1, 3, F64, torch.device("cpu"))
    with pytest.raises(TypeError, match="phi must be a floating-point tensor"):
        Features.dense(torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"phi must have shape \[n, d\] or \[n, m, d\]"):
        Features.dense(torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match=r"scale has shape \(2,\)"):
        scale_features(feats, torch.ones(2, dtype=F64))
    with pytest.raises(ValueError, match="scale must be positive and finite"):
        scale_features(feats, torch.tensor([1.0, math.nan, 1.0], dtype=F64))


@given(bad=NON_FINITE, pos=st.integers(0, 2))
def test_non_finite_precisions(bad, pos):
    v = torch.ones(3, dtype=F64)
    v[pos] = bad
    with pytest.raises(ValueError, match="noise precision"):
        NoisePrecision(v)
    with pytest.raises(ValueError, match="prior precision alpha"):
        Prior(v, torch.tensor([0, 1, 2]))


def test_precision_wrong_types():
    for value in (True, torch.ones(3, dtype=torch.int64), "1.0"):
        with pytest.raises(TypeError, match="noise precision"):
            NoisePrecision(value)
        with pytest.raises(TypeError, match="prior precision alpha"):
            Prior(value)
    with pytest.raises(TypeError, match="groups must be"):
        Prior(torch.ones(2, dtype=F64), [0, 1])
    with pytest.raises(TypeError, match="groups must be an integer tensor"):
        Prior(torch.ones(2, dtype=F64), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"groups must lie in \[0, 2\); got values in \[0, 2\]"):
        Prior(torch.ones(2, dtype=F64), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"groups must have shape \[2\], got \(1, 2\)"):
        Prior(torch.ones(2, dtype=F64), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        softmax_hessian(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="jitter"):
        softmax_hessian(torch.zeros(3, 2), jitter=math.nan)


# --- EM -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"k": 0}, ValueError, "k must be"),
        ({"k": True}, TypeError, "k must be"),
        ({"max_iter": 0}, ValueError, "max_iter"),
        ({"tol": 0.0}, ValueError, "tol"),
        ({"tol": math.nan}, ValueError, "tol"),
        ({"method": "lbfgs"}, ValueError, "method"),
        ({"estimator": "both"}, ValueError, "estimator"),
        ({"g_prior": "yes"}, TypeError, "g_prior"),
        ({"generator": 3}, TypeError, "generator"),
    ],
)
def test_bad_em_options(kwargs, error, match):
    feats, y = small()
    with pytest.raises(error, match=match):
        fit_prior_precision(feats, y, NoisePrecision(1.0), Prior(1.0), **kwargs)


def test_em_pieces_refuse_non_finite_values():
    feats, _ = small()
    with pytest.raises(ValueError, match="samples have non-finite"):
        effective_dimension(
            feats, NoisePrecision(1.0), Prior(1.0), torch.full((3, 2), math.nan, dtype=F64)
        )
    with pytest.raises(ValueError, match="mean has non-finite"):
        mackay_update(torch.tensor([1.0, math.nan, 1.0]), torch.tensor([1.0]), Prior(1.0))
    with pytest.raises(ValueError, match="gamma has non-finite"):
        mackay_update(torch.ones(3), torch.tensor([math.inf]), Prior(1.0))
    with pytest.raises(ValueError, match="n_probes"):
        feature_scales(feats, NoisePrecision(1.0), n_probes=0)
