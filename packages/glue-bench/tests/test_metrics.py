import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.glue_bench.methods import temperature_or_grid
from partialbayes.glue_bench.metrics import accuracy, all_metrics, brier, ece, nll


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


@given(st.integers(0, 10_000), st.integers(1, 60), st.integers(2, 5), st.integers(1, 25))
def test_metrics_match_numpy_reference(seed, n, c, n_bins):
    probs, labels = _draw(seed, n, c)
    p, y = probs.numpy(), labels.numpy()
    assert accuracy(probs, labels) == pytest.approx((p.argmax(1) == y).mean())
    assert nll(probs, labels) == pytest.approx(-np.log(p[np.arange(n), y]).mean())
    onehot = np.eye(c)[y]
    assert brier(probs, labels) == pytest.approx(((p - onehot) ** 2).sum(1).mean())
    assert ece(probs, labels, n_bins) == pytest.approx(_ece_reference(probs, labels, n_bins))


def test_ece_equal_mass_bins_exact_case():
    # 4 examples, 2 bins of 2: confidences (0.6, 0.7) both right, (0.8, 0.9) one right
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2], [0.1, 0.9]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])
    assert ece(probs, labels, n_bins=2) == pytest.approx(
        0.5 * abs(1 - 0.65) + 0.5 * abs(0.5 - 0.85)
    )
    assert set(all_metrics(probs, labels)) == {"accuracy", "nll", "ece", "brier", "reliability"}


def test_metric_bad_input():
    probs = torch.full((3, 2), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="labels must lie in"):
        nll(probs, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="NaN"):
        ece(torch.full((3, 2), float("nan")), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="labels must have shape"):
        brier(probs, torch.tensor([0, 1]))


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
