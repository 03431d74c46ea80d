import pytest
import torch
from torch import nn

from partialbayes.linear_sampling import (
    DivergenceError,
    Features,
    NoisePrecision,
    Prior,
    SGDConfig,
    fit_prior_precision,
    mackay_update,
    network_features,
    posterior_mean,
    posterior_samples,
    softmax_hessian,
)

F64 = torch.float64


def small(n=8, m=2, d=3):
    g = torch.Generator().manual_seed(0)
    return Features.dense(torch.randn(n, m, d, generator=g, dtype=F64)), torch.randn(
        n, m, generator=g, dtype=F64
    )


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_or_non_finite_noise_precision(value):
    with pytest.raises(ValueError, match="noise precision"):
        NoisePrecision(torch.tensor(value, dtype=F64))
    with pytest.raises(ValueError, match="noise precision"):
        NoisePrecision(torch.tensor([1.0, value], dtype=F64))


def test_noise_matrices_are_refused_with_the_whitening_alternative():
    with pytest.raises(ValueError, match=r"use the features L_nᵀ Φ_n with NoisePrecision\(1.0\)"):
        NoisePrecision(torch.eye(2, dtype=F64).repeat(3, 1, 1))


@pytest.mark.parametrize("alpha", [0.0, -2.0, float("nan")])
def test_non_positive_prior_precision(alpha):
    with pytest.raises(ValueError, match="prior precision alpha"):
        Prior(alpha)
    with pytest.raises(ValueError, match="prior precision alpha"):
        Prior(torch.tensor([1.0, alpha], dtype=F64), torch.tensor([0, 1]))


def test_prior_groups_out_of_range():
    with pytest.raises(ValueError, match=r"groups must lie in \[0, 2\); got values in \[0, 2\]"):
        Prior(torch.ones(2, dtype=F64), torch.tensor([0, 2, 1]))


def test_softmax_hessian_bad_inputs():
    with pytest.raises(ValueError, match="jitter"):
        softmax_hessian(torch.zeros(3, 2), jitter=0.0)
    with pytest.raises(ValueError, match="non-finite"):
        softmax_hessian(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"\[n, m\]"):
        softmax_hessian(torch.zeros(3))


def test_shape_mismatches_name_both_shapes():
    feats, y = small()
    with pytest.raises(ValueError, match=r"shape \(8, 3\).*\(n, m\) = \(8, 2\)"):
        posterior_mean(feats, torch.zeros(8, 3, dtype=F64), NoisePrecision(1.0), Prior(1.0))
    with pytest.raises(ValueError, match=r"shape \(5,\).*n=8, m=2"):
        posterior_mean(feats, y, NoisePrecision(torch.ones(5, dtype=F64)), Prior(1.0))
    with pytest.raises(ValueError, match=r"shape \(4, 1\).*\(d=3, k\)"):
        feats.apply(torch.arange(2), torch.zeros(4, 1, dtype=F64))
    with pytest.raises(ValueError, match=r"prior groups has 2 entries but d=3"):
        posterior_mean(
            feats, y, NoisePrecision(1.0), Prior(torch.ones(2, dtype=F64), torch.tensor([0, 1]))
        )


def test_operator_returning_wrong_shape_is_reported():
    feats, y = small()
    bad = Features(
        lambda idx, z: torch.zeros(idx.shape[0], 5, z.shape[1], dtype=F64),
        feats.vjp,
        8,
        2,
        3,
        F64,
        torch.device("cpu"),
    )
    with pytest.raises(
        ValueError, match=r"jvp returned shape \(8, 5, 1\), expected \(b, m, k\) = \(8, 2, 1\)"
    ):
        posterior_mean(bad, y, NoisePrecision(1.0), Prior(1.0))


def test_non_finite_features():
    phi = torch.randn(4, 3, dtype=F64)
    phi[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite entries \(observations \[2\]\)"):
        Features.dense(phi)
    feats, _y = small()
    nan_op = Features(
        lambda idx, z: feats.jvp(idx, z) * float("nan"),
        feats.vjp,
        8,
        2,
        3,
        F64,
        torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="non-finite features"):
        posterior_samples(nan_op, NoisePrecision(1.0), Prior(1.0), 2, method="sgd")


def test_divergence_stops_with_advice():
    feats, y = small(n=40)
    with pytest.raises(DivergenceError, match="lower the learning rate") as info:
        posterior_mean(
            feats, y, NoisePrecision(1.0), Prior(1.0), method="sgd", sgd=SGDConfig(lr=10.0)
        )
    assert "lr=10" in str(info.value)
    with pytest.raises(DivergenceError, match="lower the learning rate"):
        posterior_samples(
            feats,
            NoisePrecision(1.0),
            Prior(1.0),
            3,
            sgd=SGDConfig(lr=10.0, batch_size=8, variance_reduction=False),
            generator=torch.Generator().manual_seed(0),
        )


def test_automatic_step_that_is_too_large_is_halved_and_reported():
    feats, _ = small(n=40)
    out = posterior_samples(
        feats,
        NoisePrecision(1.0),
        Prior(1.0),
        3,
        sgd=SGDConfig(lr_scale=20.0, batch_size=8),
        generator=torch.Generator().manual_seed(0),
    )
    first, last = out.info.history[0]["lr"], out.info.lr
    assert out.info.converged
    assert last is not None
    assert last < first / 2


def test_bad_options():
    feats, y = small()
    with pytest.raises(ValueError, match="method"):
        posterior_mean(feats, y, NoisePrecision(1.0), Prior(1.0), method="adam")
    with pytest.raises(ValueError, match="objective"):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), 2, objective="fast")
    with pytest.raises(ValueError, match="k must be"):
        posterior_samples(feats, NoisePrecision(1.0), Prior(1.0), 0)
    with pytest.raises(ValueError, match="momentum"):
        SGDConfig(momentum=1.0)
    with pytest.raises(TypeError, match="noise must be"):
        posterior_mean(feats, y, 1.0, Prior(1.0))
    with pytest.raises(ValueError, match="estimator"):
        fit_prior_precision(feats, y, NoisePrecision(1.0), Prior(1.0), estimator="both")


def test_mackay_update_rejects_non_positive_gamma():
    with pytest.raises(ValueError, match=r"group 0 .* draw more samples"):
        mackay_update(torch.ones(3, dtype=F64), torch.tensor([-0.5], dtype=F64), Prior(1.0))


def test_network_features_bad_inputs():
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="training mode"):
        network_features(model, x, ["0.weight"])
    model.eval()
    with pytest.raises(ValueError, match=r"unknown parameter '1.weight'"):
        network_features(model, x, ["0.weight", "1.weight"])
    with pytest.raises(ValueError, match=r"MaskBlock for '0.weight' has shape \(3, 2\)"):
        network_features(model, x, {"0.weight": torch.ones(3, 2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="selects no entries"):
        network_features(model, x, {"0.weight": torch.zeros(2, 3, dtype=torch.bool)})
    with pytest.raises(ValueError, match="empty"):
        network_features(model, x, [])
    with pytest.raises(TypeError, match="params must be"):
        network_features(model, x, 3)
    with pytest.raises(TypeError, match=r"dtype torch\.bool"):
        network_features(model, x, {"0.weight": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="batch 0: cannot tell the batch size"):
        network_features(model, {"a": torch.zeros(3, 1), "b": torch.zeros(4, 1)}, ["0.weight"])
