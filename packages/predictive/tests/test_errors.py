import math

import pytest
import torch

from partialbayes.predictive import (
    accuracy,
    auroc,
    brier,
    ece,
    gaussian_nll,
    gaussian_predictive,
    laplace_bridge,
    mc_predictive,
    nll,
    probit,
    probit_binary,
    reliability,
    sample_logits,
)

P = torch.tensor([[0.2, 0.8], [0.6, 0.4]])
Y = torch.tensor([1, 0])


@pytest.mark.parametrize("fn", [accuracy, nll, brier, ece, reliability])
def test_probability_checks(fn):
    with pytest.raises(ValueError, match="probs rows must sum to 1"):
        fn(torch.tensor([[0.3, 0.3], [0.5, 0.5]]), Y)
    with pytest.raises(ValueError, match="probs has negative"):
        fn(torch.tensor([[-0.5, 1.5], [0.5, 0.5]]), Y)
    with pytest.raises(ValueError, match="probs contains 1 NaN"):
        fn(torch.tensor([[math.nan, 0.5], [0.5, 0.5]]), Y)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        fn(P, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"labels must lie in"):
        fn(P, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"labels must have shape \[2\]"):
        fn(P, torch.tensor([0, 1, 1]))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        fn(P, torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match=r"probs must be a torch\.Tensor"):
        fn([[0.5, 0.5]], Y)
    with pytest.raises(ValueError, match=r"probs must have shape \[N, C\]"):
        fn(torch.full((2, 2, 2), 0.5), Y)


def test_calibration_argument_checks():
    with pytest.raises(ValueError, match="n_bins"):
        ece(P, Y, n_bins=0)
    with pytest.raises(ValueError, match="binning"):
        ece(P, Y, binning="quantile")
    with pytest.raises(ValueError, match="reduction"):
        nll(P, Y, reduction="avg")


@pytest.mark.parametrize("fn", [probit, laplace_bridge, mc_predictive])
def test_gaussian_logit_checks(fn):
    mu = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cov must be non-negative"):
        fn(mu, torch.tensor([[1.0, -1.0]] * 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="cov must have shape"):
        fn(mu, torch.ones(3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="mean contains 1 NaN"):
        fn(
            torch.tensor([[math.inf, 0.0]] * 1 + [[0.0, 0.0]] * 2, dtype=torch.float64),
            torch.ones(3, 2, dtype=torch.float64),
        )
    asym = torch.tensor([[[1.0, 0.5], [0.0, 1.0]]] * 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="cov must be symmetric"):
        fn(mu, asym)  # probit reads only the diagonal, but an asymmetric matrix is no covariance
    with pytest.raises(ValueError, match="cov is not positive semi-definite"):
        fn(mu, torch.tensor([[[-1.0, 0.0], [0.0, 1.0]]] * 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="share a dtype"):
        fn(mu, torch.ones(3, 2, dtype=torch.float32))
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_other_argument_checks():
    with pytest.raises(ValueError, match="var must have the shape of mean"):
        probit_binary(torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="var must be non-negative"):
        probit_binary(torch.zeros(2), torch.tensor([1.0, -0.1]))
    with pytest.raises(ValueError, match="n_samples"):
        mc_predictive(torch.zeros(1, 2), torch.ones(1, 2), 0)
    with pytest.raises(TypeError, match="n_samples"):
        sample_logits(torch.zeros(1, 2), torch.ones(1, 2), 2.5)
    with pytest.raises(ValueError, match="at least 2 classes"):
        laplace_bridge(torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="positive logit variances"):
        laplace_bridge(torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 1.0]]), correct_mean=False)
    with pytest.raises(ValueError, match="noise_var must be a finite number >= 0"):
        gaussian_predictive(torch.zeros(2), torch.ones(2), -1.0)
    with pytest.raises(ValueError, match="noise_var of shape"):
        gaussian_predictive(torch.zeros(2), torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="var must be strictly positive"):
        gaussian_nll(torch.zeros(2), torch.tensor([1.0, 0.0]), torch.zeros(2))
    with pytest.raises(ValueError, match="targets shape"):
        gaussian_nll(torch.zeros(2), 1.0, torch.zeros(3))
    with pytest.raises(ValueError, match="both classes"):
        auroc(torch.randn(4), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"positives must lie in \[0, 2\); got values in \[0, 2\]"):
        auroc(torch.randn(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="scores contains"):
        auroc(torch.tensor([0.0, math.nan]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"positives must have shape \[3\], got \(2,\)"):
        auroc(torch.randn(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"positives must have shape \[3\]"):  # bool ones too
        auroc(torch.randn(3), torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"scores must have shape \[N\]"):
        auroc(torch.randn(3, 1), torch.tensor([0, 1, 1]))
