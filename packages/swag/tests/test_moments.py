import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.swag._moments import (
    diagonal_variance,
    ring_append,
    ring_ordered,
    update_moments_,
)


def assert_close(actual, expected, rtol=1e-7, atol=1e-12):
    """numpy's assert_allclose on tensors (torch.testing imports torch.distributed: slow to import)."""
    np.testing.assert_allclose(
        actual.detach().cpu().numpy(), expected.detach().cpu().numpy(), rtol=rtol, atol=atol
    )


@given(
    d=st.integers(1, 6),
    n=st.integers(1, 30),
    k_max=st.integers(2, 8),
    seed=st.integers(0, 2**16),
)
def test_running_moments_and_deviations_match_numpy(d, n, k_max, seed):
    rng = np.random.default_rng(seed)
    snaps = rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=d) + rng.normal(size=d)
    mean = torch.zeros(d, dtype=torch.float64)
    sq = torch.zeros(d, dtype=torch.float64)
    buf = torch.zeros(k_max, d, dtype=torch.float64)
    count = 0
    for i, w in enumerate(torch.from_numpy(snaps)):
        update_moments_(mean, sq, w, i)
        count = ring_append(buf, count, w - mean)
    np.testing.assert_allclose(mean.numpy(), snaps.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        diagonal_variance(mean, sq).numpy(), snaps.var(0), rtol=1e-9, atol=1e-10
    )
    # Column i is snapshot i minus the running mean of snapshots 1..i; the last K are kept, oldest first.
    running = np.cumsum(snaps, 0) / np.arange(1, n + 1)[:, None]
    expected = (snaps - running)[-k_max:].T
    np.testing.assert_allclose(ring_ordered(buf, count).numpy(), expected, rtol=1e-12, atol=1e-12)


def test_variance_is_clamped_at_zero():
    mean = torch.tensor([1.0, 2.0])
    sq = torch.tensor([1.0 - 1e-7, 4.0 + 1.0])
    var = diagonal_variance(mean, sq)
    assert var[0] == 0.0
    assert var[1] == pytest.approx(1.0)
