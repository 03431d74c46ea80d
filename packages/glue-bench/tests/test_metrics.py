import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.glue_bench.experiment import all_metrics
from partialbayes.glue_bench.methods import temperature_or_grid


def _draw(seed, n, c):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(n, c, generator=g, dtype=torch.float64), -1)
    labels = torch.randint(0, c, (n,), generator=g)
    return probs, labels


def _ece_reference(probs, labels, n_bins):
    p, y = probs.numpy(), labels.numpy()
    conf, pred = p.max(1), p.argmax(1)
    order = np.argsort(conf, kind="stable")
    bins = np.array_split(order, min(n_bins, len(order)))
    return sum(len(b) / len(y) * abs((pred[b] == y[b]).mean() - conf[b].mean()) for b in bins)


@given(st.integers(0, 10_000), st.integers(1, 60), st.integers(2, 5))
def test_metrics_match_numpy_reference(seed, n, c):
    probs, labels = _draw(seed, n, c)
    p, y = probs.numpy(), labels.numpy()
    metrics = all_metrics(probs, labels)
    assert metrics["accuracy"] == pytest.approx((p.argmax(1) == y).mean())
    assert metrics["nll"] == pytest.approx(-np.log(p[np.arange(n), y]).mean())
    onehot = np.eye(c)[y]
    assert metrics["brier"] == pytest.approx(((p - onehot) ** 2).sum(1).mean())
    assert metrics["ece"] == pytest.approx(_ece_reference(probs, labels, 20))


def test_ece_equal_mass_bins_exact_case():
    # 40 examples, the paper's 20 equal-mass bins of 2: bin k holds two examples of confidence c_k, both
    # right for even k and one right for odd k, so ECE = (1/20) sum_k |acc_k - c_k|
    conf = [0.55 + 0.02 * k for k in range(20)]
    probs = torch.tensor([[c, 1 - c] for c in conf for _ in range(2)], dtype=torch.float64)
    labels = torch.tensor([0 if k % 2 == 0 or i == 0 else 1 for k in range(20) for i in range(2)])
    metrics = all_metrics(probs, labels)
    acc = [1.0 if k % 2 == 0 else 0.5 for k in range(20)]
    assert metrics["ece"] == pytest.approx(
        sum(abs(a - c) for a, c in zip(acc, conf, strict=True)) / 20
    )
    assert metrics["reliability"]["count"] == [2] * 20
    assert set(metrics) == {"accuracy", "nll", "ece", "brier", "reliability"}


def test_metric_bad_input():
    probs = torch.full((3, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="labels must lie in"):
        all_metrics(probs, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="NaN"):
        all_metrics(torch.full((3, 2), float("nan")), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="labels must have shape"):
        all_metrics(probs, torch.tensor([0, 1]))


def test_temperature_recovers_generating_temperature():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(4000, 3, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2.5, -1), 1, generator=g).squeeze(1)
    t = temperature_or_grid(logits, labels)
    # standard error of a 1-parameter MLE on 4000 points is a few percent
    assert t == pytest.approx(2.5, rel=0.1)


def test_temperature_falls_back_to_the_grid_when_predictive_refuses():
    # separable validation set: the NLL keeps falling as T -> 0, predictive.fit_temperature refuses
    logits = torch.tensor([[2.0, -2.0], [-1.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0])
    with pytest.warns(UserWarning, match="best grid temperature"):
        t = temperature_or_grid(logits, labels)
    assert t == pytest.approx(0.01)
