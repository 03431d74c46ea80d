import pytest
import torch

from partialbayes.curvature import kfac_factors


def test_one_datum_kfac_equals_dense_ef_block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, generator=g, dtype=torch.float64)
    d = torch.randn(1, 2, generator=g, dtype=torch.float64)
    G, A = kfac_factors(x, d)
    grad = (d.T @ x).reshape(-1)  # row-major vec of the (n_out x n_in) weight gradient
    torch.testing.assert_close(torch.kron(G, A), torch.outer(grad, grad))


def test_shape_mismatch():
    with pytest.raises(ValueError, match="inputs"):
        kfac_factors(torch.zeros(2, 3), torch.zeros(3, 2))
