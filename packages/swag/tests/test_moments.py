import torch

from partialbayes.swag import update_moments


def test_moments_match_batch_statistics():
    g = torch.Generator().manual_seed(1)
    snaps = torch.randn(7, 4, generator=g, dtype=torch.float64)
    m = torch.zeros(4, dtype=torch.float64)
    s = torch.zeros(4, dtype=torch.float64)
    for i, w in enumerate(snaps):
        m, s = update_moments(m, s, w, i)
    torch.testing.assert_close(m, snaps.mean(0))
    torch.testing.assert_close(s - m**2, snaps.var(0, unbiased=False))
