import torch

from partialbayes.ivon import hessian_update


def test_stays_positive_for_negative_estimates():
    h = torch.full((100,), 0.5, dtype=torch.float64)
    h_hat = torch.linspace(-50, 50, 100, dtype=torch.float64)
    assert (hessian_update(h, h_hat, 0.9, 1e-4) > 0).all()


def test_fixed_point():
    h = torch.tensor([2.0], dtype=torch.float64)
    torch.testing.assert_close(hessian_update(h, h, 0.99, 0.1), h)
