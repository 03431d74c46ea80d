from contextlib import contextmanager

import pytest
import torch

from partialbayes.predictive import (
    decompose_classification,
    decompose_regression,
    mc_predict,
    mc_predict_regression,
)

F64 = torch.float64


class _ToyPosterior:
    """Gaussian posterior over a linear layer's weight, with the sampled(...) manager posteriors use."""

    def __init__(self, model: torch.nn.Linear, std: float):
        self.model, self.std = model, std

    @contextmanager
    def sampled(self, generator: torch.Generator):
        saved = self.model.weight.detach().clone()
        noise = torch.randn(
            saved.shape, dtype=saved.dtype, device=saved.device, generator=generator
        )
        try:
            with torch.no_grad():
                self.model.weight.add_(self.std * noise)
            yield
        finally:
            with torch.no_grad():
                self.model.weight.copy_(saved)


def _setup(device, n_out=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, n_out).to(device=device, dtype=F64)
    x = torch.randn(5, 3, dtype=F64, device=device)
    return model, x, _ToyPosterior(model, 0.7)


def test_mc_predict_equals_batch_computation_and_restores_weights(device):
    model, x, post = _setup(device)
    w0 = model.weight.detach().clone()
    g = torch.Generator(device=device).manual_seed(0)
    pred = mc_predict(lambda s: post.sampled(g), lambda: model(x), 7)
    # reference: collect all sampled logits with the same generator stream
    g2 = torch.Generator(device=device).manual_seed(0)
    logits = []
    for _ in range(7):
        with post.sampled(g2), torch.no_grad():
            logits.append(model(x))
    f = torch.stack(logits)
    ref = decompose_classification(f)
    torch.testing.assert_close(pred.probs, torch.softmax(f, -1).mean(0))
    torch.testing.assert_close(pred.uncertainty.total, ref.total)
    torch.testing.assert_close(pred.uncertainty.aleatoric, ref.aleatoric)
    torch.testing.assert_close(pred.uncertainty.epistemic, ref.epistemic, atol=1e-12, rtol=1e-9)
    assert pred.n_samples == 7
    assert torch.equal(model.weight, w0)
    assert not pred.probs.requires_grad


def test_mc_predict_passes_sample_index_and_reports_bad_outputs():
    seen = []

    @contextmanager
    def ctx(s):
        seen.append(s)
        yield

    outs = iter([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="shape"):
        mc_predict(ctx, lambda: next(outs), 2)
    assert seen == [0, 1]
    with pytest.raises(ValueError, match="NaN or infinite"):
        mc_predict(ctx, lambda: torch.full((2, 3), float("nan")), 1)
    with pytest.raises(ValueError, match="n_samples"):
        mc_predict(ctx, lambda: torch.zeros(2, 3), 0)
    with pytest.raises(TypeError, match="forward"):
        mc_predict(ctx, torch.zeros(2), 1)


def test_mc_predict_restores_weights_on_error(device):
    model, _, post = _setup(device)
    w0 = model.weight.detach().clone()
    g = torch.Generator(device=device).manual_seed(0)

    def bad_forward():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mc_predict(lambda s: post.sampled(g), bad_forward, 3)
    assert torch.equal(model.weight, w0)


def test_mc_predict_regression_matches_law_of_total_variance(device):
    model, x, post = _setup(device, n_out=2)
    g = torch.Generator(device=device).manual_seed(1)
    noise = torch.tensor([0.1, 0.4], dtype=F64, device=device)
    res = mc_predict_regression(
        lambda s: post.sampled(g), lambda: (model(x), noise.expand(5, 2)), 9
    )
    g2 = torch.Generator(device=device).manual_seed(1)
    means = []
    for _ in range(9):
        with post.sampled(g2), torch.no_grad():
            means.append(model(x))
    m = torch.stack(means)
    ref = decompose_regression(m, noise)
    torch.testing.assert_close(res.mean, m.mean(0))
    torch.testing.assert_close(res.var, ref.total)
    torch.testing.assert_close(res.uncertainty.epistemic, ref.epistemic)
    homo = mc_predict_regression(lambda s: post.sampled(g), lambda: model(x), 3, noise_var=0.5)
    torch.testing.assert_close(
        homo.uncertainty.aleatoric, torch.full((5, 2), 0.5, dtype=F64, device=device)
    )
