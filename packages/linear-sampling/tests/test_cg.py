import torch

from partialbayes.linear_sampling.internal import conjugate_gradients


def test_cg_matches_dense_solve():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(6, 6, generator=g, dtype=torch.float64)
    h = m @ m.T + torch.eye(6, dtype=torch.float64)
    b = torch.randn(6, 2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(conjugate_gradients(lambda v: h @ v, b), torch.linalg.solve(h, b))
